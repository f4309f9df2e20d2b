"""bench/scale.py's figures: percentiles of reach, the origin's share, the calibration for
``bench/scale_sim.py``, the table and the projection (pure: tested in
tests/unit/test_bench_scale.py)."""

from __future__ import annotations

import math
import statistics
from typing import Any

MIB = 1024 * 1024
GOSSIP_DEGREE = 6  # swarm.net.overlay.OverlayConfig.gossip_degree[0]
PARALLEL_SOURCES = 4  # FetchConfig.concurrency (pulls at once, at most per_peer = 2 per peer)


def pct(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank; ``nan`` for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def reach(times: list[float], n: int, q: float) -> float:
    """Seconds until ``q`` % of ``n`` nodes got there (``times`` are those that did, relative
    to the start); ``inf`` when fewer than that many did."""
    need = max(1, math.ceil(q / 100 * n))
    ordered = sorted(times)
    return ordered[need - 1] if len(ordered) >= need else math.inf


def origin_share(origin_served: int, served: list[int]) -> float:
    """The publisher's share of all bytes served (``served`` includes the publisher's)."""
    total = sum(served)
    return origin_served / total if total else float("nan")


def figures(
    n: int,
    *,
    announced: list[float],
    fetched: list[float],
    single_s: float,
    origin_served: int,
    served: list[int],
    lookups_ms: list[float],
    connections: list[int],
    version_bytes: int,
) -> dict[str, Any]:
    shards_p95 = reach(fetched, n, 95)
    return {
        "nodes": n,
        "announce_p50_s": reach(announced, n, 50),
        "announce_p95_s": reach(announced, n, 95),
        "announce_p100_s": reach(announced, n, 100),
        "announce_missing": n - len(announced),
        "shards_p50_s": reach(fetched, n, 50),
        "shards_p95_s": shards_p95,
        "shards_p100_s": reach(fetched, n, 100),
        "shards_missing": n - len(fetched),
        "single_transfer_s": single_s,
        "shards_p95_over_single": shards_p95 / single_s if single_s > 0 else math.inf,
        "origin_share": origin_share(origin_served, served),
        "origin_served_bytes": origin_served,
        "served_bytes_total": sum(served),
        "lookup_p50_s": pct(lookups_ms, 50) / 1000,
        "lookup_p95_s": pct(lookups_ms, 95) / 1000,
        "connections_per_node": statistics.fmean(connections) if connections else 0.0,
        "connections_per_node_max": max(connections, default=0),
        "connections_max": max(connections, default=0),
        "version_bytes": version_bytes,
    }


def calibration(
    run: dict[str, Any], rates: dict[str, list[float]], shard_bytes: int
) -> dict[str, Any]:
    """What ``bench/scale_sim.py`` calibrates from (rates are per pull, as receivers saw them).

    ``per_hop_gossip_s`` is derived, not observed: the median announcement time over the
    expected number of hops. The publisher floods its announcement to the ``origin_links``
    nodes it is connected to (``SwarmGossipSub``): one hop for the median node when
    that is half of them or more, else one hop and log(N / links) / log(gossip degree) more."""
    n, links = run["nodes"], max(1, int(run.get("publisher_connections") or GOSSIP_DEGREE))
    hops = 1.0 if links >= n / 2 else 1.0 + math.log(n / links) / math.log(GOSSIP_DEGREE)
    return {
        "node_serve_mib_s": statistics.median(rates["peers"]) if rates["peers"] else None,
        "origin_serve_mib_s": statistics.median(rates["origin"]) if rates["origin"] else None,
        "per_hop_gossip_s": run["announce_p50_s"] / hops,
        "max_conns_per_node": run["connections_per_node_max"],
        "shard_bytes": shard_bytes,
        "parallel_sources": PARALLEL_SOURCES,
        "gossip_degree": GOSSIP_DEGREE,
        "origin_links": run.get("publisher_connections"),
    }


def render(runs: dict[str, dict[str, Any]]) -> None:
    """The table of every N (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench/scale.py (127.0.0.1)")
    table.add_column("figure")
    for n in runs:
        table.add_column(f"N={n}", justify="right")
    rows = [
        (
            "announce p50/p95/p100 s",
            lambda r: (
                f"{r['announce_p50_s']:.2f} / {r['announce_p95_s']:.2f}"
                f" / {r['announce_p100_s']:.2f}"
            ),
        ),
        (
            "shards p50/p95/p100 s",
            lambda r: (
                f"{r['shards_p50_s']:.1f} / {r['shards_p95_s']:.1f} / {r['shards_p100_s']:.1f}"
            ),
        ),
        ("single transfer s", lambda r: f"{r['single_transfer_s']:.2f}"),
        ("shards p95 / single", lambda r: f"{r['shards_p95_over_single']:.1f}"),
        ("origin share", lambda r: f"{r['origin_share']:.1%}"),
        (
            "origin: manifests / busy / elsewhere",
            lambda r: (
                f"{r.get('origin_manifests', '-')} / {r.get('origin_busy_refusals', '-')}"
                f" / {r.get('origin_elsewhere_refusals', '-')}"
            ),
        ),
        (
            "shards over streams / channel",
            lambda r: f"{r.get('stream_shards', '-')} / {r.get('channel_shards', '-')}",
        ),
        ("fetch retries", lambda r: str(r.get("fetch_retries", "-"))),
        ("role lookup p50 s", lambda r: f"{r['lookup_p50_s']:.3f}"),
        ("RSS MiB / node", lambda r: f"{r['rss_mib_per_node']:.0f}"),
        ("CPU s / node", lambda r: f"{r['cpu_s_per_node']:.1f}"),
        ("idle CPU % / node", lambda r: f"{r['idle_cpu_pct_per_node']:.1f}"),
        (
            "connections / node (max)",
            lambda r: f"{r['connections_per_node']:.1f} ({r['connections_per_node_max']})",
        ),
        ("nodes per process", lambda r: str(r["nodes_per_process"])),
        ("wall s", lambda r: f"{r['wall_s']:.0f}"),
    ]
    for name, cell in rows:
        table.add_row(name, *(cell(r) for r in runs.values()))
    Console().print(table)


def project(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``bench/scale_sim.py``'s projection from the largest run, when that module is there."""
    if not runs:
        return {"sim_error_at_100": None, "sim_heldout_error": None, "projection": {}}
    try:
        import scale_sim  # type: ignore[import-not-found]
    except ImportError:
        note = "bench/scale_sim.py not found"
        return {"sim_error_at_100": None, "sim_heldout_error": None, "projection": {"note": note}}
    largest = runs[str(max(int(k) for k in runs))]
    cal = largest.get("calibration") or {}
    missing = [k for k in ("node_serve_mib_s", "origin_serve_mib_s") if not cal.get(k)]
    if missing:  # no copy finished from a peer (or the origin): nothing to calibrate on
        note = f"N={largest['nodes']}: no {', '.join(missing)} measured; no projection"
        return {"sim_error_at_100": None, "sim_heldout_error": None, "projection": {"note": note}}
    out: dict[str, Any] = scale_sim.project(largest)
    return out
