"""The evidence protocol: any holder serves a signed envelope by its id; anyone fetches it.

``/swarm-node/<run>/evidence/1``: the request is the 32-byte id (sha256 of the envelope); the
answer is the envelope's bytes, or a refusal: "not held", or "summarized KIND SIZE SEEN" when
the holder's evidence budget dropped the bytes (``swarm.evidence``; the asker records the
summary, so an audit names the slash it cannot replay instead of calling its evidence missing).
The asker checks the bytes hash to the id and decode as a known signed kind before it keeps
them, so a holder can only serve what was asked for. Every role serves its ``EvidenceStore``
(validators hold the most; an auditor serves what it fetched).

``EvidenceService.keep`` follows what a piece of evidence cites: a Verdict brings its submission
(and, for an equivocation, the other submission named in its metrics), a LedgerEvent its verdict
and the ids in ``related``. So "keep the evidence of this slash" is one call with the event,
pinned against the accused (``accused``, ``earned``: the budgets of ``swarm.evidence``).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable
from typing import Any

from node.roles.judge import OTHER_SUBMISSION
from node.runtime import Node
from swarm.errors import MalformedError, NetworkError, PeerError, SwarmError
from swarm.evidence import EvidenceStore, Summary, address_of
from swarm.messages import LedgerEvent, Signed, Verdict, decode_any
from swarm.net.names import EVIDENCE
from swarm.net.protocols import EVIDENCE_LIMITS

log = logging.getLogger(__name__)

MAX_CLOSURE = 16
"""At most this many objects fetched by one ``keep`` (a verdict and its few submissions)."""
SUMMARIZED = "summarized"
_SUMMARY = re.compile(rf"{SUMMARIZED} ([a-z-]{{1,40}}) (\d{{1,12}}) (\d{{1,12}})$")


def summary_of(object_id: bytes, refusal: str) -> Summary | None:
    """The summary a holder's refusal ("... summarized KIND SIZE SEEN") reports, else None."""
    found = _SUMMARY.search(refusal)
    if found is None:
        return None
    kind, size, seen = found.groups()
    return Summary(object_id, kind, int(size), None, int(seen))


def cited(signed: Signed[Any]) -> list[bytes]:
    """The ids an object of evidence cites (what an auditor needs next to replay it)."""
    message = signed.message
    if isinstance(message, Verdict):
        out = [message.submission_id]
        other = message.metrics.get(OTHER_SUBMISSION)
        if isinstance(other, str):
            with contextlib.suppress(ValueError):  # not hex: nothing more to fetch
                out.append(bytes.fromhex(other))
        return out
    if isinstance(message, LedgerEvent) and message.event != "grant":
        return [message.evidence, *message.related]
    return []


class EvidenceService:
    def __init__(self, node: Node, store: EvidenceStore) -> None:
        self.node = node
        self.store = store
        self.served = 0
        self.fetched = 0

    def serve(self) -> None:
        self.node.handle(EVIDENCE, self._on_request, EVIDENCE_LIMITS)

    async def _on_request(self, peer: str, body: bytes) -> bytes:
        if len(body) != 32:
            raise MalformedError("an evidence request is a 32-byte object id")
        raw = self.store.get(body)
        if raw is None:
            summary = self.store.summary(body)
            if summary is not None:
                raise PeerError(f"{SUMMARIZED} {summary.kind} {summary.size} {summary.seen}")
            raise PeerError("not held")
        self.served += 1
        return raw

    def holders(self, first: Iterable[str] = ()) -> list[str]:
        """Whom to ask: ``first`` (the accuser), then the validators, then every run peer."""
        by_role = self.node.peers_by_role()
        ordered = [*first, *by_role.get("validator", [])]
        ordered += [p for role, ps in by_role.items() if role != "bootstrap" for p in ps]
        return [p for p in dict.fromkeys(ordered) if p != self.node.peer_id]

    async def fetch(self, object_id: bytes, peers: Iterable[str] = ()) -> Signed[Any] | None:
        """The envelope ``object_id``: from our store, else from ``peers`` and the other
        holders in turn (checked against the id); None when nobody serves it."""
        raw = self.store.get(object_id)
        if raw is not None:
            return decode_any(raw)
        for peer in self.holders(peers):
            try:
                raw = await self.node.request(peer, EVIDENCE, object_id, EVIDENCE_LIMITS)
                if address_of(raw) != object_id:
                    raise PeerError(f"{peer} answered {object_id.hex()[:16]} with other bytes")
                signed = decode_any(raw)
            except SwarmError as exc:
                log.debug("evidence %s not from %s: %s", object_id.hex()[:16], peer[-8:], exc)
                summary = summary_of(object_id, str(exc)) if type(exc) is PeerError else None
                if summary is not None:
                    self.store.note_summary(summary)
                if type(exc) is NetworkError:  # no stream at all: dial afresh next time
                    await self.node.forget_peer(peer)
                continue
            self.fetched += 1
            return signed
        return None

    async def keep(
        self,
        roots: Iterable[bytes],
        peers: Iterable[str] = (),
        *,
        pinned: bool,
        accused: str | None = None,
        earned: bool = True,
    ) -> list[Signed[Any]]:
        """Fetch and store ``roots`` and what they cite (``cited``); returns what is held now.
        Objects nobody serves are skipped (logged): the caller may try again later. Pinned
        evidence is charged to ``accused`` (``EvidenceStore.put``)."""
        wanted = list(roots)
        asked = list(peers)
        held: list[Signed[Any]] = []
        seen: set[bytes] = set()
        while wanted and len(seen) < MAX_CLOSURE:
            object_id = wanted.pop(0)
            if object_id in seen:
                continue
            seen.add(object_id)
            signed = await self.fetch(object_id, asked)
            if signed is None:
                log.info("evidence %s: no holder answered", object_id.hex()[:16])
                continue
            self.store.put(
                signed.raw, signed.envelope.kind, pinned=pinned, peer=accused, earned=earned
            )
            held.append(signed)
            wanted += cited(signed)
        return held
