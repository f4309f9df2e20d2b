"""Fixtures every test may use. Network factories live beside the integration tests."""

from __future__ import annotations

import hashlib
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from swarm.identity import NodeKey

# This machine is shared and noisy: no per-example deadlines, and no health check on slow data.
settings.register_profile(
    "swarm", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("swarm")


@pytest.fixture
def make_key() -> Callable[[str], NodeKey]:
    """Deterministic keys by name: make_key("alice") is the same key every time."""

    def make(name: str) -> NodeKey:
        return NodeKey.from_seed(hashlib.sha256(name.encode()).digest())

    return make


@pytest.fixture(autouse=True)
def _isolated_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No test ever touches the real ~/.local/share/swarm-node."""
    monkeypatch.setenv("SWARM_NODE_HOME", str(tmp_path_factory.mktemp("home")))
    monkeypatch.delenv("SWARM_NODE_PASSPHRASE", raising=False)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen2 model directory with a real BPE tokenizer and a chat template, made once
    per session by ``scripts/make_test_model.py`` (random weights, seed 0)."""
    from tests.hf_model import make_test_model

    return make_test_model(tmp_path_factory.mktemp("hf") / "qwen2-tiny")


CPU_BOUND = (
    "tests/system/",
    "tests/integration/test_group_training_audit.py",
    "tests/integration/test_training_audit.py",
    "tests/integration/test_role_healing.py",
)
"""Tests that keep both cores busy (many processes each, training steps, replays, the demo),
measured with vmstat beside a serial run (docs/BENCHMARKS.md, "The test suite's time"): under
``--dist loadgroup`` (``scripts/test`` on two cores or more) they run one after another,
first, on one worker, while the other worker runs the rest, which mostly wait on the network
(half of both cores idle)."""


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under ``--dist loadgroup``: every CPU-bound test
    together, else its module (its module-scoped swarm set up once)."""
    path = nodeid.split("::")[0]
    return "cpu-bound" if path.startswith(CPU_BOUND) else path


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist` knows no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` by ``work_unit``. pytest-xdist 3.8's own grouping (``xdist_group``
    marks) appends the group to ``item._nodeid``, which pytest 9 no longer reads
    (``Node.nodeid`` is ``str(item._id)``): under the pinned pair every test was a unit of its
    own, and the CPU-bound tests ran on both workers at once (found 2026-12-06: the CPU-bound
    training tests failed beside each other). The scheduler groups by the node id itself,
    which needs nothing from the workers."""
    if config.getoption("dist", default=None) != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``loadgroup`` the CPU-bound tests come first in collection order. (The scheduler
    hands out the largest units first, ``--loadscope-reorder``: the CPU-bound unit, with the
    most tests, leads either way.) Collection runs in the workers, where pytest-xdist keeps
    ``option.loadgroup`` (it sets ``dist`` to "no" there)."""
    if getattr(config.option, "loadgroup", False):
        items.sort(key=lambda item: work_unit(item.nodeid) != "cpu-bound")  # stable: files kept


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failure that is an exception group (trio nurseries nest them deeper than the ten
    levels a report prints) also shows each leaf exception with its own traceback: where it
    was raised, not only the nurseries it passed through."""
    outcome = yield
    report = outcome.get_result()
    excinfo = call.excinfo
    if report.failed and excinfo is not None and isinstance(excinfo.value, BaseExceptionGroup):
        text = "\n".join(
            "".join(traceback.format_exception(leaf, chain=False))
            for leaf in _leaves(excinfo.value)
        )
        report.sections.append(("exception group leaves", text))
