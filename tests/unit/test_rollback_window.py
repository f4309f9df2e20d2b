"""A collapse rollback whose good version already left the window continues from the nearest
version still held (found by the netns test: the trainer exited with "version 10 is no longer
held; holds [14, 15, 16]" after a collapse, and training stopped for good)."""

from __future__ import annotations

import torch

from node.compute.grpo import Group, GRPOConfig, GRPOTrainer
from tests.unit.test_grpo import TARGET, tiny_model


def test_rollback_to_a_pruned_version_uses_the_oldest_version_held() -> None:
    trainer = GRPOTrainer(
        tiny_model(), GRPOConfig(learning_rate=1e-1, max_tokens=1), keep_versions=2
    )
    for _ in range(4):
        trainer.step([Group([1], [[TARGET], [7]], [1.0, 0.0], trainer.version)])
    held = {k: v.clone() for k, v in trainer._snapshots[3].items()}
    assert sorted(trainer._snapshots) == [3, 4]
    used = trainer.rollback(1)  # v1 left the window two steps ago
    assert used == 3 and trainer.version == 5
    assert all(torch.equal(held[k], v) for k, v in trainer.model.state_dict().items())
