"""GRPO data without torch: a group (what the trainer's queue stores and what crosses the pipe
to the training child), a step's statistics, and the collapse watch the node process runs."""

from __future__ import annotations

import contextlib
import math
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import SwarmError


class RoundFailed(SwarmError):
    """An averaging round between trainers did not complete (a peer died, timed out, or the
    members were at different versions); nothing was applied."""


@dataclass(frozen=True)
class Group:
    """G completions of one prompt, their rewards, and the policy version that sampled them.

    ``prompt`` holds the prompt's token ids; a trainer's node process, which has no tokenizer,
    leaves it empty and gives the prompt's ``text``, which the training child tokenizes."""

    prompt: list[int]
    completions: list[list[int]]
    rewards: list[float]
    version: int
    text: str = ""

    @property
    def signal(self) -> bool:
        """Whether GRPO learns from the group: two or more rewards, not all equal (the
        advantages of equal rewards are all 0)."""
        return len(self.rewards) > 1 and max(self.rewards) != min(self.rewards)

    def to_wire(self) -> list[Any]:
        wire: list[Any] = [self.prompt, self.completions, self.rewards, self.version]
        return [*wire, self.text] if self.text else wire

    @classmethod
    def from_wire(cls, obj: Any) -> Group:
        prompt, completions, rewards, version, *text = obj
        return cls(
            [int(t) for t in prompt],
            [[int(t) for t in c] for c in completions],
            [float(r) for r in rewards],
            int(version),
            str(text[0]) if text else "",
        )


@dataclass(frozen=True)
class StepStats:
    version: int
    """The version this step produced."""
    sampled_by: int
    """The newest policy version among the step's samples."""
    mean_reward: float
    kept_groups: int
    total_groups: int
    samples: int
    tokens: int
    loss: float
    grad_norm: float
    clip_fraction: float
    entropy: float

    @property
    def kept_fraction(self) -> float:
        return self.kept_groups / self.total_groups if self.total_groups else 0.0


class CollapseGuard:
    """Watches for the collapse the design describes: reward falls to zero, every group has zero
    advantage, and no signal is left. After ``patience`` such steps in a row, ``observe`` answers
    the version to roll back to: the newest one whose own samples still earned reward."""

    def __init__(self, patience: int = 3) -> None:
        self.patience = patience
        self.last_good: int | None = None
        self._dead_steps = 0

    def observe(self, stats: StepStats) -> int | None:
        dead = stats.kept_groups == 0 and stats.mean_reward == 0.0
        if not dead:
            self._dead_steps = 0
            if stats.mean_reward > 0:
                self.last_good = stats.sampled_by
            return None
        self._dead_steps += 1
        if self._dead_steps >= self.patience and self.last_good is not None:
            self._dead_steps = 0
            return self.last_good
        return None


def remove_stale_sockets(pattern: str = "hivemind-*.sock", folder: Path = Path("/tmp")) -> int:
    """hivemind puts its unix sockets at fixed paths under /tmp and leaves them when its
    processes are killed. Remove those that nothing listens on any more (a live one answers a
    connect, so another trainer's sockets are never touched); returns how many."""
    removed = 0
    for path in folder.glob(pattern):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
            except ConnectionRefusedError:
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
            except OSError:
                continue
    return removed


def publisher_of(infos: list[dict[str, Any]]) -> str:
    """The member that joined the group first (then the smallest peer id): every member
    computes the same from the gathered infos."""
    first = min(infos, key=lambda i: (float(i.get("joined", math.inf)), str(i["peer"])))
    return str(first["peer"])
