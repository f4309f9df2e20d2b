"""Every node's ledger replica: verdicts and events from gossip, plus a pull-based sync that
repairs what gossip missed (a partition, a restart), so replicas converge on the same set.

Gossip brings a verdict before its events (validators publish in that order); an event that
still arrives first waits in the store's ``pending`` table until its verdict comes. Sync
(``swarm.ledger.sync``: range-based set reconciliation, bounded messages) runs every
``every_s`` against one random peer. Whatever the rules refuse, from gossip or sync, is logged
with the reason and counted in ``status`` (``refused``, ``last_refusal``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import trio

from node.runtime import Node
from swarm.errors import SwarmError
from swarm.ledger import LedgerStore
from swarm.ledger.sync import MAX_ANSWER, MAX_REQUEST, SyncResult, pull, serve
from swarm.messages import LedgerEvent, Signed, Verdict
from swarm.net import StreamLimits
from swarm.net.names import SYNC

log = logging.getLogger(__name__)

SYNC_LIMITS = StreamLimits(max_request=MAX_REQUEST, max_response=MAX_ANSWER)


class LedgerReplica:
    def __init__(self, node: Node, store: LedgerStore, *, every_s: float = 10.0) -> None:
        self.node = node
        self.store = store
        self.every_s = every_s
        self.synced_events = 0
        self.refused = 0
        self.last_refusal = ""

    def _refuse(self, what: str, why: str) -> None:
        self.refused += 1
        self.last_refusal = f"{what}: {why}"[:300]
        log.warning("ledger refused %s", self.last_refusal)

    async def _on_gossip(self, signed: Signed[Any]) -> None:
        try:
            if signed.envelope.kind == LedgerEvent.KIND:
                self.store.add([signed])
            elif signed.envelope.kind == Verdict.KIND:
                self.store.add_verdict(signed)
        except SwarmError as exc:
            self._refuse(f"gossiped {signed.envelope.kind} {signed.id.hex()[:16]}", str(exc))

    async def _on_sync(self, peer: str, body: bytes) -> bytes:
        return serve(self.store, body)

    async def sync_with(self, peer: str) -> SyncResult:
        """Pull every event ``peer`` holds that we do not (with the verdicts they cite)."""

        async def ask(body: bytes) -> bytes:
            return await self.node.request(peer, SYNC, body, SYNC_LIMITS)

        result = await pull(self.store, ask)  # SwarmError (PeerError, MalformedError) on a bad peer
        for why in result.refused:
            self._refuse(f"from {peer[-8:]}", why)
        self.refused += result.refused_count - len(result.refused)
        self.synced_events += result.added
        return result

    def status(self) -> dict[str, Any]:
        """The ledger part of ``swarm-node status`` (``LedgerStore.status``: no fold)."""
        return {
            **self.store.status(self.node.peer_id),
            "synced_events": self.synced_events,
            "refused": self.refused,
            "last_refusal": self.last_refusal,
        }

    async def run(self) -> None:
        self.node.subscribe_ledger(self._on_gossip)
        self.node.handle(SYNC, self._on_sync, SYNC_LIMITS)
        # The range index needs one scan of every id (~2 s at a million events): in a thread,
        # so the event loop keeps serving meanwhile.
        index, upto = await trio.to_thread.run_sync(LedgerStore.scan_index, self.store.path)
        self.store.adopt_index(index, upto)
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
