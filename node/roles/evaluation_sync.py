"""Every node's pull of the held-out evaluations gossip did not bring it (``/evaluations/1``).

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
from typing import Any

import msgpack
import trio

from node.runtime import Node
from swarm.errors import MalformedError, SwarmError
from swarm.ledger.evaluations import EvaluationStore
from swarm.messages import Evaluation, decode
from swarm.net import StreamLimits
from swarm.net.gossip import Refused
from swarm.net.names import EVALUATIONS

log = logging.getLogger(__name__)

MAX_EVAL_VERSIONS = 4096
MAX_ANSWER = 1024 * 1024
LIMITS = StreamLimits(max_request=64 * 1024, max_response=MAX_ANSWER + 64 * 1024)


class EvaluationSync:
    """Serve this node's evaluations and pull the missing ones (see the module docstring)."""

    def __init__(self, node: Node, store: EvaluationStore, *, every_s: float = 10.0) -> None:
        self.node = node
        self.store = store
        self.every_s = every_s
        self.pulled = 0
        self.refused = 0

    async def _serve(self, peer: str, body: bytes) -> bytes:
        try:
            held = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.ExtraData) as exc:
            raise MalformedError(f"an evaluations request is a list of versions: {exc}") from exc
        if not isinstance(held, list) or len(held) > MAX_EVAL_VERSIONS:
            raise MalformedError(f"an evaluations request lists at most {MAX_EVAL_VERSIONS}")
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
        """Ask ``peer`` for the evaluations we lack; the number stored."""
        held = [r.message.version for r in self.store.records()][-MAX_EVAL_VERSIONS:]
        body = await self.node.request(
            peer, EVALUATIONS, msgpack.packb(held, use_bin_type=True), LIMITS
        )
        try:
            raws = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.ExtraData) as exc:
            raise MalformedError(f"peer {peer[-8:]} answered no list of evaluations") from exc
        if not isinstance(raws, list):
            raise MalformedError(f"peer {peer[-8:]} answered no list of evaluations")
        added = 0
        for raw in raws:
            if not isinstance(raw, bytes):
                self.refused += 1
                continue
            try:
                signed = decode(raw, Evaluation)  # the gate passes verdicts too: not here
                self.node.ledger_gate.check(raw)
            except Refused as exc:
                if exc.reason != "duplicate":  # seen on gossip: the gate passed it then
                    self.refused += 1
                    log.warning("evaluation from %s refused: %s", peer[-8:], exc)
                    continue
            except SwarmError as exc:
                self.refused += 1
                log.warning("peer %s sent something else than an evaluation: %s", peer[-8:], exc)
                continue
            if self.store.add(signed) == "stored":
                added += 1
        self.pulled += added
        return added

    def status(self) -> dict[str, Any]:
        return {"pulled": self.pulled, "refused": self.refused}

    async def run(self) -> None:
        self.node.handle(EVALUATIONS, self._serve, LIMITS)
        while True:
            peers = [
                p for ps in self.node.peers_by_role().values() for p in ps if p != self.node.peer_id
            ]
            if peers:
                peer = random.choice(peers)
                try:
                    await self.pull(peer)
                except SwarmError as exc:
                    log.info("evaluations from %s not pulled: %s", peer[-8:], exc)
            await trio.sleep(self.every_s)
