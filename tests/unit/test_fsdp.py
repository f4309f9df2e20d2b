"""FSDP2 on two gloo ranks makes the same update as one process on the same batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import load_file

from node.compute.groups import Group
from node.compute.grpo import GRPOConfig, GRPOTrainer
from node.model import DEFAULT_MODEL_DIR, load_causal_lm, model_info

CONFIG = {"learning_rate": 1e-3, "max_tokens": 8, "max_grad_norm": 1.0}


def batch() -> list[Group]:
    gen = torch.Generator().manual_seed(7)
    groups = []
    for i in range(5):  # uneven: rank 0 gets 3 groups, rank 1 gets 2
        completions = [
            torch.randint(40, 120, (3 + (i + j) % 4,), generator=gen).tolist() for j in range(4)
        ]
        groups.append(Group([60 + i, 61, 43], completions, [1.0, 0.0, 0.5, float(i % 2)], 0))
    return groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_gloo_ranks_make_the_update_of_one_process(tmp_path: Path) -> None:
    pad_id = model_info(DEFAULT_MODEL_DIR).pad_id
    single = GRPOTrainer(
        load_causal_lm(DEFAULT_MODEL_DIR, dtype="float32"), GRPOConfig(**CONFIG), pad_id=pad_id
    )
    before = {k: v.clone() for k, v in single.model.state_dict().items()}
    single.step(batch())
    expected = single.model.state_dict()

    spec = {
        "model_dir": str(DEFAULT_MODEL_DIR),
        "config": CONFIG,
        "pad_id": pad_id,
        "groups": [g.to_wire() for g in batch()],
        "out": str(tmp_path / "fsdp.safetensors"),
    }
    spec_path = tmp_path / "spec.msgpack"
    spec_path.write_bytes(msgpack.packb(spec, use_bin_type=True))
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "node.compute.fsdp", str(spec_path)],
            env=os.environ
            | {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )
        for r in range(2)
    ]
    assert [p.wait(timeout=240) for p in ranks] == [0, 0]
    got = load_file(str(tmp_path / "fsdp.safetensors"))
    assert set(got) == set(expected)
    moved = max(float((expected[k] - before[k]).abs().max()) for k in expected)
    assert moved > 1e-5  # the step did change the weights
    # Float tolerance: sums in another order; Adam's first step moves every weight by about
    # the learning rate (1e-3), so 1e-5 is a hundredth of a step.
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-5)
