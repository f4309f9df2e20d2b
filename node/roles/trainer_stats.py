"""What a trainer reports: its steps, rewards by version, time idle and busy, and (several
trainers) its group's figures. Plain data for ``status`` and ``swarm-node up``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from node.compute.groups import StepStats


@dataclass
class GroupStatus:
    """What ``status`` shows of a trainer in a group."""

    peers: list[str] = field(default_factory=list)
    rounds_averaged: int = 0
    rounds_failed: int = 0
    rounds_void: int = 0
    samples_contributed: int = 0
    publisher: str | None = None
    published_here: int = 0
    takeovers: int = 0
    lost_versions: int = 0
    averaging_seconds: float = 0.0
    bytes_averaged: int = 0


@dataclass
class TrainerStats:
    steps: list[StepStats] = field(default_factory=list)
    reward_sum: dict[int, float] = field(default_factory=dict)
    reward_count: dict[int, int] = field(default_factory=dict)
    idle_seconds: float = 0.0
    busy_seconds: float = 0.0
    queued: int = 0
    too_old: int = 0
    """Accepted work that arrived after it left the async window (taken and dropped)."""
    rollbacks: int = 0
    started: float = field(default_factory=time.monotonic)
    published_at: dict[int, float] = field(default_factory=dict)
    """Seconds after the trainer started at which each version was announced."""
    group: GroupStatus | None = None

    def add_rewards(self, version: int, rewards: list[float]) -> None:
        self.reward_sum[version] = self.reward_sum.get(version, 0.0) + sum(rewards)
        self.reward_count[version] = self.reward_count.get(version, 0) + len(rewards)
        self.queued += 1

    def reward_by_version(self) -> dict[int, float]:
        return {v: self.reward_sum[v] / self.reward_count[v] for v in sorted(self.reward_sum)}
