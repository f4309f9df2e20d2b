"""Read-only views of the store's tables: what ``ledger show`` and ``status`` read, without
decoding an envelope or folding anything.

``QuotaTally`` shows withholding: of each worker's requests of a policy version (counters
``0 .. quota - 1``, ``swarm.assignment``), how many the ledger holds a verdict for. A verdict
names its worker, version and counter, so the tally is folded from the ``verdicts`` table's
columns, one row at a time (the dashboard folds in new rows only; ``read_quota_use`` reads a
ledger file once, a scan of its verdicts, for ``ledger show`` and ``status``). It keeps the
``keep`` newest versions it has seen (the async window: older ones can no longer be submitted)
and one bitmask of counters per worker and version, so a verdict counted twice (an equivocation,
two validators) counts one request. What a worker made but never submitted (work dropped as
stale, or withheld) is the difference to the quota.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from swarm.errors import StorageError


@dataclass(frozen=True, slots=True)
class EventRow:
    """One stored event as ``ledger show`` prints it (no signature check: it was checked on
    insert)."""

    id: bytes
    event: str
    peer: str
    amount: int
    evidence: bytes
    signer: str
    created_at: int
    counted: bool


class BalanceView(Mapping[str, int]):
    """The balances table as a read-only mapping: lookups by key, never a whole-table read
    unless iterated."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __getitem__(self, peer: str) -> int:
        row = self._db.execute("SELECT balance FROM balances WHERE peer = ?", (peer,)).fetchone()
        if row is None:
            raise KeyError(peer)
        return int(row[0])

    def __iter__(self) -> Iterator[str]:
        return iter(
            [str(p) for (p,) in self._db.execute("SELECT peer FROM balances ORDER BY peer")]
        )

    def __len__(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM balances").fetchone()[0])


@dataclass(frozen=True, slots=True)
class QuotaUse:
    """Of one worker's requests of one policy version: how many the ledger holds a verdict for
    (``submitted``), how many were accepted, and how many named a counter outside the quota
    (``beyond``: a validator should have refused those)."""

    worker: str
    version: int
    submitted: int
    accepted: int
    quota: int
    beyond: int = 0

    def describe(self) -> str:
        """``"submitted 37 of 64 (35 accepted)"``; without ``of`` for a run with no quota."""
        of = f" of {self.quota}" if self.quota else ""
        out = f"submitted {self.submitted}{of} ({self.accepted} accepted)"
        return out + (f", {self.beyond} outside the quota" if self.beyond else "")

    def as_dict(self) -> dict[str, int | str]:
        return {
            "worker": self.worker,
            "version": self.version,
            "submitted": self.submitted,
            "accepted": self.accepted,
            "quota": self.quota,
            "beyond": self.beyond,
        }


@dataclass
class _Requests:
    judged: int = 0
    """Bitmask of the counters (below the quota) with a verdict."""
    accepted: int = 0
    others: set[int] = field(default_factory=set)
    """Counters outside a bitmask: at or above the quota, or any counter of a run without a
    quota (whose counters run on across versions: a bitmask would grow with them)."""
    others_accepted: set[int] = field(default_factory=set)


class QuotaTally:
    """Counters with a verdict per worker and policy version, for the ``keep`` newest versions
    seen (``quota == 0``: a run without a quota, every counter counts)."""

    def __init__(self, quota: int, keep: int) -> None:
        self.quota = quota
        self.keep = max(1, keep)
        self._by_version: dict[int, dict[str, _Requests]] = {}

    def add(self, worker: str, version: int, counter: int, accepted: bool) -> None:
        """Fold in one verdict (those that name no version or counter are skipped)."""
        if version < 0 or counter < 0:
            return
        if version not in self._by_version:
            if len(self._by_version) >= self.keep and version < min(self._by_version):
                return  # older than every version kept: outside the window
            self._by_version[version] = {}
            for old in sorted(self._by_version)[: -self.keep]:
                del self._by_version[old]
        requests = self._by_version[version].setdefault(worker, _Requests())
        if not self.quota or counter >= self.quota:
            requests.others.add(counter)
            if accepted:
                requests.others_accepted.add(counter)
            return
        bit = 1 << counter
        requests.judged |= bit
        if accepted:
            requests.accepted |= bit

    def workers(self) -> set[str]:
        """Every worker with a verdict of a version kept."""
        return {w for workers in self._by_version.values() for w in workers}

    def versions(self) -> list[int]:
        """The versions kept, newest first."""
        return sorted(self._by_version, reverse=True)

    def of(self, worker: str) -> list[QuotaUse]:
        """``worker``'s use of each version kept, newest first (versions it has no verdict of
        show as 0 submitted: withholding shows)."""
        out = []
        for version in self.versions():
            r = self._by_version[version].get(worker, _Requests())
            out.append(self._use(worker, version, r))
        return out

    def rows(self, version: int | None = None) -> list[QuotaUse]:
        """Every worker's use of ``version`` (default: the newest kept), fewest submitted
        first."""
        if version is None:
            version = max(self._by_version, default=-1)
        workers = self._by_version.get(version, {})
        uses = [self._use(w, version, r) for w, r in workers.items()]
        return sorted(uses, key=lambda u: (u.submitted, u.worker))

    def _use(self, worker: str, version: int, r: _Requests) -> QuotaUse:
        if not self.quota:
            return QuotaUse(worker, version, len(r.others), len(r.others_accepted), 0)
        return QuotaUse(
            worker,
            version,
            r.judged.bit_count(),
            r.accepted.bit_count(),
            self.quota,
            len(r.others),
        )


def read_quota_use(path: Path, quota: int, keep: int) -> QuotaTally:
    """The ``QuotaTally`` of a ledger file, read on a read-only connection of its own (the node
    may be writing; WAL lets both go on). One scan of the verdicts of the ``keep`` newest
    versions."""
    tally = QuotaTally(quota, keep)
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            (newest,) = db.execute(
                "SELECT coalesce(max(policy_version), -1) FROM verdicts"
            ).fetchone()
            rows = db.execute(
                "SELECT worker, policy_version, counter, accepted FROM verdicts"
                " WHERE policy_version > ? AND counter >= 0",
                (int(newest) - tally.keep,),
            ).fetchall()
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise StorageError(f"ledger {path} cannot be read: {exc}") from exc
    for worker, version, counter, accepted in rows:
        tally.add(str(worker), int(version), int(counter), bool(accepted))
    return tally
