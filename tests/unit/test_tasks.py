"""The default task suite, rewards, length penalty, offline filter, math JSONL loader."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from node.tasks import (
    FAMILIES,
    LEVELS,
    TaskSuite,
    default_suite,
    estimate_solve_rate,
    length_penalty,
    load_math_jsonl,
    make_task,
    offline_filter,
    reward,
)
from swarm.errors import ConfigError


def test_tasks_are_deterministic_from_seed_and_id() -> None:
    a, b = default_suite(seed=3), default_suite(seed=3)
    assert [a.task(i) for i in range(50)] == [b.task(i) for i in range(50)]
    assert [a.task(i) for i in range(50)] != [default_suite(seed=4).task(i) for i in range(50)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("level", LEVELS)
def test_answers_are_correct(family: str, level: int) -> None:
    for i in range(30):
        t = make_task(1, i, family, level)
        body = t.prompt.split(":", 1)[-1].rstrip("=")
        if family == "add":
            x, y = body.split("+")
            assert int(t.answer) == int(x) + int(y)
        elif family == "sub":
            x, y = body.split("-")
            assert int(t.answer) == int(x) - int(y) >= 0
        elif family == "rev":
            assert t.answer == body[::-1]
        else:
            assert t.answer == "".join(sorted(body))
        assert len(t.prompt) <= 24 and len(t.answer) <= 8


def test_levels_grow_harder() -> None:
    lengths = [
        sum(len(make_task(0, i, "rev", lvl).answer) for i in range(50)) / 50 for lvl in LEVELS
    ]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_exact_answer_scores_one_else_zero() -> None:
    t = default_suite().task(0)
    assert t.reward(t.answer) == 1.0
    assert t.reward(t.answer + "0") == 0.0
    assert t.reward("") == 0.0


def test_length_penalty_follows_intellect2() -> None:
    assert length_penalty(10, None, 0.1) == 0.0
    assert length_penalty(10, 14, 0.1) == pytest.approx(0.4)
    t = make_task(0, 0, "add", 1)
    from dataclasses import replace

    t2 = replace(t, target_len=5)
    assert reward(t2, t.answer, 8, length_coeff=0.01) == pytest.approx(1.0 - 0.03)


def test_offline_filter_keeps_the_band() -> None:
    rates = {0: 0.0, 1: 0.5, 2: 1.0, 3: 0.2}
    kept, dropped = offline_filter(rates, rates.__getitem__, 0.0, 1.0)
    assert kept == [1, 3] and dropped == [0, 2]
    suite = default_suite().with_excluded(set(dropped))
    assert 0 not in suite.ids()[:5] and 1 in suite.ids()[:5]
    with pytest.raises(ConfigError):
        offline_filter(rates, rates.__getitem__, 0.8, 0.2)


def test_estimate_solve_rate() -> None:
    t = default_suite().task(1)
    assert estimate_solve_rate(t, [t.answer, "x", t.answer, "y"]) == 0.5


def test_bad_suite_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        TaskSuite(mix=(("mul", 1),))
    with pytest.raises(ConfigError):
        default_suite().task(-1)


def test_math_jsonl_without_the_extra_or_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_math_jsonl(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(ConfigError):
        load_math_jsonl(bad)


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="extra 'math' absent")
def test_math_jsonl_checks_answers_with_math_verify(tmp_path: Path) -> None:
    path = tmp_path / "math.jsonl"
    rows = [{"prompt": "What is 1/2 + 1/4?", "answer": "$\\frac{3}{4}$"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (task,) = load_math_jsonl(path)
    assert task.reward("The answer is $0.75$") == 1.0
    assert task.reward("The answer is $\\frac{1}{3}$") == 0.0
