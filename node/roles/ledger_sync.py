"""Every node's ledger replica: events from gossip, plus a pull-based sync that repairs what
gossip missed (a partition, a restart), so replicas converge on the same grow-only set.

``/swarm-node/<run>/ledger-sync/1``: a request is msgpack ``["ids"]`` (answer: the ids we hold)
or ``["get", [id, ...]]`` (answer: those events' envelopes, at most ``MAX_BATCH``) or
``["evidence", submission_id]`` (answer: ``[submissions, verdicts]``, the envelopes this node
keeps about that submission, what an audit bundle is made of; empty lists when it keeps none).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import msgpack
import trio

from node.runtime import Node
from swarm.errors import MalformedError, PeerError, SwarmError
from swarm.ledger import LedgerStore
from swarm.messages import LedgerEvent, Signed, Verdict, decode
from swarm.net import StreamLimits

log = logging.getLogger(__name__)

SYNC = "ledger-sync"
MAX_BATCH = 512
SYNC_LIMITS = StreamLimits(max_request=32 * MAX_BATCH + 1024, max_response=8 * 1024 * 1024)


def _unpack_answer(peer: str, answer: bytes) -> Any:
    """A peer's ledger-sync answer; ``PeerError`` when it is not msgpack (the sync loop then
    moves on to another peer instead of dying)."""
    try:
        return msgpack.unpackb(answer, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise PeerError(f"{peer} sent a malformed ledger-sync answer: {exc}") from exc


class LedgerReplica:
    def __init__(self, node: Node, store: LedgerStore, *, every_s: float = 10.0) -> None:
        self.node = node
        self.store = store
        self.every_s = every_s
        self.synced_events = 0

    async def _on_gossip(self, signed: Signed[Any]) -> None:
        try:
            if signed.envelope.kind == LedgerEvent.KIND:
                self.store.add([signed])
            elif signed.envelope.kind == Verdict.KIND:
                self.store.add_verdict(signed)
        except SwarmError as exc:
            log.warning("%s refused: %s", signed.envelope.kind, exc)

    async def _on_sync(self, peer: str, body: bytes) -> bytes:
        try:
            request = msgpack.unpackb(body, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise MalformedError(f"bad ledger-sync request: {exc}") from exc
        if not isinstance(request, list) or not request:
            raise MalformedError("a ledger-sync request is a non-empty msgpack array")
        op = request[0]
        if op == "ids":
            return msgpack.packb(sorted(self.store.ids()), use_bin_type=True)  # type: ignore[no-any-return]
        if op == "get" and len(request) > 1 and isinstance(request[1], list):
            wanted = [bytes(i) for i in request[1][:MAX_BATCH] if isinstance(i, bytes)]
            return msgpack.packb(list(self.store.raw_events(wanted)), use_bin_type=True)  # type: ignore[no-any-return]
        if op == "evidence" and len(request) > 1 and isinstance(request[1], bytes):
            subject = request[1]
            answer = [
                self.store.evidence(subject, "submission"),
                self.store.evidence(subject, "verdict"),
            ]
            return msgpack.packb(answer, use_bin_type=True)  # type: ignore[no-any-return]
        raise MalformedError(f"unknown ledger-sync operation {op!r}")

    async def sync_with(self, peer: str) -> int:
        """Pull every event ``peer`` holds that we do not; returns how many were new."""
        ids = _unpack_answer(
            peer, await self.node.request(peer, SYNC, msgpack.packb(["ids"]), SYNC_LIMITS)
        )
        missing = [i for i in ids if isinstance(i, bytes)] if isinstance(ids, list) else []
        missing = sorted(set(missing) - self.store.ids())
        added = 0
        for start in range(0, len(missing), MAX_BATCH):
            body = msgpack.packb(["get", missing[start : start + MAX_BATCH]], use_bin_type=True)
            raws = _unpack_answer(peer, await self.node.request(peer, SYNC, body, SYNC_LIMITS))
            events = []
            for raw in raws if isinstance(raws, list) else []:
                try:
                    events.append(decode(raw, LedgerEvent))
                except SwarmError as exc:
                    log.warning("peer %s sent a bad ledger event: %s", peer[-8:], exc)
            for event in events:  # one by one: a bad event must not keep the good ones out
                try:
                    added += len(self.store.add([event]))
                except SwarmError as exc:
                    log.warning("peer %s sent a ledger event the rules refuse: %s", peer[-8:], exc)
        self.synced_events += added
        return added

    async def run(self) -> None:
        self.node.subscribe_ledger(self._on_gossip)
        self.node.handle(SYNC, self._on_sync, SYNC_LIMITS)
        while True:
            await trio.sleep(self.every_s)
            peers = [
                p for ps in self.node.peers_by_role().values() for p in ps if p != self.node.peer_id
            ]
            if not peers:
                continue
            peer = random.choice(peers)
            try:
                await self.sync_with(peer)
            except SwarmError as exc:
                log.info("ledger sync with %s failed: %s", peer[-8:], exc)
