"""The ledger's grow-only event set in SQLite (WAL; one transaction per batch; survives kill -9).

Decisions this module owns:
- Verify once, on insert. ``add`` receives decoded (signature-checked) events, checks each with
  ``rules.check_event`` against the facts of its verdict (columns of the ``verdicts`` table,
  decoded when the verdict was stored) and writes the decoded fields as columns next to the exact
  envelope bytes. Nothing is re-verified afterwards except by ``audit``, which re-derives
  everything from the envelopes.
- Balances are kept incrementally, inside the batch's transaction: each event's ``slot`` and
  ``delta`` are columns, ``counted`` marks the one event per slot that counts (the smallest id).
  A new event with a smaller id than the counted one of its slot displaces it (the balance moves
  by the difference); a larger one is stored uncounted. The result equals ``fold`` over the whole
  set, whatever the order of arrival (tested).
- A batch lands whole or not at all: any event the rules refuse raises before anything is
  written. An event whose verdict is not held is not refused: it waits in ``pending`` (at most
  ``MAX_PENDING``; beyond that it is refused) and is added as soon as ``add_verdict`` (or ``add``
  with ``verdicts=``) brings the verdict. Pending events are outside the event set: they count
  for nothing and sync does not offer them.
- Reads never fold the ledger: ``balance``, ``banned``, ``page``, ``disputes`` and
  ``balances().by_peer`` (a live view) are index lookups, whatever the ledger's size; so is the
  quota tally's read of the newest versions' verdicts (``views.read_quota_use``, through
  ``verdicts_version``; ``IF NOT EXISTS`` at open gives a file from before it the index).
- Sync reads range summaries (``swarm.ledger.reconcile``): an in-memory ``RangeIndex`` of the
  top ranges, built once per process (one scan of the ids, about 0.2 s per 100,000 events: the
  replica builds it in a thread with ``scan_index``/``adopt_index``, or the first sync builds it
  on demand) and kept up to date after each commit.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from swarm.errors import EvidenceMissingError, StorageError, ValidationError
from swarm.ledger.fold import Balances
from swarm.ledger.reconcile import INDEX_DIGITS, RangeIndex, bounds, summarise
from swarm.ledger.records import SCHEMA as RECORDS_SCHEMA
from swarm.ledger.records import WorkRecords
from swarm.ledger.rules import Entry, VerdictFacts, check_event, check_verdict
from swarm.ledger.views import BalanceView, EventRow
from swarm.messages import LedgerEvent, RunGenesis, Signed, Verdict, decode, run_id_of

log = logging.getLogger(__name__)

SCHEMA_VERSION = "2"
MAX_PENDING = 10_000
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id BLOB PRIMARY KEY,
    event TEXT NOT NULL,
    peer TEXT NOT NULL,
    amount INTEGER NOT NULL,
    evidence BLOB NOT NULL,
    signer TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    slot TEXT NOT NULL,
    delta INTEGER NOT NULL,
    counted INTEGER NOT NULL,
    raw BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_peer ON events (peer);
CREATE INDEX IF NOT EXISTS events_slot ON events (slot);
CREATE INDEX IF NOT EXISTS events_disputes ON events (event) WHERE event = 'dispute';
CREATE TABLE IF NOT EXISTS balances (peer TEXT PRIMARY KEY, balance INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS balances_low ON balances (balance);
CREATE TABLE IF NOT EXISTS pending (
    id BLOB PRIMARY KEY,
    waits_for BLOB NOT NULL,
    reason TEXT NOT NULL,
    raw BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS pending_waits ON pending (waits_for);
CREATE TABLE IF NOT EXISTS verdicts (
    id BLOB PRIMARY KEY,
    submission BLOB NOT NULL,
    worker TEXT NOT NULL,
    validator TEXT NOT NULL,
    accepted INTEGER NOT NULL,
    severity TEXT NOT NULL,
    samples INTEGER NOT NULL,
    reward_sum INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    equivocation INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    raw BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS verdicts_version ON verdicts (policy_version);
"""
_FACTS = (
    "SELECT id, submission, worker, validator, accepted, severity, samples, policy_version,"
    " counter, equivocation FROM verdicts WHERE id = ?"
)


class LedgerStore(WorkRecords):
    """One run's ledger in one SQLite file. Not thread-safe: use it from one thread (the node's
    event loop), or open one store per thread."""

    def __init__(self, path: Path, genesis: Signed[RunGenesis]) -> None:
        self.path = path
        self.genesis = genesis
        self._run_id = run_id_of(genesis)
        self._index: RangeIndex | None = None
        self.refused_pending = 0
        """Pending events refused when their verdict came (this process)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            # Ids are hashes, so inserts land at random pages of the id indexes: a page cache of
            # 64 MiB (default 2 MiB) keeps their inner pages in memory at a million events.
            self._db.execute("PRAGMA cache_size=-65536")
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB)")
            stored = dict(self._db.execute("SELECT key, value FROM meta"))
            if "genesis" in stored and bytes(stored["genesis"]) != genesis.raw:
                raise StorageError(
                    f"ledger {path} belongs to another run; use a separate file per run"
                )
            if "genesis" in stored and stored.get("schema") != SCHEMA_VERSION:
                raise StorageError(
                    f"ledger {path} has an older layout; move it aside and let the node "
                    "sync a fresh one from its peers"
                )
            self._db.executescript(_SCHEMA + RECORDS_SCHEMA)
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('genesis', ?)", (genesis.raw,))
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {path} cannot be opened: {exc}") from exc

    @classmethod
    def open_existing(cls, path: Path) -> LedgerStore:
        """Open a ledger file by itself, with the genesis it stores (what an auditor does)."""
        from swarm.messages import RunGenesis

        if not path.exists():
            raise StorageError(f"no ledger at {path}")
        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
                row = db.execute("SELECT value FROM meta WHERE key = 'genesis'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"{path} is not a swarm-node ledger: {exc}") from exc
        if row is None:
            raise StorageError(f"{path} holds no run genesis")
        return cls(path, decode(bytes(row[0]), RunGenesis))

    @property
    def run_id(self) -> str:
        return self._run_id

    # -- writing -------------------------------------------------------------------------------

    def add(
        self,
        events: Iterable[Signed[LedgerEvent]],
        verdicts: Iterable[Signed[Verdict]] = (),
        *,
        hand_to: Sequence[str] = (),
    ) -> list[Signed[LedgerEvent]]:
        """Store ``verdicts``, then check and store ``events``; returns the events that were new
        to the set. Raises ``ValidationError`` before writing anything if any verdict or event
        breaks the run's rules; events whose verdict is still missing go to ``pending``.
        ``hand_to``: trainers each of ``verdicts`` must reach, queued in the hand-off outbox in
        the same transaction (a kill between the verdict and its hand-off loses neither)."""
        batch_verdicts = {v.id: v for v in verdicts}
        for verdict in batch_verdicts.values():
            check_verdict(verdict, self.genesis, run_id=self._run_id)
        facts = {vid: VerdictFacts.of(v) for vid, v in batch_verdicts.items()}

        def lookup(verdict_id: bytes) -> VerdictFacts | None:
            return facts.get(verdict_id) or self.verdict_facts(verdict_id)

        checked: list[tuple[Signed[LedgerEvent], Entry, str]] = []
        waiting: list[tuple[Signed[LedgerEvent], EvidenceMissingError]] = []
        for event in events:
            signer = event.signer
            try:
                entry = check_event(event, self.genesis, lookup, signer=signer, run_id=self._run_id)
                checked.append((event, entry, signer))
            except EvidenceMissingError as exc:
                waiting.append((event, exc))
        if waiting and self.pending_count() + len(waiting) > MAX_PENDING:
            raise ValidationError(
                f"{len(waiting)} event(s) cite verdicts not held and {MAX_PENDING} already wait"
            )
        added: list[Signed[LedgerEvent]] = []
        new_ids: list[bytes] = []
        try:
            self._db.execute("BEGIN IMMEDIATE")
            for verdict in batch_verdicts.values():
                self._insert_verdict(verdict, facts[verdict.id])
            self._db.executemany(
                "INSERT OR IGNORE INTO handoffs (verdict, trainer) VALUES (?, ?)",
                [(vid, t) for vid in batch_verdicts for t in hand_to],
            )
            for event, entry, signer in checked:
                if self._insert(event, entry, signer):
                    added.append(event)
                    new_ids.append(entry.id)
            for event, why in waiting:
                self._db.execute(
                    "INSERT OR IGNORE INTO pending VALUES (?, ?, ?, ?)",
                    (event.id, why.missing, str(why), event.raw),
                )
            self._db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            with contextlib.suppress(sqlite3.Error):  # e.g. the store was closed at shutdown
                self._db.execute("ROLLBACK")
            raise StorageError(f"ledger {self.path}: write failed: {exc}") from exc
        if self._index is not None:
            for new_id in new_ids:
                self._index.add(new_id)
        if batch_verdicts:
            added += self._release(list(batch_verdicts))
        return added

    def add_verdict(self, verdict: Signed[Verdict]) -> bool:
        """Keep a verdict (our own or one gossiped by another validator) and add the pending
        events that waited for it. Raises unless a genesis validator signed it for this run;
        False when it was known."""
        check_verdict(verdict, self.genesis, run_id=self._run_id)
        if self.verdict_facts(verdict.id) is not None:
            return False
        try:
            self._insert_verdict(verdict, VerdictFacts.of(verdict))
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {self.path}: write failed: {exc}") from exc
        self._release([verdict.id])
        return True

    def _release(self, verdict_ids: list[bytes]) -> list[Signed[LedgerEvent]]:
        """Add the pending events that waited for these verdicts."""
        added: list[Signed[LedgerEvent]] = []
        if self._db.execute("SELECT 1 FROM pending LIMIT 1").fetchone() is None:
            return added  # the common case: nothing waits, no lookup per verdict
        for verdict_id in verdict_ids:
            rows = self._db.execute(
                "SELECT id, raw FROM pending WHERE waits_for = ?", (verdict_id,)
            ).fetchall()
            for event_id, raw in rows:
                self._db.execute("DELETE FROM pending WHERE id = ?", (event_id,))
                try:
                    added += self.add([decode(bytes(raw), LedgerEvent)])
                except ValidationError as exc:  # say, a wrong amount: it can never become valid
                    self.refused_pending += 1
                    log.warning(
                        "ledger refused pending event %s: %s", bytes(event_id).hex()[:16], exc
                    )
        return added

    def _insert_verdict(self, verdict: Signed[Verdict], f: VerdictFacts) -> None:
        v = verdict.message
        self._db.execute(
            "INSERT OR IGNORE INTO verdicts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                verdict.id,
                f.submission,
                f.worker,
                f.validator,
                int(f.accepted),
                f.severity,
                len(v.rewards),
                sum(v.rewards),
                f.policy_version,
                f.counter,
                int(f.equivocation),
                v.created_at,
                verdict.raw,
            ),
        )

    def _insert(self, event: Signed[LedgerEvent], entry: Entry, signer: str) -> bool:
        """Insert one checked event and move the balances (inside the caller's transaction)."""
        e = event.message
        held = self._db.execute(
            "SELECT id, peer, delta FROM events WHERE slot = ? AND counted = 1", (entry.slot,)
        ).fetchone()
        counts = held is None or entry.id < bytes(held[0])
        cursor = self._db.execute(
            "INSERT OR IGNORE INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                entry.id,
                e.event,
                e.peer,
                e.amount,
                e.evidence,
                signer,
                e.created_at,
                entry.slot,
                entry.delta,
                int(counts),
                event.raw,
            ),
        )
        if not cursor.rowcount:
            return False
        # A pending copy of this event (if any) goes when its verdict's arrival releases it.
        if counts and entry.event != "dispute":
            delta = entry.delta
            if held is not None:
                self._db.execute("UPDATE events SET counted = 0 WHERE id = ?", (held[0],))
                delta -= int(held[2])
            initial = self.genesis.message.params.initial_balance
            self._db.execute(
                "INSERT INTO balances VALUES (?, ?)"
                " ON CONFLICT (peer) DO UPDATE SET balance = balance + ?",
                (entry.peer, initial + delta, delta),
            )
        return True

    # -- reading (index lookups only) ----------------------------------------------------------

    def status(self, peer: str, *, banned_limit: int = 20) -> dict[str, object]:
        """The ledger part of ``swarm-node status`` for ``peer``: index reads only, so it costs
        the same on a ledger of a million events as on an empty one."""
        return {
            "events": len(self),
            "balance": self.balance(peer),
            "banned": self.banned(banned_limit),
            "disputes": self.dispute_count(),
            "pending": self.pending_count(),
            "refused_pending": self.refused_pending,
        }

    def verdict_facts(self, verdict_id: bytes) -> VerdictFacts | None:
        row = self._db.execute(_FACTS, (verdict_id,)).fetchone()
        if row is None:
            return None
        vid, sub, worker, validator, accepted, severity, samples, version, counter, eq = row
        return VerdictFacts(
            bytes(vid),
            bytes(sub),
            worker,
            validator,
            bool(accepted),
            severity,
            int(samples) if accepted else 0,
            int(version),
            int(counter),
            bool(eq),
        )

    def verdict_raw(self, verdict_id: bytes) -> bytes | None:
        row = self._db.execute("SELECT raw FROM verdicts WHERE id = ?", (verdict_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def balance(self, peer: str) -> int:
        row = self._db.execute("SELECT balance FROM balances WHERE peer = ?", (peer,)).fetchone()
        return self.genesis.message.params.initial_balance if row is None else int(row[0])

    def balances(self) -> Balances:
        """Balances backed by the store's table: ``of(peer)`` is one lookup."""
        p = self.genesis.message.params
        return Balances(p.initial_balance, p.ban_threshold, BalanceView(self._db))

    def stored_balances(self) -> dict[str, int]:
        """Every materialised balance (peers with at least one counted event)."""
        return dict(BalanceView(self._db).items())

    def banned(self, limit: int = 100) -> list[str]:
        """Up to ``limit`` banned peers, lowest balance first."""
        rows = self._db.execute(
            "SELECT peer FROM balances WHERE balance < ? ORDER BY balance, peer LIMIT ?",
            (self.genesis.message.params.ban_threshold, limit),
        )
        return [str(p) for (p,) in rows]

    def lowest(self, limit: int = 50) -> list[str]:
        """The ``limit`` peers with the lowest balances (the banned first)."""
        rows = self._db.execute(
            "SELECT peer FROM balances ORDER BY balance, peer LIMIT ?", (limit,)
        )
        return [str(p) for (p,) in rows]

    def page(
        self, *, peer: str | None = None, before: bytes | None = None, limit: int = 50
    ) -> list[EventRow]:
        """Up to ``limit`` events in descending id order below ``before`` (paging)."""
        sql = "SELECT id, event, peer, amount, evidence, signer, created_at, counted FROM events"
        where: list[str] = []
        args: list[object] = []
        if peer is not None:
            where.append("peer = ?")
            args.append(peer)
        if before is not None:
            where.append("id < ?")
            args.append(before)
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = self._db.execute(sql + " ORDER BY id DESC LIMIT ?", (*args, limit))
        return [
            EventRow(bytes(i), ev, p, int(a), bytes(evd), s, int(c), bool(k))
            for i, ev, p, a, evd, s, c, k in rows
        ]

    def disputes(self, limit: int = 100) -> list[Signed[LedgerEvent]]:
        """Up to ``limit`` dispute events (open until an audit settles them by replay)."""
        rows = self._db.execute(
            "SELECT raw FROM events WHERE event = 'dispute' ORDER BY id LIMIT ?", (limit,)
        )
        return [decode(bytes(raw), LedgerEvent) for (raw,) in rows]

    def dispute_count(self) -> int:
        return int(
            self._db.execute("SELECT count(*) FROM events WHERE event = 'dispute'").fetchone()[0]
        )

    def pending_count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM pending").fetchone()[0])

    def is_counted(self, event_id: bytes) -> bool:
        row = self._db.execute("SELECT counted FROM events WHERE id = ?", (event_id,)).fetchone()
        return bool(row and row[0])

    def __len__(self) -> int:
        # max(rowid) is O(1); events are never deleted, so it equals count(*).
        row = self._db.execute("SELECT max(rowid) FROM events").fetchone()
        return int(row[0] or 0)

    # -- the whole set (audit, tests, small ledgers) -------------------------------------------

    def ids(self) -> set[bytes]:
        return {bytes(r[0]) for r in self._db.execute("SELECT id FROM events")}

    def raw_events(self, ids: Iterable[bytes] | None = None) -> Iterator[bytes]:
        """Envelope bytes of the given events (all when ``ids`` is None)."""
        if ids is None:
            for (raw,) in self._db.execute("SELECT raw FROM events ORDER BY id"):
                yield bytes(raw)
            return
        for event_id in ids:
            row = self._db.execute("SELECT raw FROM events WHERE id = ?", (event_id,)).fetchone()
            if row is not None:
                yield bytes(row[0])

    def events(self) -> Iterator[Signed[LedgerEvent]]:
        for raw in self.raw_events():
            yield decode(raw, LedgerEvent)

    def raw_verdicts(self) -> Iterator[bytes]:
        for (raw,) in self._db.execute("SELECT raw FROM verdicts ORDER BY id"):
            yield bytes(raw)

    # -- sync ----------------------------------------------------------------------------------

    def range_summary(self, prefix: str) -> tuple[int, int]:
        """(count, sum) of the event ids under a hex ``prefix`` (``swarm.ledger.reconcile``)."""
        if len(prefix) <= INDEX_DIGITS:
            if self._index is None:
                self._index = RangeIndex(
                    bytes(i) for (i,) in self._db.execute("SELECT id FROM events")
                )
            return self._index.summary(prefix)
        return summarise(self.ids_under(prefix))

    @staticmethod
    def scan_index(path: Path) -> tuple[RangeIndex, int]:
        """Build the range index from a separate read-only connection (safe in a worker
        thread while the owner keeps writing): the index and the last rowid it covers."""
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                db.execute("BEGIN")  # one snapshot for both reads
                top = int(db.execute("SELECT max(rowid) FROM events").fetchone()[0] or 0)
                rows = db.execute("SELECT id FROM events WHERE rowid <= ?", (top,))
                index = RangeIndex(bytes(i) for (i,) in rows)
            finally:
                db.close()
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"ledger {path}: cannot read: {exc}") from exc
        return index, top

    def adopt_index(self, index: RangeIndex, upto_rowid: int) -> None:
        """Use an index built by ``scan_index``, adding the events stored since its snapshot
        (events are never deleted, so rowids only grow)."""
        if self._index is not None:
            return  # built meanwhile, on demand
        for (i,) in self._db.execute("SELECT id FROM events WHERE rowid > ?", (upto_rowid,)):
            index.add(bytes(i))
        self._index = index

    def ids_under(self, prefix: str, limit: int = -1) -> list[bytes]:
        """The ids under a hex ``prefix``, in order (at most ``limit``; -1: all)."""
        return [bytes(i) for (i,) in self._under("id", prefix, limit)]

    def with_verdicts(self, id_prefix: bytes) -> Iterator[tuple[bytes, list[bytes]]]:
        """The events whose id starts with ``id_prefix``, each with the verdicts it cites."""
        for raw, evidence, event in self._under("raw, evidence, event", id_prefix.hex(), -1):
            cited = [] if event == "grant" else [bytes(evidence)]
            if event == "dispute":
                cited += decode(bytes(raw), LedgerEvent).message.related
            yield bytes(raw), [v for v in map(self.verdict_raw, cited) if v is not None]

    def _under(self, columns: str, prefix: str, limit: int) -> list[tuple[Any, ...]]:
        lo, hi = bounds(prefix)
        sql = f"SELECT {columns} FROM events WHERE id >= ?"
        args: tuple[object, ...] = (lo,)
        if hi is not None:
            sql += " AND id < ?"
            args += (hi,)
        return self._db.execute(sql + " ORDER BY id LIMIT ?", (*args, limit)).fetchall()

    def close(self) -> None:
        self._db.close()
