"""Real math tasks from a local JSONL file, answers checked by ``math-verify`` (extra ``math``).

Each line is an object with ``"prompt"`` (or ``"question"``/``"problem"``) and ``"answer"``
(or ``"solution"``), optionally ``"target_len"``. Nothing is downloaded. The checker imports
``math_verify`` lazily; without the extra, loading raises :class:`ConfigError` saying what to
install.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.tasks.suite import Task
from swarm.errors import ConfigError


def _math_verify_checker(gold: str) -> Callable[[str], float]:
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ConfigError(
            "math tasks need the optional extra: pip install 'swarm-node[math]'"
        ) from exc
    gold_parsed = parse(gold)

    def check(completion: str) -> float:
        try:
            return 1.0 if verify(gold_parsed, parse(completion)) else 0.0
        except Exception:  # math-verify raises on unparsable model output: no reward
            return 0.0

    return check


def load_math_jsonl(path: str | Path, *, limit: int | None = None) -> list[Task]:
    """Tasks from a JSONL file of math problems; ids are line numbers (0-based)."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read math tasks from {p}: {exc}") from exc
    tasks: list[Task] = []
    for number, line in enumerate(lines):
        if limit is not None and len(tasks) >= limit:
            break
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
            prompt = str(row.get("prompt") or row.get("question") or row["problem"])
            answer = str(row.get("answer") or row["solution"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{p}:{number + 1}: not a math task line ({exc})") from exc
        target = row.get("target_len")
        tasks.append(
            Task(
                number,
                "math",
                0,
                prompt,
                answer,
                int(target) if target is not None else None,
                _math_verify_checker(answer),
            )
        )
    return tasks
