"""bench/calibrate.py's campaign and bench/sampling.py's measures on tiny counts: the report has
its keys, honest work is never rejected, and the taps leave the real functions in place."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


calibrate = _bench("calibrate")
sampling = _bench("sampling")

KEYS = (
    "honest_samples",
    "honest_rejections",
    "gap_by_pair",
    "tolerated_per_1k_by_pair",
    "toploc_by_pair",
    "chosen_defaults",
    "detection_matching",
    "detection_cross",
    "residual_freedom_per_1k",
)
CHEATS = (
    "swap_runner_up_1pct",
    "swap_runner_up_5pct",
    "swap_runner_up_every_near_tie",
    "other_model_1pct_noise",
    "quantized_int8",
    "wrong_seed",
    "reused_seed",
)


@pytest.fixture(scope="module")
def report() -> dict:
    import node.compute.torch_engine as te
    import node.verify as nv

    sampler, check = te.SeededRows, nv.check_positions
    plan = calibrate.Plan(
        samples=128, batch=8, qwen_samples=0, detect_samples=32, detect_qwen_samples=0
    )
    plan = calibrate.replace(plan, delta_every=1)
    out = calibrate.campaign(plan, calibrate.Defaults(**calibrate.DEFAULTS), log=lambda m: None)
    assert te.SeededRows is sampler and nv.check_positions is check  # taps undone
    return out


def test_campaign_reports_every_key_and_rejects_no_honest_sample(report: dict) -> None:
    for key in KEYS:
        assert key in report, key
    assert report["honest_samples"] == 128
    assert report["honest_rejections"] == 0
    assert set(report["gap_by_pair"]) == set(calibrate.PAIRS)
    assert set(report["chosen_defaults"]) == {
        "tie_tol_fp32",
        "tie_tol_bf16",
        "max_tolerated_per_1k",
    }
    for pair in calibrate.PAIRS:
        assert report["toploc_by_pair"][pair]["exp_mismatches"]["max"] <= 38


def test_campaign_catches_wrong_seeds_and_passes_the_honest_control(report: dict) -> None:
    cheats = report["detection_matching"]["embedded"]
    assert set(CHEATS) <= set(cheats)
    assert cheats["honest"]["rejected"] == 0
    assert cheats["wrong_seed"]["samples"] > 0
    assert cheats["wrong_seed"]["rate"] >= 0.9


def test_nice_ceil_and_poisson_quantile() -> None:
    assert calibrate.nice_ceil(0.01371) == 0.014
    assert calibrate.nice_ceil(0.3) == 0.3
    assert calibrate.nice_ceil(0.786) == 0.79
    assert calibrate.nice_ceil(2.86e-5) == 2.9e-5
    assert calibrate.poisson_quantile(0.0, 1e-6) == 0
    assert calibrate.poisson_quantile(2.0, 1e-6) == 12  # P(X > 12) = 2.1e-7 < 1e-6 < P(X > 11)


def test_sampling_bench_reports_its_three_measures(tmp_path: Path) -> None:
    shape = {**sampling.QWEN2_05B, "hidden": 128, "layers": 1, "heads": 2, "kv_heads": 1}
    shape.update(intermediate=64, model_vocab=2048)
    model = sampling.make_model(tmp_path / "m", shape)
    args = argparse.Namespace(
        model=model, dtype="float32", batch=2, new_tokens=4, repeats=1, noise_rows=4
    )
    out = sampling.run(args)
    assert out["seeded_over_plain"] > 0
    assert out["check_over_prefill"] > 0
    assert set(out["noise_row_ms"]) == {"gumbel2_torch", "gumbel1_numpy"}
