"""Tasks as data: a JSONL data set of (prompt, answer, verifier) lines, as a task suite.

Decisions this module owns:

- One JSON object per line: ``"prompt"`` and ``"answer"`` (strings, required), ``"verifier"``
  (``"exact"`` or ``"math"``, default ``"exact"``; :mod:`node.tasks.verifiers`) and
  ``"target_len"`` (a positive integer, optional: the INTELLECT-2 length penalty applies to
  it exactly as to procedural tasks). Blank lines are skipped; task ids are 0, 1, 2, ... over
  the non-blank lines in file order, so the same file gives the same ids everywhere.
- A bad line is a :class:`ConfigError` naming ``file:line`` and what is wrong; nothing is
  loaded from a file with a bad line (a run must not silently train on part of its data).
- :class:`TaskDataset` has the interface of the procedural :class:`~node.tasks.suite.TaskSuite`
  (``task``, ``size``, ``excluded``, ``ids``, ``with_excluded``), so assignment, rollouts,
  judging, the offline filter and the length penalty work on either unchanged.
- The file is bound to the run by sha256 in the genesis and fetched from peers by the run's
  node code (not here); ``sha256`` is kept so callers can compare.
- JSONL keeps this reader rather than ``datasets``' JSON builder, which does not do the same
  (datasets 5.2): it fails on a blank line with no line number ("Expected object or value"),
  and in a file whose answers mix "1" and 2 it turns the string "1" into the number 1. Parquet,
  arrow and saved ``datasets`` folders load through ``datasets`` (:mod:`node.tasks.hf`), and
  their rows pass the same checks (``task_of_row``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.tasks.suite import Task
from node.tasks.verifiers import DATA_VERIFIERS as VERIFIERS
from swarm.errors import ConfigError

MAX_DATASET_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class TaskDataset:
    """A data set's tasks, indexed by line order; the offline filter excludes ids."""

    tasks: tuple[Task, ...]
    sha256: str = ""
    excluded: frozenset[int] = field(default=frozenset())

    @property
    def size(self) -> int:
        return len(self.tasks)

    def task(self, task_id: int) -> Task:
        if not 0 <= task_id < len(self.tasks):
            raise ConfigError(f"task id {task_id} outside the data set (size {len(self.tasks)})")
        return self.tasks[task_id]

    def ids(self) -> list[int]:
        return [i for i in range(len(self.tasks)) if i not in self.excluded]

    def with_excluded(self, ids: set[int] | frozenset[int]) -> TaskDataset:
        return TaskDataset(self.tasks, self.sha256, self.excluded | frozenset(ids))


def _parse_line(where: str, task_id: int, line: str) -> Task:
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.args[0][:80]}); one object per line") from exc
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a line must be a JSON object with prompt and answer")
    return task_of_row(where, task_id, row)


def task_of_row(
    where: str,
    task_id: int,
    row: Mapping[str, Any],
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    verifier_key: str = "verifier",
    target_key: str = "target_len",
    default_verifier: str = "exact",
) -> Task:
    """One row (a JSONL line, a ``datasets`` row) as a task; ``ConfigError`` naming ``where``
    and the column when a value is not what a task needs."""
    prompt, answer = row.get(prompt_key), row.get(answer_key)
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f'{where}: "{prompt_key}" must be a non-empty string')
    if not isinstance(answer, str | int | float) or isinstance(answer, bool) or answer == "":
        raise ConfigError(f'{where}: "{answer_key}" must be a non-empty string (or a number)')
    verifier = row.get(verifier_key) or default_verifier
    if verifier not in VERIFIERS:
        raise ConfigError(f"{where}: verifier {verifier!r} is not one of {', '.join(VERIFIERS)}")
    target = row.get(target_key)
    if target is not None and (
        not isinstance(target, int) or isinstance(target, bool) or target <= 0
    ):
        raise ConfigError(f'{where}: "{target_key}" must be a positive integer')
    return Task(task_id, "data", 0, prompt, str(answer), target, verifier)


def load_dataset(path: str | Path) -> TaskDataset:
    """The tasks of a JSONL data set; :class:`ConfigError` naming ``file:line`` if malformed."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_DATASET_BYTES:
            raise ConfigError(f"data set {p} exceeds {MAX_DATASET_BYTES >> 20} MiB")
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the data set {p}: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"data set {p} is not UTF-8 text (byte {exc.start})") from exc
    tasks: list[Task] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            tasks.append(_parse_line(f"{p}:{number}", len(tasks), line))
    if not tasks:
        raise ConfigError(f"data set {p} holds no tasks; write one JSON object per line")
    return TaskDataset(tuple(tasks), hashlib.sha256(data).hexdigest())
