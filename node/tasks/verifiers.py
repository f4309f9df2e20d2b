"""Answer verifiers: how a completion's text is scored against a task's reference answer.

Decisions this module owns:

- A verifier is named by a string carried by the task (``Task.verifier``) and by each line of
  a data set, never a callable, so a task travels as plain data and every node scores it alike.
- ``exact``: 1.0 when the completion, stripped of surrounding white space, equals the answer.
- ``math``: ``math-verify`` (Hugging Face) parses both sides (LaTeX, ``\\boxed{}``, plain
  numbers, fractions, sets, intervals) and compares them symbolically, so ``\\boxed{1/2}`` and
  ``0.5`` are the same answer, as a person would mark them. It ships in the default install
  and is imported on first use only: a node's main process never loads sympy (only the compute
  child scores). A completion that math-verify cannot parse scores 0.
- Parsed gold answers are cached per answer string (parsing dominates the cost).
- ``reasoning-gym``: the item's own data set scores it (``score_answer(answer, entry)``, the
  scorer reasoning-gym ships for that generator), on the text inside the completion's last
  ``<answer>...</answer>`` (reasoning-gym's format) or, without one, on the whole stripped
  completion. The task carries the item as JSON (``Task.entry``: data set name, its config and
  the item), so the scorer is rebuilt from it; scorers are built once per config. Scores are
  clamped to [0, 1]; a scorer that raises on the model's text (some parse numbers) gives 0.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any

from swarm.errors import ConfigError

VERIFIERS = ("exact", "math", "reasoning-gym")
DATA_VERIFIERS = ("exact", "math")
"""What a data set's rows may name (reasoning-gym items come only from a reasoning-gym source)."""


def check_verifier(name: str) -> str:
    """``name`` when this software knows the verifier, else a ConfigError saying which do."""
    if name not in VERIFIERS:
        raise ConfigError(f"unknown verifier {name!r}; use one of {', '.join(VERIFIERS)}")
    return name


@lru_cache(maxsize=4096)
def _gold(answer: str) -> Any:
    from math_verify import parse

    # A bare reference answer ("0.5", "1/2", "\frac{1}{2}") parses as math on its own; a
    # reference written with $...$ or \boxed{} parses through the LaTeX route.
    return parse(answer if any(c in answer for c in "$\\") else f"${answer}$")


def _math(answer: str, completion: str) -> float:
    from math_verify import parse, verify

    try:
        return 1.0 if verify(_gold(answer), parse(completion)) else 0.0
    except Exception:  # math-verify raises on some unparsable model output: no reward
        return 0.0


@lru_cache(maxsize=64)
def _gym_scorer(name: str, config: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **json.loads(config))


def _gym(completion: str, entry: str) -> float:
    from reasoning_gym.utils import extract_answer

    try:
        wrapped = json.loads(entry)
        scorer = _gym_scorer(wrapped["dataset"], json.dumps(wrapped["config"], sort_keys=True))
        item = wrapped["item"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"a reasoning-gym task carries a malformed item ({exc})") from exc
    given = extract_answer(completion)
    try:
        score = float(scorer.score_answer(completion.strip() if given is None else given, item))
    except Exception:  # a scorer that cannot read the model's text (e.g. parses a number): 0
        return 0.0
    return min(1.0, max(0.0, score)) if math.isfinite(score) else 0.0


def verify_answer(verifier: str, answer: str, completion: str, entry: str = "") -> float:
    """The task reward in [0, 1] of ``completion`` against the reference ``answer`` (and, for
    ``reasoning-gym``, the whole item ``entry``)."""
    if verifier == "exact":
        return 1.0 if completion.strip() == answer else 0.0
    if verifier == "math":
        return _math(answer, completion)
    if verifier == "reasoning-gym":
        return _gym(completion, entry)
    raise ConfigError(f"unknown verifier {verifier!r}; use one of {', '.join(VERIFIERS)}")
