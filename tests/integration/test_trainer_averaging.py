"""Two training children average through hivemind: each steps on its half of a batch, and both
end with the update one process makes on the whole batch (sample-weighted, float tolerance)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from node.compute.grpo import GRPOConfig, GRPOTrainer
from node.compute.train_child import TrainerChild
from node.model import DEFAULT_MODEL_DIR, load_causal_lm, model_info
from tests.unit.test_fsdp import CONFIG, assert_one_update_apart, batch, gradients


def spec(root: Path, peer: str) -> dict[str, Any]:
    return {
        "model_dir": str(DEFAULT_MODEL_DIR),
        "config": CONFIG,
        "keep_versions": 3,
        "pad_id": model_info(DEFAULT_MODEL_DIR).pad_id,
        "checkpoint": str(root / peer / "trainer.ckpt"),
        "policies": str(root / peer / "policies"),
        "threads": 1,
        "group": {"peer": peer, "run_id": "test", "host": "127.0.0.1", "trainers": 2},
    }


@pytest.mark.slow
def test_two_children_averaging_make_the_update_of_one_process(tmp_path: Path) -> None:
    single = GRPOTrainer(
        load_causal_lm(DEFAULT_MODEL_DIR, dtype="float32"),
        GRPOConfig(**CONFIG),
        pad_id=model_info(DEFAULT_MODEL_DIR).pad_id,
    )
    single.step(batch())
    expected, grads = single.weights(), gradients(single)

    a = TrainerChild(spec(tmp_path, "A"))
    b = TrainerChild(spec(tmp_path, "B"))
    try:
        b.connect(a.hivemind_addrs)
        assert set(a.live()) == {"A", "B"} or set(b.live()) == {"A", "B"}
        groups = batch()
        halves = {"A": (a, groups[:3]), "B": (b, groups[3:])}  # 12 and 8 samples
        out: dict[str, dict[str, Any]] = {}

        def step(name: str) -> None:
            child, mine = halves[name]
            out[name] = child.step(mine, 0)

        threads = [threading.Thread(target=step, args=(n,)) for n in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert out["A"]["round"]["members"] == ["A", "B"] == out["B"]["round"]["members"]
        assert out["A"]["round"]["group_samples"] == 20 and out["A"]["round"]["publisher"] == "A"
        for name in halves:
            assert_one_update_apart(load_file(out[name]["weights"]), expected, grads)
        assert a.status()["rounds_averaged"] == 1 and b.status()["samples_contributed"] == 8
    finally:
        a.close()
        b.close()
