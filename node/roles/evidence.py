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
from dataclasses import dataclass, field
from typing import Any

import trio

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
NOT_HELD = "not held"
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


@dataclass
class Lookup:
    """What asking for one object found: the object, else who said they do not hold it
    (``denied``: an answer) and who gave no answer (``silent``: unreachable, timed out, reset,
    busy, or holding only a summary). Only a denial is evidence that an object is unknown."""

    signed: Signed[Any] | None = None
    denied: set[str] = field(default_factory=set)
    silent: dict[str, str] = field(default_factory=dict)


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
            raise PeerError(NOT_HELD)
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
        return (await self.lookup(object_id, peers)).signed

    async def lookup(
        self,
        object_id: bytes,
        peers: Iterable[str] = (),
        *,
        tries: int = 1,
        pause: float = 1.0,
        retry: Iterable[str] | None = None,
    ) -> Lookup:
        """``fetch`` that says why nothing came: each holder that gave no answer (of ``retry``,
        when given: the ones whose answer matters) is asked again, up to ``tries`` rounds in
        all, ``pause`` seconds apart (doubling). A caller that would accuse someone of citing
        an unknown object needs the denials, not the silence: one dropped connection is no
        evidence (docs/RELIABILITY.md, section 4)."""
        raw = self.store.get(object_id)
        if raw is not None:
            return Lookup(decode_any(raw))
        found = Lookup()
        asking = self.holders(peers)
        again = None if retry is None else set(retry)
        for attempt in range(tries):
            if attempt:
                await trio.sleep(pause * 2 ** (attempt - 1))
            for peer in asking:
                signed, why = await self._ask(peer, object_id)
                if signed is not None:
                    self.fetched += 1
                    found.signed = signed
                    return found
                if why == NOT_HELD:
                    found.denied.add(peer)
                    found.silent.pop(peer, None)
                else:
                    found.silent[peer] = why
            asking = [p for p in found.silent if again is None or p in again]
            if not asking:
                break
        return found

    async def _ask(self, peer: str, object_id: bytes) -> tuple[Signed[Any] | None, str]:
        """One holder's answer: the object, else why not (``NOT_HELD`` for a denial)."""
        try:
            raw = await self.node.request(peer, EVIDENCE, object_id, EVIDENCE_LIMITS)
            if address_of(raw) != object_id:
                raise PeerError(f"{peer} answered {object_id.hex()[:16]} with other bytes")
            return decode_any(raw), ""
        except SwarmError as exc:
            log.debug("evidence %s not from %s: %s", object_id.hex()[:16], peer[-8:], exc)
            if type(exc) is PeerError:
                summary = summary_of(object_id, str(exc))
                if summary is not None:
                    self.store.note_summary(summary)
                elif str(exc).endswith(f": {NOT_HELD}"):  # the holder's refusal (``request``)
                    return None, NOT_HELD
            if type(exc) is NetworkError:  # no stream at all: dial afresh next time
                await self.node.forget_peer(peer)
            return None, str(exc)

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
