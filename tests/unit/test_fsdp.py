"""A trainer larger than one device: the training child with ``nproc=2`` (FSDP2 on two gloo
ranks) makes the same updates as the one-process child on the same batches, writes the same
files, averages with other trainers, stops whole when a rank dies, and leaves no rank process
behind."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from node.compute.groups import Group
from node.compute.grpo import GRPOConfig, GRPOTrainer
from node.compute.ranks import split
from node.compute.train_child import TrainerChild
from node.model import DEFAULT_MODEL_DIR, load_causal_lm, model_info
from swarm.errors import EngineError

CONFIG = {"learning_rate": 1e-3, "max_tokens": 8, "max_grad_norm": 1.0}


def batch(version: int = 0, seed: int = 7) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(5):  # uneven: rank 0 gets 3 groups, rank 1 gets 2
        completions = [
            torch.randint(40, 120, (3 + (i + j) % 4,), generator=gen).tolist() for j in range(4)
        ]
        rewards = [1.0, 0.0, 0.5, float(i % 2)]
        groups.append(Group([60 + i, 61, 43], completions, rewards, max(0, version - i % 2)))
    return groups


def spec(root: Path, nproc: int) -> dict[str, Any]:
    return {
        "model_dir": str(DEFAULT_MODEL_DIR),
        "config": CONFIG,
        "keep_versions": 3,
        "pad_id": model_info(DEFAULT_MODEL_DIR).pad_id,
        "checkpoint": str(root / "trainer.ckpt"),
        "policies": str(root / "policies"),
        "threads": 1,
        "group": None,
        "nproc": nproc,
    }


def ranks_of(child: TrainerChild) -> list[psutil.Process]:
    assert child.pid is not None
    return [
        p
        for p in psutil.Process(child.pid).children()
        if "node.compute.fsdp" in " ".join(p.cmdline())
    ]


def assert_same_weights(a: str, b: str) -> None:
    # Float tolerance: sums run in another order on two ranks; Adam moves each weight by about
    # the learning rate (1e-3) per step, so 1e-5 is a hundredth of a step.
    got, expected = load_file(a), load_file(b)
    assert list(got) == list(expected)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-5)


def gradients(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    """The (clipped) gradient of the trainer's last step, by state-dict name."""
    params = dict(trainer.model.named_parameters(remove_duplicate=False))
    return {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}


# Where a gradient is below this, Adam's first step, lr * g / (|g| + 1e-8), is a ratio of two
# numbers near the float noise of a sum, so another summation order (other ranks, averaging
# through hivemind) can move that weight by anything up to a step either way.
NOISY_GRADIENT = 1e-6


def assert_one_update_apart(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> None:
    """``got`` is ``expected`` (one Adam step from the same weights) to 1e-5 wherever the
    gradient ``grads`` of that step stands above float noise, and within one step either way
    (2 lr) where it does not; and the weights off by more than 1e-5 are few, so a wrong
    gradient (one half of the batch, say) cannot hide among them."""
    step = 2 * CONFIG["learning_rate"]
    off = total = 0
    for k, v in expected.items():
        diff = (got[k] - v).abs()
        beyond = diff > 1e-5 + 1e-5 * v.abs()
        noisy = grads[k].abs() < NOISY_GRADIENT if k in grads else torch.zeros_like(beyond)
        assert not (beyond & ~noisy).any(), (
            f"{k}: {float(diff[~noisy].max()):.3g} off where the gradient is above float noise"
        )
        assert float(diff.max()) <= step + 1e-5, f"{k}: {float(diff.max()):.3g} off (> one step)"
        off += int(beyond.sum())
        total += v.numel()
    assert off <= total // 1000, f"{off} of {total} weights are off by more than 1e-5"


def test_split_gives_every_rank_a_group_when_any_has_signal() -> None:
    dead = Group([1, 2], [[3], [4]], [1.0, 1.0], 0)
    live = Group([1, 2], [[3], [4]], [1.0, 0.0], 0)
    assert split([dead, dead], 2, 0) == [[], []]
    first, second = split([dead, live], 2, 0)
    assert first == [live]
    assert second[0].completions == [[], []] and second[0].version == 0


@pytest.mark.slow
def test_two_ranks_make_the_updates_of_one_process(tmp_path: Path) -> None:
    one = TrainerChild(spec(tmp_path / "one", 1))
    two = TrainerChild(spec(tmp_path / "two", 2))
    try:
        ranks = ranks_of(two)
        assert len(ranks) == 1
        steps = [batch(0), batch(1, seed=8)]  # the second mixes samples of v0 and v1
        for version, groups in enumerate(steps):
            a, b = one.step(groups, version), two.step(groups, version)
            assert_same_weights(b["weights"], a["weights"])
            for key in ("version", "kept_groups", "samples", "tokens", "sampled_by"):
                assert b["stats"][key] == a["stats"][key]
            for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
                assert b["stats"][key] == pytest.approx(a["stats"][key], rel=1e-4, abs=1e-6)
        # A void round undone, and a published copy adopted, on every rank.
        two.discard(1)
        assert not (tmp_path / "two/policies/v2.safetensors").exists()
        two.load(2, tmp_path / "one/policies/v2.safetensors")
        assert_same_weights(
            str(tmp_path / "two/policies/v2.safetensors"),
            str(tmp_path / "one/policies/v2.safetensors"),
        )
        # A rank that dies stops the group at once, and says which; nothing is trained.
        ranks[0].kill()
        for _ in range(2):
            with pytest.raises(EngineError, match=r"rank group stopped\W+rank 1 exited \(-9\)"):
                two.step(batch(2, seed=9), 2)
    finally:
        one.close()
        two.close()
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, alive

    # The checkpoint has the one-process layout: the two-rank trainer restarts from it (each
    # rank keeps its slice) and steps on as a one-process trainer does from its own.
    for name in ("one", "two"):
        saved = torch.load(tmp_path / name / "trainer.ckpt", weights_only=True)
        assert saved["version"] == 2 and sorted(saved["snapshots"]) == [0, 1, 2]
    ckpt_one = torch.load(tmp_path / "one/trainer.ckpt", weights_only=True)
    ckpt_two = torch.load(tmp_path / "two/trainer.ckpt", weights_only=True)
    for i, state in ckpt_one["optimizer"]["state"].items():
        for k, v in state.items():
            torch.testing.assert_close(ckpt_two["optimizer"]["state"][i][k], v, atol=1e-5, rtol=0)
    again = TrainerChild(spec(tmp_path / "two", 2))
    reference = GRPOTrainer(
        load_causal_lm(DEFAULT_MODEL_DIR, dtype="float32"),
        GRPOConfig(**CONFIG),
        keep_versions=3,
        pad_id=model_info(DEFAULT_MODEL_DIR).pad_id,
    )
    reference.load_checkpoint(tmp_path / "one/trainer.ckpt")
    try:
        assert again.version == 2
        third = batch(2, seed=9)
        reference.step(third)
        save_file(reference.weights(), str(tmp_path / "reference.safetensors"))
        assert_same_weights(
            again.step(third, 2)["weights"], str(tmp_path / "reference.safetensors")
        )
    finally:
        again.close()


@pytest.mark.slow
def test_a_two_rank_trainer_averages_with_a_one_process_trainer(tmp_path: Path) -> None:
    """Through hivemind: rank 0 averages the full gradient, so trainers with different
    ``nproc`` make together the update of one process on the union of their samples."""
    reference = GRPOTrainer(
        load_causal_lm(DEFAULT_MODEL_DIR, dtype="float32"),
        GRPOConfig(**CONFIG),
        pad_id=model_info(DEFAULT_MODEL_DIR).pad_id,
    )
    reference.step(batch())
    expected, grads = reference.weights(), gradients(reference)

    def member(peer: str, nproc: int) -> TrainerChild:
        group = {"peer": peer, "run_id": "nproc", "host": "127.0.0.1", "trainers": 2}
        return TrainerChild(spec(tmp_path / peer, nproc) | {"group": group})

    a, b = member("A", 2), member("B", 1)
    try:
        b.connect(a.hivemind_addrs)
        groups = batch()
        halves = {"A": (a, groups[:3]), "B": (b, groups[3:])}
        out: dict[str, dict[str, Any]] = {}

        def step(name: str) -> None:
            child, mine = halves[name]
            out[name] = child.step(mine, 0)

        threads = [threading.Thread(target=step, args=(n,)) for n in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert "round" in out["A"], out
        assert out["A"]["round"]["members"] == ["A", "B"] == out["B"]["round"]["members"]
        assert out["A"]["round"]["group_samples"] == 20
        for name in halves:
            assert_one_update_apart(load_file(out[name]["weights"]), expected, grads)
    finally:
        a.close()
        b.close()


def test_a_rank_that_fails_to_start_is_named_at_once() -> None:
    from node.compute.ranks import RankGroup

    broken = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.buffer.read(4); sys.exit(3)"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    with pytest.raises(EngineError, match=r"rank group stopped: rank 1 exited \(3\)"):
        RankGroup(spec(Path("/nonexistent"), 2), [broken])
    assert broken.poll() == 3
