"""The test suite's split under ``scripts/test``: the CPU-bound tests are one unit of work (one
worker runs them one after another), every other module a unit of its own. pytest-xdist's own
``xdist_group`` marks did nothing under pytest 9 (docs/BENCHMARKS.md, "The test suite's
time"); this checks the scheduler ``tests/conftest.py`` hands xdist instead."""

from __future__ import annotations

from typing import Any

from tests.conftest import pytest_xdist_make_scheduler


class _Config:
    def __init__(self, dist: str) -> None:
        self.dist = dist

    def getoption(self, name: str, default: Any = None) -> Any:
        return self.dist if name == "dist" else default

    def getvalue(self, name: str) -> Any:
        assert name == "tx"
        return ["2*popen"]


def test_the_cpu_bound_tests_are_one_unit_and_every_other_module_its_own() -> None:
    scheduler = pytest_xdist_make_scheduler(_Config("loadgroup"), None)  # type: ignore[arg-type]
    cpu = [
        "tests/system/test_up.py::test_up_trains_catches_the_cheater_and_audits",
        "tests/system/test_light_nodes.py::test_main_process_loads_no_heavy_package[validator]",
        "tests/integration/test_training_audit.py::test_training_audits_agree",
        "tests/integration/test_group_training_audit.py::test_the_audit_agrees",
    ]
    assert {scheduler._split_scope(n) for n in cpu} == {"cpu-bound"}
    other = [
        "tests/integration/test_relay.py::test_a",
        "tests/integration/test_relay.py::test_b[x@y]",
        "tests/unit/test_wire.py::test_c",
    ]
    assert [scheduler._split_scope(n) for n in other] == [
        "tests/integration/test_relay.py",
        "tests/integration/test_relay.py",
        "tests/unit/test_wire.py",
    ]
    # Any other distribution is xdist's own.
    assert pytest_xdist_make_scheduler(_Config("load"), None) is None  # type: ignore[arg-type]
