"""Laws the scale simulation (bench/scale_sim.py, bench/scale_model.py) must obey."""

from __future__ import annotations

import importlib.util
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
MIB = 1024 * 1024


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("scale_sim", BENCH / "scale_sim.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sim = _load()


def _quiet(**changes: Any) -> Any:
    """No latency anywhere: times are pure bandwidth."""
    base = sim.SimParams(
        origin_up=10 * MIB,
        node_up=10 * MIB,
        shard_bytes=4 * MIB,
        per_hop_s=0.0,
        lookup_s=0.0,
        have_refresh_s=0.01,
        busy_wake="slot",  # no polling: a busy provider's askers are woken by its free slot
    )
    return replace(base, **changes)


def _times(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("sim_wall_s", "sim_cpu_s")}


@pytest.mark.parametrize(
    ("origin_up", "node_down", "expected"),
    [(10 * MIB, 5 * MIB, 64 / 5), (2 * MIB, 5 * MIB, 64 / 2), (8 * MIB, 8 * MIB, 64 / 8)],
)
def test_one_node_fetches_at_the_slower_of_the_two_links(
    origin_up: float, node_down: float, expected: float
) -> None:
    p = _quiet(origin_up=origin_up, node_down=node_down)
    r = sim.simulate(p, 1, 64 * MIB)
    assert r["shards_p100_s"] == pytest.approx(expected, rel=0.01)
    assert r["origin_share"] == 1.0


def test_origin_only_serves_every_copy_and_the_swarm_beats_it() -> None:
    n = 16
    alone = sim.simulate(_quiet(serve=False, parallel_sources=1), n, 64 * MIB)
    swarm = sim.simulate(_quiet(), n, 64 * MIB)
    # The origin's uplink carries all n copies one after another (slots and rests aside).
    assert alone["shards_p100_s"] == pytest.approx(n * 64 / 10, rel=0.05)
    assert alone["origin_share"] == 1.0
    assert swarm["shards_p95_s"] < 0.5 * alone["shards_p95_s"]
    assert swarm["origin_share"] < 0.5


def test_more_upload_is_never_slower() -> None:
    links = sim.HomeLinks(median_mbit=20, p90_mbit=100)
    faster = sim.HomeLinks(median_mbit=40, p90_mbit=200)
    p = _quiet(origin_up=100 * MIB, neighbors=8)
    slow = sim.simulate(p, 24, 128 * MIB, links, seed=3)
    fast = sim.simulate(p, 24, 128 * MIB, faster, seed=3)
    assert fast["shards_p95_s"] <= slow["shards_p95_s"]
    alone = _quiet(serve=False)
    slow_origin = sim.simulate(alone, 8, 64 * MIB)
    fast_origin = sim.simulate(replace(alone, origin_up=20 * MIB), 8, 64 * MIB)
    assert fast_origin["shards_p95_s"] <= 0.55 * slow_origin["shards_p95_s"]


def test_a_seed_fixes_the_result() -> None:
    p = _quiet(per_hop_s=0.02, neighbors=6)
    links = sim.HomeLinks()
    a = sim.simulate(p, 20, 64 * MIB, links, seed=7)
    b = sim.simulate(p, 20, 64 * MIB, links, seed=7)
    assert _times(a) == _times(b)
    assert a["complete"] == 20
    assert 0 < a["announce_p50_s"] <= a["announce_p95_s"] <= a["announce_p100_s"]
    assert a["shards_p50_s"] <= a["shards_p95_s"] <= a["shards_p100_s"]


def test_shards_are_grouped_into_pieces_only_past_the_transfer_budget() -> None:
    p = _quiet(max_transfers=100)
    r = sim.simulate(p, 10, 64 * MIB)  # 16 shards x 10 nodes = 160 transfers > 100
    assert r["pieces"] == 8 and r["shards_per_piece"] == 2
    assert sim.simulate(_quiet(), 10, 64 * MIB)["pieces"] == 16


def _small(run: dict[str, Any]) -> dict[str, Any]:
    """A synthetic run with its version cut to 16 MiB (as ``bench/scale.py``'s), so that the
    fits, a dozen simulations each, stay quick."""
    served = run["served_bytes_total"] // 4
    return run | {"version_bytes": 16 * MIB, "served_bytes_total": served}


def _run(n: int) -> dict[str, Any]:
    return _small(sim.SYNTHETIC_RUNS["25"]) | {"nodes": n, "synthetic": True}


def test_project_calibrates_on_one_run_and_projects() -> None:
    """bench/scale.py hands ``project`` its largest run as one dict."""
    result = sim.project(
        _run(25),
        sizes=(20,),
        what_if_n=20,
        what_ifs={"k=16 parallel sources": {"parallel_sources": 16}},
        fine_n=None,
        version=64 * MIB,
    )
    assert result["calibrated_on_n"] == 25
    assert isinstance(result["sim_error_at_100"], float)
    row = result["projection"]["20"]
    assert row["shards_p95_s"] >= row["fluid_bound_p95_s"] > 0
    assert 0 < row["origin_share"] <= 1
    assert set(result["what_if"]["runs"]) == {"k=16 parallel sources"}
    json.dumps(result)  # the bench writes it as JSON


def _median(params: Any, n: int, version: int, figure: str) -> float:
    """A figure as the fits and the check take it: the median over ``sim.SEEDS`` seeds."""
    return statistics.median(
        sim.simulate(params, n, version, None, seed)[figure] for seed in range(sim.SEEDS)
    )


def test_calibrate_scales_the_measured_rates_by_one_factor_and_fits_the_announcement_p95() -> None:
    run = _run(25)
    cal = run["calibration"]
    p = sim.calibrate(run)
    factor = p.node_up / (cal["node_serve_mib_s"] * MIB * 4)
    assert p.origin_up == pytest.approx(cal["origin_serve_mib_s"] * MIB * 4 * factor)
    assert p.host_cap == pytest.approx(run["served_bytes_total"] / run["shards_p100_s"] * factor)
    assert p.shard_bytes == cal["shard_bytes"]
    assert _median(p, 25, p.shard_bytes, "announce_p95_s") == pytest.approx(
        run["announce_p95_s"], rel=0.02
    )
    assert p.neighbors == min(sim.MAX_SOURCES, run["connections_per_node"])
    before = sim.calibrate(run, before_fixes=True)
    assert before.upload_slots is None and before.lookup_s == run["lookup_p50_s"]


def test_the_fitted_speed_makes_the_model_copy_as_fast_as_the_run() -> None:
    """The per-pull rates a run measures undercount what its machine moves: at those rates the
    model copies far slower than the run did; with the fitted speed its copy p95 is the run's."""
    run = {
        "nodes": 10,
        "version_bytes": 16 * MIB,
        "served_bytes_total": 10 * 16 * MIB * 1.05,
        "shards_p95_s": 5.0,
        "shards_p100_s": 5.5,
        "announce_p95_s": 0.05,
        "connections_per_node": 11,
        "lookup_p50_s": 0.05,
        "calibration": {
            "node_serve_mib_s": 0.5,
            "origin_serve_mib_s": 2.0,
            "per_hop_gossip_s": 0.01,
            "shard_bytes": 4 * MIB,
            "parallel_sources": 4,
            "gossip_degree": 6,
            "origin_links": 11,
        },
    }
    p = sim.calibrate(run)
    as_measured = sim.faster(p, 0.5 * MIB * 4 / p.node_up)
    assert _median(as_measured, 10, 16 * MIB, "shards_p95_s") > 1.25 * run["shards_p95_s"]
    assert _median(p, 10, 16 * MIB, "shards_p95_s") == pytest.approx(run["shards_p95_s"], rel=0.02)


def test_cli_without_a_run_to_calibrate_on_exits_2(tmp_path: Path) -> None:
    empty = tmp_path / "runs.json"
    empty.write_text(json.dumps({"runs": {}}))
    assert sim.main(["--runs", str(empty)]) == 2


def test_the_held_out_check_fits_on_one_size_and_reports_only_the_others() -> None:
    runs = {k: _small(v) for k, v in sim.SYNTHETIC_RUNS.items()}
    runs["100"]["shards_p95_s"] = float("inf")  # a copy that never reached 95%: not compared
    held = sim.heldout({"runs": runs}, seeds=1)
    assert held["fit_on_n"] == 25 and held["held_out_n"] == [50, 100]
    assert "25" not in held["check"] and held["check"]["100"]["shards_p95_error"] is None
    assert held["error_by_n"]["100"] == held["check"]["100"]["announce_p95_error"]
    errors = [
        e
        for c in held["check"].values()
        for e in (c["announce_p95_error"], c["shards_p95_error"])
        if e is not None
    ]
    assert held["sim_heldout_error"] == max(errors) and len(errors) == 3


def test_the_held_out_check_against_other_runs_compares_every_run_of_them(tmp_path: Path) -> None:
    """Fitted on one file's run, checked on another file's runs, the same N included (another
    swarm of that size, whose p95s the fit never saw); the CLI says what was held out."""
    fitted = {"runs": {"25": _small(sim.SYNTHETIC_RUNS["25"])}}
    other = {"runs": {k: _small(v) for k, v in sim.SYNTHETIC_RUNS.items() if k in ("25", "50")}}
    other["runs"]["25"]["announce_p95_s"] *= 2  # the other run of N = 25 differs
    held = sim.heldout(fitted, against=other)
    assert held["fit_on_n"] == 25 and held["held_out_n"] == [25, 50]
    assert held["held_out"] == "other runs"
    assert held["check"]["25"]["announce_p95_error"] > 0
    (tmp_path / "a.json").write_text(json.dumps(fitted))
    (tmp_path / "b.json").write_text(json.dumps(other))
    out = tmp_path / "held.json"
    args = ["--runs", str(tmp_path / "a.json"), "--heldout-against", str(tmp_path / "b.json")]
    assert sim.main([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["sim_heldout_error"] == held["sim_heldout_error"]
    assert sim.main(["--heldout-against", str(tmp_path / "b.json")]) == 2  # nothing to fit on
