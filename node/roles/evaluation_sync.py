"""Every node's pull of the versioned records gossip did not bring it: held-out evaluations
(``/evaluations/1``) and training records (``/training/1``).

Decisions this module owns:

- **Why.** Evaluations travel by gossip (``swarm.ledger.evaluations``); a node that joined, or
  was away, when a version was evaluated missed that point, and ledger sync does not carry
  evaluations. So every node serves the records it holds and, every ``every_s`` (and at start),
  asks one random peer for those it lacks.
- **Wire.** The request is the msgpack list of the versions the asker holds (at most
  ``MAX_EVAL_VERSIONS``); the answer is the msgpack list of the signed envelopes of the other
  versions the server holds, oldest first, at most ``MAX_ANSWER`` bytes (the rest comes on
  the next round).
- **Trust.** Nothing from the answer is taken on the server's word: each envelope passes the
  ledger gate's checks (``LedgerGate.check``: signature, run, cadence, due validator) before the
  store keeps it; one that fails is counted in ``refused`` and dropped.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any, Protocol

import msgpack
import trio

from node.runtime import Node
from swarm.errors import MalformedError, SwarmError
from swarm.messages import Evaluation, Signed, TrainingDispute, TrainingRecord, decode
from swarm.net import StreamLimits
from swarm.net.gossip import Refused
from swarm.net.names import EVALUATIONS, TRAIN_RECEIPTS, TRAINING

log = logging.getLogger(__name__)

MAX_EVAL_VERSIONS = 4096
MAX_ANSWER = 1024 * 1024
LIMITS = StreamLimits(max_request=64 * 1024, max_response=MAX_ANSWER + 64 * 1024)


class VersionedStore(Protocol):
    def records(self) -> Sequence[Signed[Any]]: ...

    def add(self, signed: Signed[Any], /) -> str: ...


class RecordSync:
    """Serve this node's records of one kind (one per version) and pull the missing ones (see
    the module docstring)."""

    kind: type[Any] = Evaluation
    protocol = EVALUATIONS

    def __init__(self, node: Node, store: VersionedStore, *, every_s: float = 10.0) -> None:
        self.node = node
        self.store = store
        self.every_s = every_s
        self.pulled = 0
        self.refused = 0

    async def _serve(self, peer: str, body: bytes) -> bytes:
        try:
            held = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.ExtraData) as exc:
            raise MalformedError(f"a {self.protocol} request is a list of versions: {exc}") from exc
        if not isinstance(held, list) or len(held) > MAX_EVAL_VERSIONS:
            raise MalformedError(f"a {self.protocol} request lists at most {MAX_EVAL_VERSIONS}")
        have = {v for v in held if type(v) is int}
        answer: list[bytes] = []
        size = 0
        for record in self.store.records():
            if record.message.version in have:
                continue
            size += len(record.raw)
            if size > MAX_ANSWER:
                break
            answer.append(record.raw)
        return bytes(msgpack.packb(answer, use_bin_type=True))

    async def pull(self, peer: str) -> int:
        """Ask ``peer`` for the records we lack; the number stored."""
        held = [r.message.version for r in self.store.records()][-MAX_EVAL_VERSIONS:]
        body = await self.node.request(
            peer, self.protocol, msgpack.packb(held, use_bin_type=True), LIMITS
        )
        try:
            raws = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.ExtraData) as exc:
            raise MalformedError(f"peer {peer[-8:]} answered no list of {self.protocol}") from exc
        if not isinstance(raws, list):
            raise MalformedError(f"peer {peer[-8:]} answered no list of {self.protocol}")
        added = 0
        for raw in raws:
            if not isinstance(raw, bytes):
                self.refused += 1
                continue
            try:
                signed = decode(raw, self.kind)  # the gate passes verdicts too: not here
                self.node.ledger_gate.check(raw)
            except Refused as exc:
                if exc.reason != "duplicate":  # seen on gossip: the gate passed it then
                    self.refused += 1
                    log.warning("%s from %s refused: %s", self.kind.KIND, peer[-8:], exc)
                    continue
            except SwarmError as exc:
                self.refused += 1
                log.warning(
                    "peer %s sent something else than a %s: %s", peer[-8:], self.kind.KIND, exc
                )
                continue
            if self.store.add(signed) == "stored":
                added += 1
        self.pulled += added
        return added

    def status(self) -> dict[str, Any]:
        return {"pulled": self.pulled, "refused": self.refused}

    async def run(self) -> None:
        self.node.handle(self.protocol, self._serve, LIMITS)
        while True:
            peers = [
                p for ps in self.node.peers_by_role().values() for p in ps if p != self.node.peer_id
            ]
            if peers:
                peer = random.choice(peers)
                try:
                    await self.pull(peer)
                except SwarmError as exc:
                    log.info("%s from %s not pulled: %s", self.protocol, peer[-8:], exc)
            await trio.sleep(self.every_s)


class EvaluationSync(RecordSync):
    kind = Evaluation
    protocol = EVALUATIONS


class TrainingSync(RecordSync):
    """Training records, and (``/train-receipts/1``) the receipts and training disputes this
    node holds, for ``swarm-node audit --training``: the request is msgpack
    ``[min_version, max_version]`` (of the samples), the answer ``{"receipts", "disputes"}``
    (raw envelopes, at most ``MAX_ANSWER`` bytes in all)."""

    kind = TrainingRecord
    protocol = TRAINING

    async def _serve_receipts(self, peer: str, body: bytes) -> bytes:
        store: Any = self.store
        try:
            low, high = msgpack.unpackb(body, raw=False)
            if type(low) is not int or type(high) is not int:
                raise TypeError("not two integers")
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise MalformedError(f"a train-receipts request is [min, max]: {exc}") from exc
        size = 0
        receipts: list[bytes] = []
        for receipt in store.receipts(low, high):
            size += len(receipt.raw)
            if size > MAX_ANSWER // 2:
                break
            receipts.append(receipt.raw)
        disputes = [bytes(raw) for raw in store.dispute_raws()][:64]
        return bytes(msgpack.packb({"receipts": receipts, "disputes": disputes}, use_bin_type=True))

    async def pull(self, peer: str) -> int:
        """The records we lack, then the peer's training disputes (gossip can lose one; an
        empty range of receipts asks for the disputes alone)."""
        added = await super().pull(peer)
        body = await self.node.request(
            peer, TRAIN_RECEIPTS, msgpack.packb([1, 0], use_bin_type=True), LIMITS
        )
        try:
            raws = msgpack.unpackb(body, raw=False).get("disputes", [])
        except (ValueError, AttributeError, msgpack.UnpackException) as exc:
            raise MalformedError(f"peer {peer[-8:]} answered no training disputes") from exc
        store: Any = self.store
        for raw in raws if isinstance(raws, list) else []:
            try:
                signed = decode(raw, TrainingDispute)
                self.node.ledger_gate.check(raw)
            except Refused as exc:
                if exc.reason != "duplicate":
                    self.refused += 1
                    continue
            except SwarmError:
                self.refused += 1
                continue
            added += store.add_dispute(signed)
        return added

    async def run(self) -> None:
        self.node.handle(TRAIN_RECEIPTS, self._serve_receipts, LIMITS)
        await super().run()
