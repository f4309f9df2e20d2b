"""Deterministic steps: the training child commits to its state before and after each step, and
a replay child in another process, given the state before and the same samples, gives the same
bits; a rogue step (another learning rate, perturbed published weights) does not replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from node.compute.groups import Group
from node.compute.train_child import ReplayChild, TrainerChild
from node.compute.train_state import digest, read_state, update_error
from node.model import DEFAULT_MODEL_DIR, model_info
from swarm.errors import EngineError

CONFIG = {"learning_rate": 1e-3, "max_tokens": 8, "max_grad_norm": 1.0}


def batch(version: int, seed: int) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(3):
        completions = [
            torch.randint(40, 120, (3 + (i + j) % 4,), generator=gen).tolist() for j in range(4)
        ]
        rewards = [1.0, 0.0, 0.5, float(i % 2)]
        # Samples of the current version and of the one before: logp_old replays v - 1.
        groups.append(Group([], completions, rewards, max(0, version - i % 2), text=f"q {i}"))
    return groups


def spec(root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "model_dir": str(DEFAULT_MODEL_DIR),
        "config": CONFIG,
        "keep_versions": 3,
        "pad_id": model_info(DEFAULT_MODEL_DIR).pad_id,
        "checkpoint": str(root / "trainer.ckpt"),
        "policies": str(root / "policies"),
        "states": str(root / "states"),
        "state_keep": 3,
        "threads": 1,
        "group": None,
        "serve_dtype": "bfloat16",
        **extra,
    }


def replay_args(
    root: Path, out: dict[str, Any], groups: list[Group], parent: int, threads: int | None = None
) -> dict[str, Any]:
    st = out["state"]
    old = {g.version for g in groups} - {parent}
    return {
        "model_dir": str(DEFAULT_MODEL_DIR),
        "chat_template": False,
        "config": CONFIG,
        "serve_dtype": "bfloat16",
        "pad_id": model_info(DEFAULT_MODEL_DIR).pad_id,
        "threads": st["threads"] if threads is None else threads,
        "seed": st["seed"],
        "parent": parent,
        "groups": [g.to_wire() for g in groups],
        "state": str(root / "states" / f"s{parent}.safetensors"),
        "old": {str(v): str(root / "policies" / f"v{v}.safetensors") for v in old},
        "published": out["weights"],
        "after": str(root / "states" / f"s{parent + 1}.safetensors"),
    }


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[dict[str, Any]], list[list[Group]]]:
    root = tmp_path_factory.mktemp("trainer")
    child = TrainerChild(spec(root))
    outs, batches = [], []
    try:
        for version in range(3):
            groups = batch(version, seed=version + 3)
            outs.append(child.step(groups, version, seed=1000 + version))
            batches.append(groups)
    finally:
        child.close()
    return root, outs, batches


def test_each_step_commits_to_its_state_before_and_after(trained: Any) -> None:
    root, outs, _ = trained
    for version, out in enumerate(outs):
        st = out["state"]
        assert st["deterministic"] and st["threads"] == 1 and st["seed"] == 1000 + version
        assert st["before"] != st["after"]
        if version:
            assert st["before"] == outs[version - 1]["state"]["after"]
    # Retention: the last three states are kept, each matching its commitment.
    assert sorted(p.name for p in (root / "states").iterdir()) == [
        "s1.safetensors",
        "s2.safetensors",
        "s3.safetensors",
    ]
    assert digest(read_state(root / "states/s3.safetensors")) == outs[2]["state"]["after"]
    state = read_state(root / "states/s3.safetensors")
    assert {k[:2] for k in state} == {"w/", "m/", "v/", "s/"}
    assert state["w/model.embed_tokens.weight"].dtype == torch.float32


def test_a_replay_in_another_process_gives_the_same_bits(trained: Any) -> None:
    root, outs, batches = trained
    replayer = ReplayChild()
    try:
        for parent in (1, 2):  # step 2 replays logp_old of v1 from its published bf16 file
            got = replayer.replay(replay_args(root, outs[parent], batches[parent], parent))
            st = outs[parent]["state"]
            assert got["before"] == st["before"]
            assert got["after"] == st["after"], f"step from v{parent} did not replay"
            assert got["weights"] == st["weights"] == got["published"]
            assert got["update_error"] == 0.0
    finally:
        replayer.close()


def test_another_thread_count_stays_within_the_stated_tolerance(trained: Any) -> None:
    root, outs, batches = trained
    replayer = ReplayChild()
    try:
        got = replayer.replay(replay_args(root, outs[1], batches[1], 1, threads=2))
    finally:
        replayer.close()
    # The honest spread across thread counts (other reduction orders) is far below the
    # tolerance (docs/RELIABILITY.md, "Training audit"); a wrong step is far above it.
    assert got["update_error"] < 1e-3


def test_a_rogue_step_does_not_replay(tmp_path: Path) -> None:
    child = TrainerChild(spec(tmp_path, state_keep=4))
    try:
        honest = child.step(batch(0, seed=3), 0, seed=1)
        rate = child.step(batch(1, seed=4), 1, seed=2, cheat="learning-rate")
        perturbed = child.step(batch(2, seed=5), 2, seed=3, cheat="perturb-weights")
    finally:
        child.close()
    replayer = ReplayChild()
    try:
        ok = replayer.replay(replay_args(tmp_path, honest, batch(0, seed=3), 0))
        assert ok["after"] == honest["state"]["after"]
        got = replayer.replay(replay_args(tmp_path, rate, batch(1, seed=4), 1))
        assert got["before"] == rate["state"]["before"]
        assert got["after"] != rate["state"]["after"]
        assert got["update_error"] > 0.5  # a tenfold rate is nowhere near the replayed step
        got = replayer.replay(replay_args(tmp_path, perturbed, batch(2, seed=5), 2))
        assert got["after"] == perturbed["state"]["after"]  # the state is honest...
        assert got["published"] != got["weights"]  # ...the published weights are not
    finally:
        replayer.close()
    published = load_file(perturbed["weights"])
    assert published  # still a valid file: only a check against the record catches it


def test_a_replay_of_a_state_that_is_not_there_is_a_clear_error(tmp_path: Path) -> None:
    replayer = ReplayChild()
    try:
        args = replay_args(
            tmp_path, {"state": {"threads": 1, "seed": 0}, "weights": None}, batch(0, 1), 0
        )
        with pytest.raises(EngineError, match="cannot read training state"):
            replayer.replay(args)
    finally:
        replayer.close()
    assert (
        update_error({"w/a": torch.ones(2)}, {"w/a": torch.ones(2)}, {"w/a": torch.zeros(2)}) == 0
    )


def test_a_void_round_undone_leaves_the_committed_state_as_it_was(tmp_path: Path) -> None:
    """A group's round is found void after its step (two groups formed, a member's failed
    attempt voided it): the step is undone (``discard``) and run again. The state of the version
    stepped from is the one its record committed to (``state_after``) and an auditor may fetch it
    after the undo: it must not change, and the round run again must start from it (its
    ``state_before``), as if the void step had never been."""
    child = TrainerChild(spec(tmp_path))
    try:
        recorded = child.step(batch(0, seed=3), 0, seed=1)  # v1: published, its record signed
        committed = recorded["state"]["after"]
        assert digest(read_state(tmp_path / "states/s1.safetensors")) == committed
        void = child.step(batch(1, seed=4), 1, seed=2)  # the round to v2, void: undone
        child.discard(1)
        served = digest(read_state(tmp_path / "states/s1.safetensors"))
        assert served == committed, "the undo rewrote the committed state of v1"
        assert not (tmp_path / "states/s2.safetensors").exists()  # no record commits to it
        again = child.step(batch(1, seed=4), 1, seed=2)  # the same round, run again
    finally:
        child.close()
    assert again["state"]["before"] == committed
    assert again["state"]["after"] == void["state"]["after"]  # the void step left no trace
