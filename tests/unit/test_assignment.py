from __future__ import annotations

import pytest

from swarm.assignment import assign
from swarm.errors import ConfigError

ARGS = {"n_prompts": 8, "suite_size": 1000}


def test_assignment_is_deterministic_and_distinct() -> None:
    a = assign("r", 3, "peer", 7, **ARGS)
    assert a == assign("r", 3, "peer", 7, **ARGS)
    assert len(set(a.prompt_ids)) == 8 and all(0 <= p < 1000 for p in a.prompt_ids)
    assert 0 <= a.seed < 2**63


@pytest.mark.parametrize(
    "field, value", [("run_id", "r2"), ("version", 4), ("worker", "peer2"), ("counter", 8)]
)
def test_every_input_changes_the_assignment(field: str, value: object) -> None:
    base: dict[str, object] = {"run_id": "r", "version": 3, "worker": "peer", "counter": 7}
    a = assign(**base, **ARGS)  # type: ignore[arg-type]
    b = assign(**(base | {field: value}), **ARGS)  # type: ignore[arg-type]
    assert a.seed != b.seed and a.prompt_ids != b.prompt_ids


def test_excluded_prompts_are_never_assigned() -> None:
    excluded = set(range(0, 1000, 2))
    for counter in range(20):
        a = assign("r", 0, "p", counter, excluded=excluded, **ARGS)
        assert not excluded & set(a.prompt_ids)


def test_impossible_assignment_is_a_clear_error() -> None:
    with pytest.raises(ConfigError):
        assign("r", 0, "p", 0, n_prompts=5, suite_size=4)
    with pytest.raises(ConfigError, match="too few"):
        assign("r", 0, "p", 0, n_prompts=3, suite_size=4, excluded={0, 1})
