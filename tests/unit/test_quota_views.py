"""Withholding shows (issue 24): the tally of a worker's requests with a verdict per policy
version, and the worker's durable per-version request counters."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from node.roles.worker import RequestCounters
from swarm.errors import ConfigError
from swarm.identity import NodeKey
from swarm.ledger.views import QuotaTally
from tests import ledger_factory as lf


def test_the_tally_counts_each_request_once_per_worker_and_version() -> None:
    tally = QuotaTally(quota=4, keep=2)
    for counter in (0, 1, 1, 3):  # counter 1 twice: an equivocation, or two validators
        tally.add("w", 5, counter, accepted=counter != 3)
    tally.add("other", 5, 0, accepted=True)
    [use] = tally.of("w")
    assert (use.version, use.submitted, use.accepted, use.quota) == (5, 3, 2, 4)
    assert use.describe() == "submitted 3 of 4 (2 accepted)"
    assert [u.worker for u in tally.rows()] == ["other", "w"]  # fewest submitted first


def test_the_tally_keeps_the_window_and_shows_a_worker_that_withholds() -> None:
    tally = QuotaTally(quota=4, keep=2)
    tally.add("w", 1, 0, accepted=True)
    tally.add("w", 2, 0, accepted=True)
    tally.add("lazy", 3, 0, accepted=True)  # v1 leaves the window
    tally.add("w", 1, 1, accepted=True)  # a late verdict of a version outside it: ignored
    assert tally.versions() == [3, 2]
    assert [(u.version, u.submitted) for u in tally.of("w")] == [(3, 0), (2, 1)]
    assert tally.workers() == {"w", "lazy"}


def test_counters_outside_the_quota_are_named_apart() -> None:
    tally = QuotaTally(quota=4, keep=3)
    tally.add("w", 0, 0, accepted=True)
    tally.add("w", 0, 9, accepted=True)  # a validator should have refused it
    [use] = tally.of("w")
    assert (use.submitted, use.beyond) == (1, 1)
    assert "1 outside the quota" in use.describe()


def test_a_run_without_a_quota_counts_any_counter() -> None:
    tally = QuotaTally(quota=0, keep=3)
    for counter in (10**6, 10**6 + 1):
        tally.add("w", 0, counter, accepted=True)
    [use] = tally.of("w")
    assert (use.submitted, use.accepted) == (2, 2)
    assert use.describe() == "submitted 2 (2 accepted)"


def test_request_counters_stop_at_the_quota_and_survive_a_restart(tmp_path: Path) -> None:
    counters = RequestCounters(tmp_path, quota=3, keep=2)
    assert [counters.next(7) for _ in range(4)] == [0, 1, 2, None]
    assert counters.left(7) == 0 and counters.left(8) == 3
    again = RequestCounters(tmp_path, quota=3, keep=2)  # a restarted worker
    assert again.next(7) is None and again.next(8) == 0
    assert again.next(9) == 0  # v7 leaves the two kept
    assert RequestCounters(tmp_path, quota=3, keep=2).used(7) == 0
    assert RequestCounters(tmp_path, quota=3, keep=2).used(8) == 1


def test_legacy_request_counters_run_on_across_versions(tmp_path: Path) -> None:
    counters = RequestCounters(tmp_path, quota=0, keep=2)
    assert [counters.next(0), counters.next(1), counters.next(1)] == [0, 1, 2]
    assert counters.left(1) is None
    assert (tmp_path / "worker.counter").read_text() == "3"
    assert RequestCounters(tmp_path, quota=0, keep=2).next(5) == 3


def test_unreadable_request_counters_are_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "worker.counters").write_text("not json")
    with pytest.raises(ConfigError, match="would repeat a counter"):
        RequestCounters(tmp_path, quota=3, keep=2)


def _rendered(table: Table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_status_shows_a_workers_own_requests_and_a_ledgers_fewest(tmp_path: Path) -> None:
    from cli.status import _quota_rows, _role_rows

    table = Table(show_header=False)
    _role_rows(table, {"worker": {"quota_used": {"v4": "64 of 64", "v5": "37 of 64"}}})
    text = _rendered(table)
    assert "worker requests v5" in text and "made 37 of 64" in text

    honest, lazy = (NodeKey.from_seed(bytes([i]) * 32) for i in (71, 72))
    work = [lf.Work(honest, 1, True), lf.Work(honest, 1, True), lf.Work(lazy, 1, True)]
    lf.build(tmp_path / "ledger.db", work).close()
    table = Table(show_header=False)
    _quota_rows(table, tmp_path / "ledger.db")
    text = _rendered(table)
    assert "2 worker(s) with verdicts" in text
    quota = lf.PARAMS.quota
    assert f"{lazy.peer_id[-12:]} submitted 1 of {quota} (1 accepted)" in text
