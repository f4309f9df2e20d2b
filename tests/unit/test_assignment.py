from __future__ import annotations

import pytest

from swarm.assignment import assign, assignment_key, quota_refusal, within_quota
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


# Computed by swarm/assignment.py before quotas existed (issue 24): a legacy run (quota 0)
# must keep exactly these, or old ledgers and evidence would no longer replay.
LEGACY_PINS = [
    (
        ("r", 3, "peer", 7),
        {"n_prompts": 4, "suite_size": 100},
        2302175608576864517,
        (16, 69, 71, 83),
    ),
    (
        ("0123456789abcdef0123456789abcdef", 5, "12D3KooWExample", 63),
        {"n_prompts": 8, "suite_size": 1000, "excluded": {1, 2, 3}},
        705883247013260180,
        (879, 269, 759, 143, 276, 322, 118, 857),
    ),
]
MANIFEST = bytes(range(32))


@pytest.mark.parametrize("inputs, kwargs, seed, prompts", LEGACY_PINS)
def test_a_legacy_run_keeps_the_assignment_it_always_had(
    inputs: tuple[str, int, str, int],
    kwargs: dict[str, object],
    seed: int,
    prompts: tuple[int, ...],
) -> None:
    key = assignment_key(0, MANIFEST)  # a legacy run ignores any manifest id
    assert key is None
    a = assign(*inputs, manifest_id=key, **kwargs)  # type: ignore[arg-type]
    assert (a.seed, a.prompt_ids) == (seed, prompts)


def test_the_manifest_id_changes_the_assignment_and_the_same_inputs_give_the_same() -> None:
    a = assign("r", 3, "peer", 7, manifest_id=MANIFEST, **ARGS)
    assert a == assign("r", 3, "peer", 7, manifest_id=MANIFEST, **ARGS)
    other = assign("r", 3, "peer", 7, manifest_id=bytes(32), **ARGS)
    legacy = assign("r", 3, "peer", 7, **ARGS)
    assert a.seed != other.seed and a.prompt_ids != other.prompt_ids
    assert a.seed != legacy.seed and a.prompt_ids != legacy.prompt_ids


def test_a_run_with_a_quota_needs_the_manifest_id_of_32_bytes() -> None:
    with pytest.raises(ConfigError, match="manifest id"):
        assignment_key(64, None)
    assert assignment_key(64, MANIFEST) == MANIFEST
    with pytest.raises(ConfigError, match="32 bytes"):
        assign("r", 0, "p", 0, manifest_id=b"short", **ARGS)


def test_counters_lie_in_the_quota() -> None:
    assert within_quota(0, 64) and within_quota(63, 64)
    assert not within_quota(64, 64) and not within_quota(-1, 64)
    assert within_quota(10**9, 0)  # a legacy run: unbounded
    assert quota_refusal(63, 64) is None
    why = quota_refusal(64, 64)
    assert why is not None and "\n" not in why and "0..63" in why and "quota=64" in why
