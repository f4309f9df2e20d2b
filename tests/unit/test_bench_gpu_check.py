"""bench/gpu_check.py (issue 24's GPU figures) keeps working: its forged-claim control changes one
token to a non-stop id, and its smoke run (tiny models on the CPU; on CUDA where there is one)
writes the figures' keys and rejects no honest sample."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu_check", ROOT / "bench/gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _gpu_check()

KEYS = (
    "seeded_over_plain",
    "verify_over_generate",
    "false_positives_device",
    "false_positives_cpu",
    "false_positives",
    "false_positive_checks",
    "forged_rejected",
)


def test_a_forged_claim_differs_in_its_middle_token_only_and_never_by_a_stop_id() -> None:
    claim = gpu_check.SampleClaim([1, 2], [5, 6, 7, 8, 2], 3, 0, "stop", [b"p"])
    short = gpu_check.SampleClaim([1], [2], 3, 1, "stop", [])
    (forged,) = gpu_check.forge([claim, short], frozenset({2, 8}), vocab=9)
    assert forged.tokens == [5, 6, 0, 8, 2]  # 7 -> 8 is a stop id, 0 (wrapped) is not
    assert (forged.prompt, forged.seed, forged.proofs) == (claim.prompt, 3, [b"p"])


def _smoke(tmp_path: Path, device: str) -> dict[str, Any]:
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(ROOT / "bench/gpu_check.py"), "--small", "--device", device]
    cmd += ["--fp-samples", "16", "--json", str(out), "--work", str(tmp_path / "models")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.slow
def test_the_cpu_smoke_run_writes_every_figure_and_rejects_no_honest_sample(
    tmp_path: Path,
) -> None:
    result = _smoke(tmp_path, "cpu")
    assert all(k in result for k in KEYS)
    assert result["false_positives"] == 0 and result["smoke"] is True
    assert result["forged_rejected"] == result["forged"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_smoke_run_rejects_no_honest_sample(tmp_path: Path) -> None:
    result = _smoke(tmp_path, "cuda")
    assert result["dtype"] == "bfloat16" and result["false_positives"] == 0


def test_the_bench_checks_under_the_genesis_defaults() -> None:
    """The bench copies the defaults (it runs where msgpack may be missing); keep them equal."""
    from swarm.messages import RunParams

    p = RunParams()
    assert {"float32": p.tie_tol_fp32, "bfloat16": p.tie_tol_bf16} == gpu_check.TIE_TOLERANCE
    assert p.max_tolerated_per_1k == gpu_check.MAX_TOLERATED_PER_1K
