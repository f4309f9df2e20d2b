"""The default task suite, JSONL data sets, verifiers, rewards, length penalty, offline filter."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from node.tasks import (
    FAMILIES,
    LEVELS,
    TaskSuite,
    default_suite,
    estimate_solve_rate,
    length_penalty,
    load_dataset,
    make_task,
    offline_filter,
    reward,
)
from swarm.assignment import assign
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


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


MATH_ROWS = [
    {"prompt": "What is 1/2 written as a decimal?", "answer": "0.5", "verifier": "math"},
    {"prompt": "Half of one?", "answer": "\\boxed{1/2}", "verifier": "math"},
    {"prompt": "What is 1/2 + 1/4?", "answer": "$\\frac{3}{4}$", "verifier": "math"},
    {"prompt": "rev:abc=", "answer": "cba", "target_len": 4},
]


@pytest.mark.parametrize(
    ("task_id", "completion", "expected"),
    [
        (0, "The answer is \\boxed{1/2}", 1.0),
        (0, "$\\frac{1}{2}$", 1.0),
        (0, "0.50", 1.0),
        (0, "\\boxed{0.6}", 0.0),
        (1, "0.5", 1.0),
        (1, "It is 1/3", 0.0),
        (2, "The answer is $0.75$", 1.0),
        (2, "$\\frac{1}{3}$", 0.0),
        (2, "no number here {{{", 0.0),
        (3, " cba ", 1.0),
        (3, "cb a", 0.0),
    ],
)
def test_math_verify_scores_answer_forms_as_a_person_would(
    tmp_path: Path, task_id: int, completion: str, expected: float
) -> None:
    data = load_dataset(write_jsonl(tmp_path / "math.jsonl", list(MATH_ROWS)))
    assert data.task(task_id).reward(completion) == expected


def test_dataset_ids_follow_lines_and_it_works_like_a_suite(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [MATH_ROWS[0], "", MATH_ROWS[3]])
    data = load_dataset(path)
    assert data.size == 2 and [data.task(i).prompt for i in data.ids()] == [
        MATH_ROWS[0]["prompt"],
        "rev:abc=",
    ]
    assert data.task(0).verifier == "math" and data.task(1).verifier == "exact"
    assert data.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match="outside the data set"):
        data.task(2)


def test_offline_filter_and_length_penalty_work_on_a_dataset(tmp_path: Path) -> None:
    data = load_dataset(write_jsonl(tmp_path / "d.jsonl", list(MATH_ROWS)))
    rates = {0: 1.0, 1: 0.5, 2: 0.0, 3: 0.25}
    kept, dropped = offline_filter(data.ids(), rates.__getitem__)
    filtered = data.with_excluded(set(dropped))
    assert filtered.ids() == kept == [1, 3]
    a = assign("r", 0, "w", 0, n_prompts=2, suite_size=filtered.size, excluded=filtered.excluded)
    assert set(a.prompt_ids) <= {1, 3}
    # target_len 4 on "cba": 3 tokens -> penalty coeff * 1
    assert reward(data.task(3), "cba", 3, length_coeff=0.1) == pytest.approx(0.9)
    assert reward(data.task(0), "0.5", 30, length_coeff=0.1) == 1.0  # no target: no penalty


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json}", "d.jsonl:2: not JSON"),
        ('["prompt", "answer"]', "d.jsonl:2: a line must be a JSON object"),
        ('{"answer": "1"}', 'd.jsonl:2: "prompt" must be a non-empty string'),
        ('{"prompt": "p"}', 'd.jsonl:2: "answer" must be'),
        ('{"prompt": "p", "answer": "1", "verifier": "llm"}', "verifier 'llm' is not one of"),
        ('{"prompt": "p", "answer": "1", "target_len": -3}', "target_len"),
    ],
)
def test_bad_dataset_lines_name_file_and_line(tmp_path: Path, line: str, says: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [MATH_ROWS[0], line])
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_dataset(path)


def test_missing_or_empty_dataset_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the data set"):
        load_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="holds no tasks"):
        load_dataset(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_dataset(tmp_path / "bin.jsonl")
