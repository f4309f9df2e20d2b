"""Every ledger read of the web dashboard, in one place, on its own read-only SQLite connection.

Decisions this module owns:
- **One connection, read-only** (``mode=ro``), never the event loop's ``LedgerStore`` one
  (architecture contract 4). Calls come from worker threads (``anyio.to_thread``), one at a time
  under ``_lock``; the node's writer is never blocked (WAL).
- **Bounded answers.** Every list is a page: ``limit`` is clamped to ``1..MAX_LIMIT``; lists in
  ledger order page by ``rowid`` (newest first, the cursor is the last rowid returned, so a
  page costs the same on a ledger of a million events); the contributors table, which sorts by
  any column, pages by offset over a cached per-peer summary.
- **Aggregates are folded in, not recomputed.** Per-peer counts, last-seen times and the reward
  per policy version are sums over the ``events`` and ``verdicts`` tables, which only grow; a
  ``_Tally`` remembers the largest rowid it read and each request folds in the newer rows alone
  (the first request after start reads everything once). A page costs the same on a ledger of a
  hundred events or a million; only the contributors table's sort is O(peers).
- **Meanings.** Accepted/rejected work: verdicts naming the peer as worker. Requests: of a
  worker's counters of each version of the window (``0 .. quota - 1``), those with a verdict
  (``swarm.ledger.views.QuotaTally``, folded in like the rest), shown for the newest version
  as "37 of 64": what a worker withholds of its quota shows. Mean reward of a
  version: ``sum(reward_sum) / sum(samples) / REWARD_SCALE`` over its accepted verdicts. Balance:
  the materialised ``balances`` table, the run's initial balance for a peer without events.
  Banned: balance below the run's ban threshold. A slash's reason: the reasons of the verdict
  it cites (its ``evidence`` is the verdict's id). A dispute: a ``dispute`` event, with the
  reasons of the disputing validator's verdict and the id of the verdict it disputes.
- **Envelopes by id** for audit bundles: the ledger's ``verdicts`` table, then the
  content-addressed evidence store next to the ledger (``evidence.db``, what validators keep),
  read-only too.

This is the one module to adapt when the ledger's schema changes.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgpack

from swarm.errors import StorageError
from swarm.ledger.views import QuotaTally, QuotaUse
from swarm.messages import REWARD_SCALE

MAX_LIMIT = 200
MAX_REASONS = 16
DEFAULT_LIMIT = 50
SORT_KEYS = ("peer", "role", "accepted", "rejected", "balance", "banned", "last_seen_ms")


def clamp_limit(limit: int | None) -> int:
    return DEFAULT_LIMIT if limit is None else max(1, min(MAX_LIMIT, limit))


def _rowid_cursor(cursor: str | None) -> int | None:
    if cursor is None or cursor == "":
        return None
    if not cursor.isdigit():
        raise ValueError(f"cursor {cursor[:40]!r} is not one this API gave out")
    return int(cursor)


@dataclass
class PeerStats:
    accepted: int = 0
    rejected: int = 0
    rejected_hard: int = 0
    judged: int = 0
    """Verdicts this peer signed (validators)."""
    last_seen_ms: int | None = None

    def seen(self, at: int) -> None:
        self.last_seen_ms = at if self.last_seen_ms is None else max(self.last_seen_ms, at)


@dataclass
class _VersionTally:
    accepted: int = 0
    rejected: int = 0
    samples: int = 0
    reward_sum: int = 0
    first_verdict_ms: int | None = None


@dataclass
class _Tally:
    """Per-peer and per-version sums, folded in from the rows past ``events``/``verdicts``
    (the largest rowid read): the tables only grow, so each refresh reads new rows alone."""

    events: int = 0
    verdicts: int = 0
    slashes: int = 0
    peers: dict[str, PeerStats] = field(default_factory=dict)
    versions: dict[int, _VersionTally] = field(default_factory=dict)
    requests: QuotaTally = field(default_factory=lambda: QuotaTally(0, 1))

    def peer(self, peer: str) -> PeerStats:
        return self.peers.setdefault(peer, PeerStats())


class LedgerQueries:
    """Read-only queries on one run's ledger file."""

    def __init__(
        self,
        path: Path,
        *,
        initial_balance: int,
        ban_threshold: int,
        quota: int = 0,
        window: int = 3,
    ) -> None:
        """``quota`` and ``window`` (``async_level + 1``): the run's requests per worker per
        version, and how many versions the requests column keeps."""
        self.path = path
        self.initial_balance = initial_balance
        self.ban_threshold = ban_threshold
        try:
            self._db = sqlite3.connect(
                f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False
            )
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {path} cannot be opened for reading: {exc}") from exc
        self._evidence: sqlite3.Connection | None = None
        evidence = path.with_name("evidence.db")
        if evidence.exists():
            try:
                self._evidence = sqlite3.connect(
                    f"{evidence.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False
                )
            except sqlite3.DatabaseError:
                self._evidence = None  # bundles then come from peers
        self._lock = threading.Lock()
        self._tally = _Tally(requests=QuotaTally(quota, window))
        self._event_rowid = 0
        self._verdict_rowid = 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._evidence is not None:
                self._evidence.close()

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {self.path}: read failed: {exc}") from exc

    def _change_key(self) -> tuple[int, int]:
        (events,) = self._rows("SELECT coalesce(max(rowid), 0) FROM events")[0]
        (verdicts,) = self._rows("SELECT coalesce(max(rowid), 0) FROM verdicts")[0]
        return int(events), int(verdicts)

    def _refresh(self) -> _Tally:
        """Fold the rows stored since the last call into the tally (caller holds the lock)."""
        t = self._tally
        for rowid, peer, event, at in self._rows(
            "SELECT rowid, peer, event, created_at FROM events WHERE rowid > ? ORDER BY rowid",
            (self._event_rowid,),
        ):
            self._event_rowid = int(rowid)
            t.events += 1
            t.slashes += event == "slash"
            t.peer(str(peer)).seen(int(at))
        verdicts = self._rows(
            "SELECT rowid, worker, validator, accepted, severity, samples, reward_sum,"
            " policy_version, counter, created_at FROM verdicts WHERE rowid > ? ORDER BY rowid",
            (self._verdict_rowid,),
        )
        for rowid, worker, validator, ok, severity, samples, reward, version, count, at in verdicts:
            self._verdict_rowid = int(rowid)
            t.verdicts += 1
            t.requests.add(str(worker), int(version), int(count), bool(ok))
            w = t.peer(str(worker))
            w.seen(int(at))
            t.peer(str(validator)).judged += 1
            t.peer(str(validator)).seen(int(at))
            if version >= 0:
                v = t.versions.setdefault(int(version), _VersionTally())
                if v.first_verdict_ms is None or at < v.first_verdict_ms:
                    v.first_verdict_ms = int(at)
            if ok:
                w.accepted += 1
                if version >= 0:
                    v.accepted += 1
                    v.samples += int(samples)
                    v.reward_sum += int(reward)
            else:
                w.rejected += 1
                w.rejected_hard += severity == "hard"
                if version >= 0:
                    v.rejected += 1
        return t

    # -- what the page and the API ask --------------------------------------------------------

    def change_key(self) -> tuple[int, int]:
        """Moves whenever an event or a verdict is stored (what the live stream watches)."""
        with self._lock:
            return self._change_key()

    def totals(self) -> dict[str, int]:
        with self._lock:
            t = self._refresh()
            return {"events": t.events, "verdicts": t.verdicts, "slashes": t.slashes}

    def balance_of(self, peer: str) -> int:
        with self._lock:
            rows = self._rows("SELECT balance FROM balances WHERE peer = ?", (peer,))
        return int(rows[0][0]) if rows else self.initial_balance

    def peer_stats(self) -> tuple[dict[str, PeerStats], dict[str, int]]:
        """Per-peer verdict counts and last-seen times, and the stored balances."""
        with self._lock:
            t = self._refresh()
            stats = {p: replace(s) for p, s in t.peers.items()}
            balances = {str(p): int(b) for p, b in self._rows("SELECT peer, balance FROM balances")}
        return stats, balances

    def contributors(
        self,
        *,
        roles: Mapping[str, str],
        live_seen_ms: Mapping[str, int],
        limit: int | None = None,
        cursor: str | None = None,
        sort: str = "balance",
        descending: bool = True,
        search: str = "",
    ) -> dict[str, Any]:
        """One page of the contributors table: every peer the ledger names or ``roles`` knows.

        ``roles`` maps peer -> role from the node's view (genesis, membership); ``live_seen_ms``
        the time (ms) the node last saw a peer's advert. Sorted by ``sort`` (one of
        ``SORT_KEYS``), filtered by a case-insensitive substring of the peer ID.
        """
        if sort not in SORT_KEYS:
            raise ValueError(f"sort must be one of {', '.join(SORT_KEYS)}, not {sort[:40]!r}")
        offset = _rowid_cursor(cursor) or 0
        size = clamp_limit(limit)
        stats, balances = self.peer_stats()
        requests = self.requests_newest()
        needle = search.strip().lower()
        rows = []
        for peer in set(stats) | set(balances) | set(roles):
            if needle and needle not in peer.lower():
                continue
            s = stats.get(peer, PeerStats())
            balance = balances.get(peer, self.initial_balance)
            seen = [t for t in (s.last_seen_ms, live_seen_ms.get(peer)) if t is not None]
            role = roles.get(peer) or ("inference" if s.accepted or s.rejected else "unknown")
            rows.append(
                {
                    "peer": peer,
                    "role": role,
                    "accepted": s.accepted,
                    "rejected": s.rejected,
                    "rejected_hard": s.rejected_hard,
                    "judged": s.judged,
                    "balance": balance,
                    "banned": balance < self.ban_threshold,
                    "last_seen_ms": max(seen) if seen else None,
                    "requests": _requests_cell(requests.get(peer)),
                }
            )

        def key(row: dict[str, Any]) -> tuple[bool, Any, str]:
            value = row[sort]
            return (value is None, value if value is not None else 0, row["peer"])

        rows.sort(key=key, reverse=descending)
        if descending:  # keep "no value" last either way
            rows.sort(key=lambda r: r[sort] is None)
        page = rows[offset : offset + size]
        more = offset + size < len(rows)
        return {
            "items": page,
            "total": len(rows),
            "next_cursor": str(offset + size) if more else None,
        }

    def requests_newest(self) -> dict[str, QuotaUse]:
        """Of every worker with a verdict in the window: its requests with a verdict of the
        newest version the ledger judged (0 when it has none there: withholding shows)."""
        with self._lock:
            tally = self._refresh().requests
            return {w: tally.of(w)[0] for w in tally.workers()}

    def rewards_by_version(self) -> list[dict[str, Any]]:
        """Per policy version: accepted/rejected verdicts, accepted samples, mean reward."""
        with self._lock:
            versions = sorted(self._refresh().versions.items())
            return [
                {
                    "version": version,
                    "accepted": v.accepted,
                    "rejected": v.rejected,
                    "samples": v.samples,
                    "mean_reward": v.reward_sum / v.samples / REWARD_SCALE if v.samples else None,
                    "first_verdict_ms": v.first_verdict_ms,
                }
                for version, v in versions
            ]

    def ledger_page(
        self,
        *,
        limit: int | None = None,
        cursor: str | None = None,
        peer: str | None = None,
        event: str | None = None,
    ) -> dict[str, Any]:
        """Ledger events, newest first, optionally of one peer and one event type."""
        size = clamp_limit(limit)
        where: list[str] = ["1"]
        args: list[Any] = []
        before = _rowid_cursor(cursor)
        if before is not None:
            where.append("rowid < ?")
            args.append(before)
        if peer:
            where.append("peer = ?")
            args.append(peer)
        if event:
            where.append("event = ?")
            args.append(event)
        with self._lock:
            rows = self._rows(
                "SELECT rowid, id, event, peer, amount, evidence, signer, created_at FROM events"
                f" WHERE {' AND '.join(where)} ORDER BY rowid DESC LIMIT ?",
                [*args, size],
            )
        items = [
            {
                "id": bytes(i).hex(),
                "event": str(e),
                "peer": str(p),
                "amount": int(a),
                "evidence": bytes(ev).hex(),
                "signer": str(s),
                "created_at_ms": int(t),
            }
            for _, i, e, p, a, ev, s, t in rows
        ]
        more = len(rows) == size
        return {"items": items, "next_cursor": str(rows[-1][0]) if more and rows else None}

    def slashes(self, *, limit: int | None = None, cursor: str | None = None) -> dict[str, Any]:
        """Slash events, newest first, each with the rejecting verdict's reasons and whether
        this ledger holds the evidence that makes an audit bundle."""
        page = self.ledger_page(limit=limit, cursor=cursor, event="slash")
        with self._lock:
            for item in page["items"]:
                item |= self._slash_details(item["peer"], bytes.fromhex(item["evidence"]))
        return page

    def _slash_details(self, worker: str, verdict_id: bytes) -> dict[str, Any]:
        rows = self._rows(
            "SELECT raw, severity, policy_version, submission FROM verdicts WHERE id = ?",
            (verdict_id,),
        )
        held = bool(rows) and self._held(bytes(rows[0][3]))
        return {
            "reasons": _stored_reasons(bytes(rows[0][0])) if rows else [],
            "severity": str(rows[0][1]) if rows else None,
            "policy_version": int(rows[0][2]) if rows else None,
            "evidence_held": held,
        }

    def _held(self, object_id: bytes) -> bool:
        if self._evidence is None:
            return False
        try:
            row = self._evidence.execute("SELECT 1 FROM objects WHERE id = ?", (object_id,))
            return row.fetchone() is not None
        except sqlite3.DatabaseError:
            return False

    def disputes(self, *, limit: int | None = None, cursor: str | None = None) -> dict[str, Any]:
        """Dispute events, newest first: who disputed whose credit, and why."""
        size = clamp_limit(limit)
        before = _rowid_cursor(cursor)
        where, args = ("event = 'dispute'", [])
        if before is not None:
            where += " AND rowid < ?"
            args.append(before)
        with self._lock:
            rows = self._rows(
                "SELECT rowid, id, peer, signer, evidence, created_at, raw FROM events"
                f" WHERE {where} ORDER BY rowid DESC LIMIT ?",
                [*args, size],
            )
            items = []
            for _, i, peer, signer, evidence, at, raw in rows:
                verdict = self._rows("SELECT raw FROM verdicts WHERE id = ?", (bytes(evidence),))
                related = _payload(bytes(raw)).get("related") or []
                items.append(
                    {
                        "id": bytes(i).hex(),
                        "disputed_validator": str(peer),
                        "by": str(signer),
                        "evidence": bytes(evidence).hex(),
                        "disputed_verdict": bytes(related[0]).hex() if related else None,
                        "reasons": _stored_reasons(bytes(verdict[0][0])) if verdict else [],
                        "created_at_ms": int(at),
                    }
                )
        more = len(rows) == size
        return {
            "items": items,
            "next_cursor": str(rows[-1][0]) if more and rows else None,
            "supported": True,
        }

    def envelope(self, object_id: bytes) -> bytes | None:
        """A signed envelope this node keeps, by id: a verdict, else any evidence object."""
        with self._lock:
            rows = self._rows("SELECT raw FROM verdicts WHERE id = ?", (object_id,))
            if rows:
                return bytes(rows[0][0])
            if self._evidence is None:
                return None
            try:
                row = self._evidence.execute(
                    "SELECT raw FROM objects WHERE id = ?", (object_id,)
                ).fetchone()
            except sqlite3.DatabaseError:
                return None
        return None if row is None else bytes(row[0])


def _requests_cell(use: QuotaUse | None) -> dict[str, Any] | None:
    """The contributors table's requests cell: ``"37 of 64"`` of the newest version."""
    if use is None:
        return None
    of = f" of {use.quota}" if use.quota else ""
    return {
        **use.as_dict(),
        "text": f"{use.submitted}{of} (v{use.version})",
    }


def _payload(raw: bytes) -> dict[str, Any]:
    """The payload map of a stored envelope (checked on insert: no signature check here)."""
    try:
        envelope = msgpack.unpackb(raw, raw=False)
        fields = msgpack.unpackb(envelope[2], raw=False)
    except (ValueError, TypeError, IndexError, msgpack.UnpackException):
        return {}
    return fields if isinstance(fields, dict) else {}


def _stored_reasons(raw: bytes) -> list[str]:
    """A stored verdict's reasons. Its signature was checked when it was stored (verify once, on
    insert), so only its payload is read here: a page of slashes costs no signature checks."""
    try:
        envelope = msgpack.unpackb(raw, raw=False)
        fields = msgpack.unpackb(envelope[2], raw=False)
        return [str(r) for r in fields.get("reasons", [])][:MAX_REASONS]
    except (ValueError, TypeError, IndexError, AttributeError, msgpack.UnpackException) as exc:
        return [f"stored verdict unreadable: {exc}"]
