"""bench/scale.py's accounting: percentiles of reach, the origin's share, the ratios."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _scale() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_scale", BENCH / "scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scale = _scale()


def test_reach_is_the_time_the_share_of_all_nodes_got_there() -> None:
    times = [i / 10 for i in range(1, 21)]  # 20 of 25 nodes arrived
    assert scale.reach(times, 20, 50) == 1.0
    assert scale.reach(times, 20, 95) == 1.9
    assert scale.reach(times, 20, 100) == 2.0
    assert scale.reach(times, 25, 50) == 1.3  # the 13th of 25
    assert math.isinf(scale.reach(times, 25, 95))  # 24 needed, 20 arrived
    assert math.isinf(scale.reach([], 5, 50))


def test_percentile_is_by_nearest_rank() -> None:
    assert scale.pct([3.0, 1.0, 2.0], 50) == 2.0
    assert scale.pct([1.0, 2.0, 3.0, 4.0], 95) == 4.0
    assert math.isnan(scale.pct([], 50))


def test_origin_share_counts_every_holder_and_the_origin() -> None:
    assert scale.origin_share(10, [10, 30, 60]) == 0.1
    assert math.isnan(scale.origin_share(0, [0, 0]))


def test_figures_and_calibration_carry_the_keys_the_simulation_reads() -> None:
    run = scale.figures(
        4,
        announced=[0.1, 0.2, 0.3, 0.4],
        fetched=[1.0, 2.0, 3.0, 4.0],
        single_s=0.5,
        origin_served=64,
        served=[64, 64, 64, 64, 0],
        lookups_ms=[10.0, 20.0, 30.0],
        connections=[3, 4, 5, 4],
        version_bytes=64,
    )
    assert run["announce_p95_s"] == 0.4 and run["shards_p50_s"] == 2.0
    assert run["shards_p95_over_single"] == 8.0
    assert run["origin_share"] == 0.25 and run["lookup_p50_s"] == 0.02
    assert run["connections_per_node"] == 4.0 and run["connections_per_node_max"] == 5
    cal = scale.calibration(run, {"origin": [100.0], "peers": [40.0, 60.0]}, 4 << 20)
    assert cal["node_serve_mib_s"] == 50.0 and cal["origin_serve_mib_s"] == 100.0
    assert set(cal) == {
        "node_serve_mib_s",
        "origin_serve_mib_s",
        "per_hop_gossip_s",
        "max_conns_per_node",
        "shard_bytes",
        "parallel_sources",
        "gossip_degree",
        "origin_links",
    }
