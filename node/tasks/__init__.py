"""Tasks and rewards: the default procedural suite, length penalty, offline filter, math JSONL."""

from node.tasks.math_jsonl import load_math_jsonl
from node.tasks.rewards import (
    DEFAULT_LENGTH_PENALTY,
    estimate_solve_rate,
    length_penalty,
    offline_filter,
    reward,
)
from node.tasks.suite import FAMILIES, LEVELS, Task, TaskSuite, default_suite, make_task

__all__ = [
    "DEFAULT_LENGTH_PENALTY",
    "FAMILIES",
    "LEVELS",
    "Task",
    "TaskSuite",
    "default_suite",
    "estimate_solve_rate",
    "length_penalty",
    "load_math_jsonl",
    "make_task",
    "offline_filter",
    "reward",
]
