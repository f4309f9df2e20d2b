"""The default task suite: procedurally generated tasks with exact, verifiable answers.

Every task is a pure function of ``(suite seed, task id)``: looking a task up by id costs one
small generation, needs no table, and gives the same task on every machine. Families and levels:

=========  =====================================  ==========================================
family     prompt (then the model writes)          levels (1 easy .. 3 hard)
=========  =====================================  ==========================================
``add``    ``"47+385="``                           operands of 1 / 2 / 3 digits
``sub``    ``"385-47="``  (never negative)         operands of 1 / 2 / 3 digits
``rev``    ``"rev:kqzd="``                         3-4 / 5-6 / 7-8 lowercase letters
``sort``   ``"sort:kqzd="``                        3-4 / 5-6 / 7-8 lowercase letters
=========  =====================================  ==========================================

The default mix (:func:`default_suite`) is rev and sort at levels 2 and 3: task ``i`` is entry
``i % 4`` of ``(rev 2, rev 3, sort 2, sort 3)``. Arithmetic stays available to other mixes but
is out of the default: the embedded ~0.7M-parameter model learns it too slowly for RL to move it
within a demo (after 1,300-1,500 warm-up steps 2-digit add/sub solve 5-10%, 3-digit add ~0),
while rev/sort warmed up to a sampled reward of about 0.25 gain +0.3 within about 130 GRPO
steps in process (``bench/rl_inprocess.py``, docs/BENCHMARKS.md).

The answer is the exact string; the model ends it with EOS. Rewards are 1.0 for an exact answer
and 0.0 otherwise (see :mod:`node.tasks.rewards` for the optional length penalty).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from node.tasks.verifiers import verify_answer
from swarm.errors import ConfigError

FAMILIES = ("add", "sub", "rev", "sort")
LEVELS = (1, 2, 3)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Task:
    """One prompt with a verifiable answer."""

    id: int
    family: str
    level: int
    prompt: str
    answer: str
    target_len: int | None = None
    verifier: str = "exact"
    """How the answer is checked (:mod:`node.tasks.verifiers`): ``exact``, ``math`` or
    ``reasoning-gym`` (the item's data set's own scorer)."""
    entry: str = ""
    """The item as its library gave it, as JSON text, for a verifier that scores against the
    whole item (reasoning-gym's ``score_answer(answer, entry)``); empty otherwise."""

    def reward(self, completion: str) -> float:
        """Task reward in [0, 1] for the decoded ``completion`` (text before EOS)."""
        return verify_answer(self.verifier, self.answer, completion, self.entry)


def _rng(seed: int, task_id: int) -> random.Random:
    digest = hashlib.sha256(f"swarm-node/task/{seed}/{task_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def make_task(seed: int, task_id: int, family: str, level: int) -> Task:
    """The task of ``family`` and ``level`` that ``(seed, task_id)`` names."""
    if family not in FAMILIES or level not in LEVELS:
        raise ConfigError(f"unknown task family/level {family!r}/{level}; families {FAMILIES}")
    rng = _rng(seed, task_id)
    if family in ("add", "sub"):
        a, b = _number(rng, level), _number(rng, rng.randint(1, level))
        if rng.random() < 0.5:
            a, b = b, a
        if family == "add":
            prompt, answer = f"{a}+{b}=", str(a + b)
        else:
            a, b = max(a, b), min(a, b)
            prompt, answer = f"{a}-{b}=", str(a - b)
    else:
        n = rng.randint(2 * level + 1, 2 * level + 2)
        word = "".join(rng.choice(_LETTERS) for _ in range(n))
        answer = word[::-1] if family == "rev" else "".join(sorted(word))
        prompt = f"{family}:{word}="
    return Task(task_id, family, level, prompt, answer)


@dataclass(frozen=True)
class TaskSuite:
    """A deterministic, endless suite: task ``i`` draws its family and level from the mix."""

    seed: int = 0
    mix: Sequence[tuple[str, int]] = (
        ("rev", 2),
        ("rev", 3),
        ("sort", 2),
        ("sort", 3),
    )
    size: int = 100_000
    excluded: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.mix or self.size <= 0:
            raise ConfigError("a task suite needs a non-empty mix and a positive size")
        for family, level in self.mix:
            if family not in FAMILIES or level not in LEVELS:
                raise ConfigError(f"unknown task family/level {family!r}/{level}")

    def task(self, task_id: int) -> Task:
        """Task ``task_id`` (0 <= id < size); the same on every machine."""
        if not 0 <= task_id < self.size:
            raise ConfigError(f"task id {task_id} outside the suite (size {self.size})")
        family, level = self.mix[task_id % len(self.mix)]
        return make_task(self.seed, task_id, family, level)

    def ids(self) -> list[int]:
        """Every task id of the suite that the offline filter kept."""
        return [i for i in range(self.size) if i not in self.excluded]

    def with_excluded(self, ids: set[int] | frozenset[int]) -> TaskSuite:
        """The same suite without ``ids`` (the offline filter's output)."""
        return TaskSuite(self.seed, self.mix, self.size, self.excluded | frozenset(ids))


def default_suite(seed: int = 0) -> TaskSuite:
    """The suite the demo run and the embedded default model use."""
    return TaskSuite(seed=seed)
