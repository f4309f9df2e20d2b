"""Tasks and rewards: the default procedural suite, JSONL data sets, local Hugging Face data
sets (``hf``), reasoning-gym generators (``gym``), verifiers, length penalty, offline filter."""

from node.tasks.dataset import TaskDataset, load_dataset
from node.tasks.rewards import (
    DEFAULT_LENGTH_PENALTY,
    estimate_solve_rate,
    length_penalty,
    offline_filter,
    reward,
)
from node.tasks.suite import FAMILIES, LEVELS, Task, TaskSuite, default_suite, make_task
from node.tasks.verifiers import VERIFIERS, verify_answer

__all__ = [
    "DEFAULT_LENGTH_PENALTY",
    "FAMILIES",
    "LEVELS",
    "VERIFIERS",
    "Task",
    "TaskDataset",
    "TaskSuite",
    "default_suite",
    "estimate_solve_rate",
    "length_penalty",
    "load_dataset",
    "make_task",
    "offline_filter",
    "reward",
    "verify_answer",
]
