"""GRPO with the INTELLECT-2 recipe: advantages, online filter, clipping, window, rollback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from node.compute.grpo import (
    CollapseGuard,
    Group,
    GRPOConfig,
    GRPOTrainer,
    StepStats,
    group_advantages,
)
from swarm.errors import ConfigError

TARGET = 65


def tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def sample_groups(
    trainer: GRPOTrainer, n_groups: int, size: int, gen: torch.Generator
) -> list[Group]:
    """Sample 1-token completions after [1] and reward the target token."""
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([[1]])).logits[0, -1]
    probs = torch.softmax(logits.float(), -1)
    groups = []
    for _ in range(n_groups):
        tokens = torch.multinomial(probs, size, replacement=True, generator=gen).tolist()
        groups.append(
            Group([1], [[t] for t in tokens], [float(t == TARGET) for t in tokens], trainer.version)
        )
    return groups


def target_prob(trainer: GRPOTrainer) -> float:
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([[1]])).logits[0, -1]
    return float(torch.softmax(logits.float(), -1)[TARGET])


def test_group_advantages_are_normalised() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([0.5, 0.5]) == [0.0, 0.0]


def test_groups_without_signal_are_dropped_and_change_nothing() -> None:
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(learning_rate=1e-2, max_tokens=1))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stats = trainer.step(
        [Group([1], [[2], [3]], [1.0, 1.0], 0), Group([1], [[4], [5]], [0.0, 0.0], 0)]
    )
    assert stats.kept_groups == 0 and stats.total_groups == 2 and stats.mean_reward == 0.5
    assert stats.version == 1 and trainer.version == 1
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_grpo_raises_the_probability_of_rewarded_tokens() -> None:
    trainer = GRPOTrainer(
        tiny_model(),
        GRPOConfig(learning_rate=3e-2, max_tokens=1, max_grad_norm=1.0, entropy_coef=0.0),
    )
    gen = torch.Generator().manual_seed(0)
    # Make the target reachable: a few rewarded samples per batch at the start.
    start = target_prob(trainer)
    for _ in range(15):
        groups = sample_groups(trainer, 4, 16, gen)
        groups.append(Group([1], [[TARGET], [7]], [1.0, 0.0], trainer.version))
        trainer.step(groups)
    assert target_prob(trainer) > max(5 * start, 0.2)


def test_stale_samples_use_their_own_versions_weights() -> None:
    trainer = GRPOTrainer(
        tiny_model(), GRPOConfig(learning_rate=1e-2, max_tokens=1), keep_versions=2
    )
    old = Group([1], [[TARGET], [7]], [1.0, 0.0], 0)
    trainer.step([old])
    stats = trainer.step([old])  # version-0 samples, trained at version 1: ratio != 1
    assert stats.kept_groups == 1 and stats.sampled_by == 0
    assert trainer.held_versions == [1, 2]
    with pytest.raises(ConfigError, match="outside the trainer's window"):
        trainer.step([old])


def test_an_undone_step_gives_its_parent_its_whole_window_back() -> None:
    """A round that was void: the step is undone and its samples are trained again, from the
    same version, with the same window (its oldest version is held again)."""
    trainer = GRPOTrainer(
        tiny_model(), GRPOConfig(learning_rate=1e-2, max_tokens=1), keep_versions=2
    )
    old = Group([1], [[TARGET], [7]], [1.0, 0.0], 0)
    trainer.step([old])
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.step([old])
    assert trainer.held_versions == [1, 2]
    trainer.undo(1)
    assert trainer.version == 1 and trainer.held_versions == [0, 1]
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert trainer.step([old]).sampled_by == 0  # v0's samples, from v1, once more


def test_ratio_is_capped_by_delta_for_negative_advantages() -> None:
    """With ratio >> delta and A < 0, the loss gradient vanishes (capped), not explodes."""
    cfg = GRPOConfig(clip_delta=4.0, clip_epsilon=0.2)
    ratio = torch.tensor([10.0], requires_grad=True)
    adv = torch.tensor([-1.0])
    surrogate = torch.minimum(
        torch.clamp(ratio, max=cfg.clip_delta) * adv,
        torch.clamp(ratio, 1 - cfg.clip_epsilon, 1 + cfg.clip_epsilon) * adv,
    )
    (-surrogate).sum().backward()
    assert float(surrogate) == -4.0 and ratio.grad is not None and float(ratio.grad) == 0.0


def test_checkpoint_restores_version_and_weights(tmp_path: Path) -> None:
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(learning_rate=1e-2, max_tokens=1))
    trainer.step([Group([1], [[TARGET], [7]], [1.0, 0.0], 0)])
    trainer.save_checkpoint(tmp_path / "ckpt.pt")
    again = GRPOTrainer(tiny_model(seed=1), GRPOConfig(learning_rate=1e-2, max_tokens=1))
    again.load_checkpoint(tmp_path / "ckpt.pt")
    assert again.version == 1 and again.held_versions == trainer.held_versions
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, again.model.state_dict()[k])


def _stats(version: int, reward: float, kept: int) -> StepStats:
    return StepStats(version, version - 1, reward, kept, 4, 8, 8, 0.0, 0.0, 0.0, 0.0)


def test_collapse_guard_rolls_back_to_the_last_version_that_earned_reward() -> None:
    guard = CollapseGuard(patience=2)
    assert guard.observe(_stats(1, 0.3, 2)) is None
    assert guard.observe(_stats(2, 0.4, 3)) is None
    assert guard.observe(_stats(3, 0.0, 0)) is None
    assert guard.observe(_stats(4, 0.0, 0)) == 1  # samples of version 1 earned 0.4
    assert guard.observe(_stats(5, 1.0, 0)) is None  # solved is not collapsed


def test_rollback_continues_from_old_weights_as_a_new_version() -> None:
    trainer = GRPOTrainer(tiny_model(), GRPOConfig(learning_rate=1e-1, max_tokens=1))
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.step([Group([1], [[TARGET], [7]], [1.0, 0.0], 0)])
    trainer.rollback(0)
    assert trainer.version == 2
    assert all(torch.equal(start[k], v) for k, v in trainer.model.state_dict().items())
    # The restarted optimizer keeps the recipe (no weight decay; AdamW's default is 0.01).
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.0]
