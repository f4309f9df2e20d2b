"""bench/flood.py's accounting: windows of one kind merged into one run (sums, and rates over
the summed time), so interleaved windows compare like two whole runs; and the version file the
flood process reads."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _flood() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_flood", BENCH / "flood.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


flood = _flood()


def window(
    seconds: float, accepted: int, judge: float, newcomer: float, **extra: Any
) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "accepted": float(accepted),
        "disk_growth": 2**20,
        "cpu_s": Counter({"validator": 2.0, "worker-0": 3.0}),
        "bench_process_cpu_s": 0.1,
        "flood_process_cpu_s": extra.get("flood_cpu", 0.0),
        "judge_s": judge,
        "newcomer_judge_s": newcomer,
        "rejected_hard": float(extra.get("hard", 0)),
        "refusals": Counter(extra.get("refusals", {})),
        "worker_wait": Counter(
            {
                "worker_generate_seconds": 8.0,
                "worker_submit_seconds": 2.0,
                "worker_samples": 256.0,
                "worker_submitted": 2.0,
                "worker_accepted": 2.0,
                "worker_dropped_stale": 1.0,
            }
        ),
        "flood_sent": Counter(extra.get("sent", {})),
        "flood_outcomes": Counter(extra.get("outcomes", {})),
    }


def test_windows_of_one_kind_merge_into_sums_and_rates_over_their_time() -> None:
    run = flood._merge(
        [
            window(20.0, 10, 8.0, 2.0, flood_cpu=4.0, hard=3, refusals={"window": 5}),
            window(
                30.0,
                5,
                12.0,
                0.0,
                flood_cpu=6.0,
                refusals={"window": 1, "ban": 2},
                sent={"garbage": 7},
                outcomes={"garbage: shed": 6, "garbage: verdict": 1},
            ),
        ],
        True,
        19,
        700.0,
    )
    samples = flood.SAMPLES
    assert run["windows"] == 2 and run["seconds"] == 50.0 and run["flood_nice"] == 19
    assert run["honest_accepted_samples"] == 15 * samples
    assert run["honest_samples_per_s"] == 15 * samples / 50.0  # over the summed time
    assert run["flood_judge_share"] == 2.0 / 20.0
    assert run["cpu_s"] == {"validator": 4.0, "worker-0": 6.0}
    assert run["flood_process_cpu_s"] == 10.0 and run["rejected_hard"] == 3
    assert run["refusals"] == {"window": 6, "ban": 2}
    assert run["flood_outcomes"] == {"garbage: shed": 6, "garbage: verdict": 1}
    assert (run["worker_generate_s"], run["worker_submit_s"]) == (16.0, 4.0)
    assert run["worker_work"] == {
        "samples": 512,
        "dropped_stale": 2,
        "submitted": 4,
        "accepted": 4,
        "rejected": 0,
    }
    assert run["disk_growth_mib"] == 2.0 and run["validator_peak_rss_mib"] == 700.0


def test_a_quiet_run_has_no_flood_nice_and_no_flood_cost() -> None:
    run = flood._merge([window(10.0, 4, 5.0, 0.0)], False, 19, 600.0)
    assert run["flood_nice"] is None and run["flood_process_cpu_s"] == 0.0
    assert run["flood_judge_share"] == 0.0 and run["flood_sent"] == {}


def test_the_version_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "flood.version"
    flood._write_version(path, {"policy_version": 7})
    assert path.read_text() == "7"
    flood._write_version(path, {"policy_version": 12, "policy_manifest": "ab" * 32})
    assert path.read_text() == "12 " + "ab" * 32 and not path.with_suffix(".tmp").exists()
