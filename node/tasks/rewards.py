"""Rewards: the task's verifier, the INTELLECT-2 length penalty, and the offline filter."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from node.tasks.suite import Task
from swarm.errors import ConfigError

DEFAULT_LENGTH_PENALTY = 0.001


def length_penalty(length: int, target_len: int | None, coeff: float) -> float:
    """``coeff * |target_len - length|``, or 0 when the task sets no target length."""
    if target_len is None:
        return 0.0
    return coeff * abs(target_len - length)


def reward(
    task: Task,
    completion: str,
    n_tokens: int,
    *,
    length_coeff: float = DEFAULT_LENGTH_PENALTY,
) -> float:
    """Task reward minus the length penalty (INTELLECT-2): ``r - coeff * |target - len|``."""
    return task.reward(completion) - length_penalty(n_tokens, task.target_len, length_coeff)


def offline_filter(
    task_ids: Iterable[int],
    solve_rate: Callable[[int], float],
    low: float = 0.0,
    high: float = 1.0,
) -> tuple[list[int], list[int]]:
    """Split tasks into (kept, dropped) by solve rate: kept when ``low < rate < high``.

    INTELLECT-2 drops tasks the starting policy always or never solves: they give no advantage.
    ``solve_rate`` is measured once before the run (e.g. :func:`estimate_solve_rate`).
    """
    if not 0.0 <= low <= high <= 1.0:
        raise ConfigError(f"solve-rate band must satisfy 0 <= low <= high <= 1, got {low}, {high}")
    kept: list[int] = []
    dropped: list[int] = []
    for task_id in task_ids:
        rate = solve_rate(task_id)
        (kept if low < rate < high else dropped).append(task_id)
    return kept, dropped


def estimate_solve_rate(task: Task, completions: Iterable[str]) -> float:
    """Mean task reward over sampled ``completions`` of one task."""
    rewards = [task.reward(c) for c in completions]
    return sum(rewards) / len(rewards) if rewards else 0.0
