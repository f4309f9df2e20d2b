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
