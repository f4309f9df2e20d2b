"""Ledger sync by range-based set reconciliation: both sides of ``ledger-sync``, transport-free.

``serve(store, request)`` answers one request; ``pull(store, ask)`` runs the asker's side over
any ``ask(request) -> answer`` coroutine (a libp2p stream in ``node.roles.ledger_sync``, a direct
call in tests and ``bench/ledger.py``). docs/protocol.md has the wire format.

Decisions this module owns:
- The asker sends its own summaries; the answerer leaves out every range that matches, answers a
  differing range with the id prefixes it holds there when it holds at most ``LEAF``, else with
  the summaries of the 16 children. The asker descends only into children that differ and are
  not empty on the answerer's side. Bytes grow with the number of differing ranges, never with
  the ledger; round trips with log16 of the ledger.
- Ids travel as their first ``ID_PREFIX`` bytes (a collision within one leaf range of at most 16
  ids would cost one extra event in a ``get``, nothing else).
- Every message is bounded: at most ``MAX_RANGES`` ranges or ``MAX_GET`` prefixes per request,
  and a ``get`` answer stops once it passes ``ANSWER_BUDGET`` bytes (the asker asks again for the
  rest; an answer that brings nothing ends the pull).
- Each event comes with the verdicts it cites, so the asker can check it on arrival; verdicts it
  already holds are recognised by id (sha256 of the bytes) and not decoded again. What the rules
  refuse is counted and reported, never kept; one bad event does not keep the good ones out.
- The asker does not trust the answerer's summaries: a split's 16 counts must add up to the
  count given for that range (give or take ``GROWTH`` events stored meanwhile), and one pull
  visits at most ``MAX_PULL_RANGES`` ranges, so a lying peer costs a bounded amount of work.
- Sync pulls: it fills the asker's gaps; the answerer fills its own when it asks in turn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from swarm.errors import MalformedError, PeerError, SwarmError, ValidationError
from swarm.ledger.reconcile import children, fingerprint, valid_prefix
from swarm.ledger.store import LedgerStore
from swarm.messages import LedgerEvent, Signed, Verdict, decode

LEAF = 16
ID_PREFIX = 8
MAX_RANGES = 1024
MAX_GET = 1024
MAX_PULL_RANGES = 1 << 20  # a million-event ledger 1% apart needs about 14,000
GROWTH = 4096
ANSWER_BUDGET = 4 * 1024 * 1024
MAX_REQUEST = MAX_RANGES * 96 + 1024  # a range: a prefix of <= 64 chars, a count, 12 bytes
MAX_ANSWER = ANSWER_BUDGET + LedgerEvent.MAX_BYTES + 2 * Verdict.MAX_BYTES + 4096

Ask = Callable[[bytes], Awaitable[bytes]]


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(body: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MalformedError(f"{what} is not msgpack: {exc}") from exc


def _summary(store: LedgerStore, prefix: str) -> tuple[int, bytes]:
    count, total = store.range_summary(prefix)
    return count, fingerprint(count, total)


# -- the answerer --------------------------------------------------------------------------------


def serve(store: LedgerStore, body: bytes) -> bytes:
    """Answer one ledger-sync request; ``MalformedError`` for a request that is not one."""
    request = _unpack(body, "a ledger-sync request")
    if not isinstance(request, list) or len(request) != 2 or not isinstance(request[1], list):
        raise MalformedError("a ledger-sync request is a msgpack array [operation, items]")
    op, items = request
    if op == "ranges":
        return _pack(_answer_ranges(store, items[:MAX_RANGES]))
    if op == "get":
        return _pack(_answer_get(store, items[:MAX_GET]))
    raise MalformedError(f"unknown ledger-sync operation {str(op)[:16]!r}")


def _answer_ranges(store: LedgerStore, items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and valid_prefix(item[0])):
            raise MalformedError("a range is [hex prefix, count, fingerprint]")
        prefix, count, fp = item
        mine = _summary(store, prefix)
        if mine == (count, fp):
            continue
        if mine[0] <= LEAF or len(prefix) >= 64:
            out.append([prefix, "ids", [i[:ID_PREFIX] for i in store.ids_under(prefix, LEAF)]])
        else:
            out.append([prefix, "split", [list(_summary(store, c)) for c in children(prefix)]])
    return out


def _answer_get(store: LedgerStore, items: list[Any]) -> list[Any]:
    out: list[Any] = []
    size = 0
    for prefix in items:
        if not isinstance(prefix, bytes) or not ID_PREFIX <= len(prefix) <= 32:
            raise MalformedError(f"a get item is an id prefix of {ID_PREFIX} to 32 bytes")
        for raw, verdicts in store.with_verdicts(prefix):
            if size > ANSWER_BUDGET:
                return out
            out.append([raw, verdicts])
            size += len(raw) + sum(len(v) for v in verdicts) + 16
    return out


# -- the asker -----------------------------------------------------------------------------------


@dataclass
class SyncResult:
    added: int = 0
    round_trips: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    refused: list[str] = field(default_factory=list)
    """Why each event or verdict the peer sent was refused (at most the first 20 reasons)."""
    refused_count: int = 0


async def pull(store: LedgerStore, ask: Ask) -> SyncResult:
    """Fetch every event the peer behind ``ask`` holds and ``store`` does not."""
    result = SyncResult()

    async def call(request: list[Any]) -> Any:
        body = _pack(request)
        answer = await ask(body)
        result.round_trips += 1
        result.bytes_sent += len(body)
        result.bytes_received += len(answer)
        try:
            return _unpack(answer, "answer")
        except MalformedError as exc:  # the peer's fault: the caller moves on to another peer
            raise PeerError(f"malformed ledger-sync answer: {exc}") from exc

    wanted = await _differences(store, call)
    while wanted:
        batch, wanted = wanted[:MAX_GET], wanted[MAX_GET:]
        answer = await call(["get", batch])
        if not isinstance(answer, list):
            raise PeerError("a ledger-sync get answer is not an array")
        got = _take(store, answer, batch, result)
        if not got:
            break  # nothing usable came back: do not ask forever
        wanted = [p for p in batch if p not in got] + wanted
    return result


async def _differences(
    store: LedgerStore, call: Callable[[list[Any]], Awaitable[Any]]
) -> list[bytes]:
    """The id prefixes the peer holds in ranges where ``store`` differs and lacks them."""
    queue = [""]
    wanted: list[bytes] = []
    # A lying answerer could send us down every range: its splits must add up to the counts it
    # gave for their parents (give or take GROWTH events stored meanwhile: a live node keeps
    # inserting), so each level queues about as many ranges as it claims events, and one pull
    # visits at most MAX_PULL_RANGES ranges.
    claimed: dict[str, int] = {}
    asked_total = 0
    while queue:
        batch, queue = queue[:MAX_RANGES], queue[MAX_RANGES:]
        asked = set(batch)
        answer = await call(["ranges", [[p, *_summary(store, p)] for p in batch]])
        if not isinstance(answer, list):
            raise PeerError("a ledger-sync ranges answer is not an array")
        for entry in answer:
            if not (isinstance(entry, list) and len(entry) == 3 and entry[0] in asked):
                raise PeerError("a ledger-sync range answer names a range not asked for")
            prefix, kind, data = entry
            asked.discard(prefix)
            if kind == "ids" and isinstance(data, list):
                wanted += [  # one indexed lookup each, however much we hold there
                    p
                    for p in data[:LEAF]
                    if isinstance(p, bytes)
                    and len(p) == ID_PREFIX
                    and p.hex().startswith(prefix)
                    and not store.ids_under(p.hex(), 1)
                ]
            elif kind == "split" and isinstance(data, list) and len(data) == 16:
                if not all(
                    isinstance(t, list) and len(t) == 2 and type(t[0]) is int and t[0] >= 0
                    for t in data
                ):
                    raise PeerError("a ledger-sync split holds 16 [count, fingerprint]")
                total = sum(t[0] for t in data)
                if total > claimed.setdefault(prefix, total) + GROWTH or len(prefix) >= 64:
                    raise PeerError("a ledger-sync split contradicts the counts it gave before")
                for child, theirs in zip(children(prefix), data, strict=True):
                    if theirs[0] and tuple(theirs) != _summary(store, child):
                        claimed[child] = theirs[0]
                        queue.append(child)
                        asked_total += 1
                if asked_total > MAX_PULL_RANGES:
                    raise PeerError(f"a ledger-sync peer led us through {asked_total} ranges")
            else:
                raise PeerError(f"a ledger-sync range answer of unknown kind {str(kind)[:16]!r}")
    return wanted


def _take(
    store: LedgerStore, answer: list[Any], asked: list[bytes], result: SyncResult
) -> set[bytes]:
    """Check and store the events of a get answer; returns the asked prefixes it answered."""
    events: list[Signed[LedgerEvent]] = []
    verdicts: dict[bytes, Signed[Verdict]] = {}
    answered: set[bytes] = set()
    wanted = set(asked)
    for item in answer:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)):
            raise PeerError("a ledger-sync get answer holds [event, [verdict, ...]] items")
        raw, cited = item
        key = hashlib.sha256(raw).digest()[:ID_PREFIX]
        if key not in wanted:
            continue  # not asked for: ignored
        answered.add(key)
        try:
            events.append(decode(raw, LedgerEvent))
            for v in cited if isinstance(cited, list) else []:
                vid = hashlib.sha256(v).digest() if isinstance(v, bytes) else b""
                if vid and vid not in verdicts and store.verdict_facts(vid) is None:
                    verdicts[vid] = decode(v, Verdict)
        except SwarmError as exc:
            _refuse(result, f"bad envelope: {exc}")
    try:
        result.added += len(store.add(events, verdicts.values()))
    except ValidationError:  # one bad object must not keep the good ones out: one by one
        for verdict in verdicts.values():
            try:
                store.add_verdict(verdict)
            except ValidationError as exc:
                _refuse(result, f"verdict: {exc}")
        for event in events:
            try:
                result.added += len(store.add([event]))
            except ValidationError as exc:
                _refuse(result, f"event {event.id.hex()[:16]}: {exc}")
    return answered


def _refuse(result: SyncResult, why: str) -> None:
    result.refused_count += 1
    if len(result.refused) < 20:
        result.refused.append(why)
