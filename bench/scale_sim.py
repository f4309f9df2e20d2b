"""The scale projection: SHARDCAST and gossip from 100 measured nodes to 10,000 contributors.

    .venv/bin/python bench/scale_sim.py [--runs PATH.json] [--json OUT] [--quick]

``--runs`` is the JSON of ``bench/scale.py`` (``{"runs": {"25": {...}, ...}}``); without it
synthetic figures (``SYNTHETIC_RUNS``) stand in and the output says so. The model is
``bench/scale_model.py`` (a SimPy simulation of our fetch scheduler, serving limits and gossip;
its docstring lists what it copies and what it simplifies). Decisions owned here:

- held out: ``heldout`` calibrates on the smallest run and checks every other size
  (``sim_heldout_error``: the largest error of announcement p95 and copy p95 there);
  ``--heldout-against OTHER.json`` checks it on the runs of another file instead (another run
  of the same size counts);
- calibration: ``calibrate`` takes the run's own figures (per-pull serving rates of nodes and
  origin, shard size, parallel sources, gossip degree, connections per node) and fits two by
  simulation: one speed factor on the host's, nodes' and origin's rates (``fit_speed``), until
  the model's copy p95 is the run's, and the per-hop gossip latency (``fit_hop``), until its
  announcement p95 is the run's. Both are fitted on the p95s the check compares, so the
  fitted run says nothing; only held-out runs do. Every simulated figure, in a fit or a
  check, is the median of ``SEEDS`` (3) seeds;
- projection: the calibrated implementation limits with contributors at home (``HOME``: upload
  lognormal, median 20 Mbit/s, 10% at >= 100 Mbit/s, capped at 1 Gbit/s; download 5x upload
  within 100-1,000 Mbit/s; an assumption in the range of consumer cable/DSL with a fibre tail,
  not a measured distribution), the origin in a data centre at 10 Gbit/s, 50 ms more per
  gossip hop (WAN), 32 MiB shards of a 62 GB checkpoint; seed 0;
- the yardstick: INTELLECT-2's reported ~14 minutes for a 62 GB broadcast (second-hand, their
  relay tier and contributors' links unknown to us), and a fluid lower bound (copies over the
  sum of uplinks; a whole version through the 95th-percentile downlink);
- what-ifs (at 1,000 contributors): more parallel sources, more origin slots, a relay tier,
  symmetric 1 Gbit/s contributors, and all of them together.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is a folder of scripts
from scale_model import (
    GB,
    MBIT,
    MIB,
    HomeLinks,
    SimParams,
    Simulation,
    simulate,
)

__all__ = ["HomeLinks", "SimParams", "Simulation", "calibrate", "project", "simulate"]

INTELLECT2_S = 14 * 60
"""INTELLECT-2's reported broadcast of a 62 GB checkpoint: about 14 minutes (second-hand)."""
CHECKPOINT_BYTES = 62 * GB


# --- calibration and projection ---------------------------------------------------------------
WAN_HOP_S = 0.05
"""One-way latency added to each gossip hop between homes (a continent's RTT is ~100 ms)."""
ORIGIN_MBIT = 10_000.0
"""The origin (trainer) in a data centre: 10 Gbit/s upload (assumption)."""
HOME = HomeLinks()
MAX_NEIGHBORS = 256
"""``HostLimits.max_connections``: a node's provider set cannot outgrow its connections."""

SYNTHETIC_RUNS: dict[str, Any] = {
    str(n): {
        "synthetic": True,
        "announce_p50_s": 0.05 * n**0.3,
        "announce_p95_s": 0.09 * n**0.3,
        "announce_p100_s": 0.12 * n**0.3,
        "shards_p50_s": 1.0 + 0.05 * n,
        "shards_p95_s": 1.5 + 0.07 * n,
        "shards_p100_s": 2.0 + 0.08 * n,
        "single_transfer_s": 1.2,
        "served_bytes_total": int(n * 64 * MIB * 1.05),
        "shards_p95_over_single": (1.5 + 0.07 * n) / 1.2,
        "origin_share": 0.1,
        "lookup_p50_s": 0.05,
        "rss_mib_per_node": 80.0,
        "cpu_s_per_node": 1.0,
        "connections_per_node": min(n + 1, 30),
        "version_bytes": 64 * MIB,
        "nodes_per_process": 5,
        "calibration": {
            "node_serve_mib_s": 32.0,
            "origin_serve_mib_s": 64.0,
            "per_hop_gossip_s": 0.03,
            "max_conns_per_node": 64,
            "shard_bytes": 4 * MIB,
            "parallel_sources": 4,
            "gossip_degree": 6,
        },
    }
    for n in (25, 50, 100)
}
"""Stand-in figures (made up, plausible) for when no run of ``bench/scale.py`` is at hand."""


UPLOAD_SLOTS = 4
"""``node.shardcast.UPLOAD_SLOTS``."""
MAX_SOURCES = 8
"""``node.shardcast.MAX_SOURCES``."""
MAX_CONNECTIONS = 256
"""``swarm.net.host.HostLimits.max_connections``: the most subscribers a flood-publishing
origin reaches directly (the rest hear it from the mesh)."""


SEEDS = 3
"""Seeds per simulated figure in a fit and a check: each figure is their median (one seed's
announcement p95 at N = 25 is one of 25 arrivals: 0.08 to 0.14 s over five seeds of one fit)."""
SPEED_FIT_ON = "shards_p95_s"
"""The copy figure ``fit_speed`` makes the model reproduce: the p95, the one the issue checks.
Fitted on it, the other run's copy p95 came out 0.16 and 0.18 off at N = 25 (a on b, b on a)
and 0.05 and 0.05 at N = 50; fitted on the p100, 0.06, 0.23, 0.07 and 0.02. The p100s of two
runs agree better (5.9 and 5.8 s at N = 25, where the p95s are 4.7 and 5.5 s), but the model's
copies finish together (p95 0.98 of p100) where run a's did not (0.79), so a fit on the p100
carries that gap into the p95; on the p95 the largest error, the one ``sim_heldout_error``
takes, is the smaller."""
HOP_FIT_ON = "announce_p95_s"
"""The announcement figure ``fit_hop`` makes the model reproduce: the p95, the one the issue
checks. The model's exponential hops spread arrivals wider than the runs do (p95 / p50 is 1.6
in the runs of N = 50, 2.0-2.3 at N = 25, 2.4-2.5 in the model), so fitted on the p50 the other
run's p95 came out 0.74 and 0.31 off at N = 50 (a on b, b on a), and 0.18 and 0.16 fitted on
the p95; at N = 25, 0.70 and 0.16 against 0.54 and 0.35 (the two runs' p95s differ by 54%
there: no fit on one is within 25% of the other)."""
SPEED_RANGE = 8.0
"""``fit_speed`` looks for its factor in [1 / 8, 8] (the runs so far needed 1.2-1.7)."""
SPEED_TOLERANCE = 0.01
"""``fit_speed`` stops once the model's copy figure is within 1% of the run's."""
SPEED_STEPS = 12
"""Halvings of ``fit_speed``'s interval at most ([1 / 8, 8] down to 0.1% of the factor): the
model's figure moves in steps (a shard's arrival) and may never land within the tolerance."""


def calibrate(run: dict[str, Any], *, before_fixes: bool = False, seeds: int = SEEDS) -> SimParams:
    """``SimParams`` from one run of ``bench/scale.py``:

    - the host: every node shares one machine; its capacity starts as what it moved during the
      broadcast, ``served_bytes_total / shards_p100_s`` (on loopback the bytes cost CPU,
      hashing and copies, not wire; one transfer alone, ``single_transfer_s``, uses a fraction
      of the machine, so it cannot stand for it);
    - a node's upload: its median per-pull rate as receivers saw it (``node_serve_mib_s``)
      times its upload slots, the origin's likewise (``origin_serve_mib_s``; a process of its
      own, it is faster); ``before_fixes`` (no slots): the host's capacity;
    - the speed (fitted, ``fit_speed``): one factor on the host's, nodes' and origin's rates,
      until the model's copy p95 is the run's. Taken as measured, the simulated swarm does not
      use all of the host's capacity, and its copy came out 25-55% long on the very run it was
      calibrated on; one factor keeps the measured proportions between the three;
    - the per-hop latency (fitted, ``fit_hop``), until the model's announcement p95 is the
      run's; shard size, parallel sources and gossip degree as measured; provider set:
      ``MAX_SOURCES`` of the connected peers (all of them ``before_fixes``);
    - start delay: none (a node with enough connected peers skips the DHT lookup), or the
      lookup p50 ``before_fixes`` (the fetch looked the provider records up first).
    """
    cal = run["calibration"]
    connected = max(1, round(float(run["connections_per_node"])))
    span = next((t for t in (run["shards_p100_s"], run["shards_p95_s"]) if math.isfinite(t)), None)
    # A run that never reached 95% of its nodes says nothing of the host: no host limit then.
    host = float(run["served_bytes_total"]) / float(span) if span else None
    slots = None if before_fixes else UPLOAD_SLOTS
    origin = float(cal["origin_serve_mib_s"]) * MIB * (slots or 1)
    # A run in which no peer served a pull (the origin served everything) measured no peer
    # rate: a node serves at the origin's rate then (the same code, on the same machine).
    node_rate = cal["node_serve_mib_s"] or cal["origin_serve_mib_s"]
    node = float(node_rate) * MIB * (slots or 1)
    if slots is None and host is not None:
        node = origin = host
    params = SimParams(
        origin_up=origin,
        node_up=node,
        host_cap=host,
        shard_bytes=int(cal["shard_bytes"]),
        parallel_sources=int(cal["parallel_sources"]),
        per_hop_s=float(cal["per_hop_gossip_s"]),
        gossip_degree=int(cal["gossip_degree"]),
        origin_links=int(cal["origin_links"]) if cal.get("origin_links") else None,
        lookup_s=float(run["lookup_p50_s"]) if before_fixes else 0.0,
        neighbors=connected if before_fixes else min(MAX_SOURCES, connected),
        upload_slots=slots,
        have_refresh_s=0.25 if before_fixes else 0.5,
    )
    params = replace(params, per_hop_s=fit_hop(params, run, seeds))
    return faster(params, fit_speed(params, run, seeds))


def fit_hop(params: SimParams, run: dict[str, Any], seeds: int = SEEDS) -> float:
    """The per-hop gossip latency at which the model's announcement p95 (``HOP_FIT_ON``, the
    median over ``seeds``) is the run's.

    Every hop's delay scales with ``per_hop_s``, and the announcement does not depend on the
    rates, so one broadcast of a single shard at 1 s per hop gives the factor exactly.
    ``bench/scale.py``'s own ``per_hop_gossip_s`` divides the p50 by a hop count, which ignores
    that a node hears the first of several paths (its direct link to the origin, each mesh
    neighbour): the model then ran 3-4x fast (announce p50 0.12 s for a measured 0.46 s at
    N = 50). A run without the figure keeps ``per_hop_s``."""
    measured = float(run.get(HOP_FIT_ON, math.inf))
    if not math.isfinite(measured) or measured <= 0:
        return params.per_hop_s
    unit = replace(params, per_hop_s=1.0)
    per_second = _median_of(unit, int(run["nodes"]), params.shard_bytes, seeds, HOP_FIT_ON)
    return measured / per_second if per_second > 0 else params.per_hop_s


def fit_speed(params: SimParams, run: dict[str, Any], seeds: int = SEEDS) -> float:
    """The factor on the rates (``faster``) at which the model's copy p95 (``SPEED_FIT_ON``,
    the median over ``seeds``) is the run's, by bisection on its logarithm (the model's copy
    shortens as its rates grow). 1 for a run that never reached the figure (nothing to fit on);
    a factor at an end of ``SPEED_RANGE`` is one the model could not fit."""
    measured = float(run.get(SPEED_FIT_ON, math.inf))
    if not math.isfinite(measured) or measured <= 0:
        return 1.0
    n, version = int(run["nodes"]), int(run["version_bytes"])
    low, high = 1 / SPEED_RANGE, SPEED_RANGE
    for _ in range(SPEED_STEPS):
        factor = math.sqrt(low * high)
        simulated = _median_of(faster(params, factor), n, version, seeds, SPEED_FIT_ON)
        if abs(simulated / measured - 1) <= SPEED_TOLERANCE:
            return factor
        low, high = (factor, high) if simulated > measured else (low, factor)
    return math.sqrt(low * high)


def faster(params: SimParams, factor: float) -> SimParams:
    """``params`` with the host's, nodes' and origin's rates times ``factor``."""
    host = None if params.host_cap is None else params.host_cap * factor
    return replace(
        params, origin_up=params.origin_up * factor, node_up=params.node_up * factor, host_cap=host
    )


def _median_of(params: SimParams, n: int, version: int, seeds: int, figure: str) -> float:
    return float(np.median([simulate(params, n, version, None, s)[figure] for s in range(seeds)]))


FIGURES = ("announce_p95_s", "shards_p95_s", "origin_share")
"""What ``check`` compares."""


def _rel(simulated: float, measured: float) -> float | None:
    if not measured or not math.isfinite(simulated) or not math.isfinite(measured):
        return None
    return round(abs(simulated - measured) / measured, 3)


def check(params: SimParams, runs: dict[str, Any], seeds: int = SEEDS) -> dict[str, Any]:
    """The model against each measured run (same N, same version size); each simulated figure
    is its median over ``seeds`` seeds, as the fits take it."""
    out = {}
    for key, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
        sims = [
            simulate(params, int(key), int(run["version_bytes"]), None, s) for s in range(seeds)
        ]
        sim = {k: float(np.median([r[k] for r in sims])) for k in FIGURES}
        out[key] = {
            "measured": {k: run[k] for k in FIGURES},
            "simulated": sim,
            "shards_p95_error": _rel(sim["shards_p95_s"], run["shards_p95_s"]),
            "announce_p95_error": _rel(sim["announce_p95_s"], run["announce_p95_s"]),
        }
    return out


def heldout(
    runs: dict[str, Any],
    fit_on: str | None = None,
    seeds: int = SEEDS,
    against: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Calibrate on one run and check the model on every other (sizes it was not fitted on),
    or on ``against``: other measured runs (another run of the same N counts: a new swarm,
    its keys, ports and timings its own, whose p95s the fit never saw).

    ``fit_on``: the N to fit on; default the smallest run whose copy reached 95% of its nodes
    (the speed is fitted on its copy p95, the per-hop latency on its announcement p95, so the
    fitted run itself says nothing). ``sim_heldout_error``: the largest relative error, over
    the held-out runs, of the simulated announcement p95 and copy p95 against the measured
    ones (a figure a run did not reach is not compared); ``error_by_n``: the same for each N
    alone (against another file, it keeps the other run of the fitted size apart from the
    other sizes, which the model does not carry to: on one machine the per-hop latency and the
    throughput change with N, and the model has no shared CPU)."""
    runs = _with_n(runs)
    reached = [k for k in runs if math.isfinite(float(runs[k]["shards_p95_s"]))]
    key = fit_on or min(reached or runs, key=int)
    params = calibrate(runs[key], seeds=seeds)
    others = (
        _with_n(against) if against is not None else {k: r for k, r in runs.items() if k != key}
    )
    checked = check(params, others, seeds)
    by_n = {k: _worst(c) for k, c in checked.items()}
    errors = [e for e in by_n.values() if e is not None]
    return {
        "fit_on_n": int(key),
        "held_out_n": sorted(int(k) for k in checked),
        "held_out": "other sizes" if against is None else "other runs",
        "calibrated": asdict(params),
        "check": checked,
        "error_by_n": by_n,
        "sim_heldout_error": max(errors) if errors else None,
    }


def _worst(checked: dict[str, Any]) -> float | None:
    """The larger of one run's announcement p95 and copy p95 errors (``None``: neither)."""
    errors = [
        e for e in (checked["announce_p95_error"], checked["shards_p95_error"]) if e is not None
    ]
    return max(errors, default=None)


def _runs(given: dict[str, Any]) -> dict[str, Any]:
    """The runs by N from ``bench/scale.py``'s JSON, its ``runs`` map, or one run dict."""
    if "calibration" in given:
        return {str(given.get("nodes", 100)): given}
    runs: dict[str, Any] = given.get("runs", given)
    return runs


def _with_n(given: dict[str, Any]) -> dict[str, Any]:
    """``_runs(given)`` with each run's ``nodes`` set from its key."""
    return {k: {"nodes": int(k), **r} for k, r in _runs(given).items()}


def home_params(calibrated: SimParams, **changes: Any) -> SimParams:
    """The calibrated implementation limits, with contributors at home and the origin in a
    data centre: no shared host, WAN latency on each gossip hop, 32 MiB shards."""
    base = replace(
        calibrated,
        origin_up=ORIGIN_MBIT * MBIT,
        host_cap=None,
        busy_wake="slot",
        per_hop_s=calibrated.per_hop_s + WAN_HOP_S,
        shard_bytes=32 * MIB,
        neighbors=min(calibrated.neighbors, MAX_NEIGHBORS),
        origin_links=None if calibrated.origin_links is None else MAX_CONNECTIONS,
    )
    return replace(base, **changes)


def bound(params: SimParams, n: int, version: int, links: HomeLinks | None, seed: int = 0) -> float:
    """A fluid lower bound on the time to reach 95% of nodes: 95% of the copies must leave some
    uplink (origin + relays + contributors), and the 95th-percentile-slowest downlink must
    take in a whole version."""
    rng = np.random.default_rng(seed)
    if links is None:
        up, down = np.full(n, params.node_up), np.full(n, params.node_down)
    else:
        up, down = links.sample(rng, n)
    if not params.serve:
        up = np.zeros(n)
    supply = params.origin_up + params.relays * params.relay_up + float(up.sum())
    copies = math.ceil(0.95 * n)
    slow = float(np.sort(down)[::-1][copies - 1])
    return max(copies * version / supply, version / slow, version / params.origin_up)


GIGABIT = HomeLinks(1000, 1000, 1000, 1, 1000, 1000)
WHAT_IFS: dict[str, dict[str, Any]] = {
    "k=16 parallel sources": {"parallel_sources": 16},
    "origin with 64 upload slots": {"origin_upload_slots": 64},
    "16 relays at 10 Gbit/s, 64 slots": {"relays": 16, "origin_upload_slots": 64},
    "1 Gbit/s symmetric contributors": {"links": GIGABIT},
    "1 Gbit/s + 16 relays + k=16": {
        "links": GIGABIT,
        "relays": 16,
        "origin_upload_slots": 64,
        "parallel_sources": 16,
    },
}
"""What might beat INTELLECT-2's ~14 minutes; each runs at 1,000 contributors."""


def _summary(
    sim: dict[str, Any], params: SimParams, n: int, version: int, links: HomeLinks | None
) -> dict[str, Any]:
    low = bound(params, n, version, links)
    return {
        "shards_p95_s": sim["shards_p95_s"],
        "shards_p95_min": round(sim["shards_p95_s"] / 60, 1),
        "shards_p50_s": sim["shards_p50_s"],
        "shards_p100_s": sim["shards_p100_s"],
        "announce_p95_s": sim["announce_p95_s"],
        "origin_upload_gb": round(sim["origin_upload_gb"], 1),
        "origin_share": round(sim["origin_share"], 4),
        "relay_upload_gb": round(sim["relay_upload_gb"], 1),
        "fluid_bound_p95_s": round(low, 1),
        "vs_intellect2": round(sim["shards_p95_s"] / INTELLECT2_S, 2),
        "pieces": sim["pieces"],
        "piece_mib": sim["piece_mib"],
        "gave_up": sim["gave_up"],
        "refusals": sim["refusals"],
        "stream_fallbacks": sim["stream_fallbacks"],
        "sim_wall_s": sim["sim_wall_s"],
    }


def project(
    runs: dict[str, Any],
    *,
    sizes: tuple[int, ...] = (1000, 10_000),
    what_if_n: int = 1000,
    what_ifs: dict[str, dict[str, Any]] | None = None,
    fine_n: int | None = 1000,
    version: int = CHECKPOINT_BYTES,
    before_fixes: bool = False,
) -> dict[str, Any]:
    """Calibrate on the N = 100 run (else the largest), check against every run, project.

    ``fine_n``: also run that size with 4x more (smaller) pieces, to show what grouping shards
    into pieces costs. Returns ``{"sim_error_at_100", "projection": {"1000": ..., "10000": ...},
    ...}``; ``sim_error_at_100`` is the calibrating run's own copy p95 error, which the speed
    fit brings to about 0 (``SPEED_TOLERANCE``): ``sim_heldout_error`` is the figure that says
    whether the model predicts."""
    runs = _runs(runs)
    # The N = 100 run, else the largest whose broadcast reached 95% of its nodes.
    reached = [k for k in runs if math.isfinite(runs[k]["shards_p95_s"])]
    key = "100" if "100" in reached else max(reached or runs, key=int)
    calibrated = calibrate(runs[key], before_fixes=before_fixes)
    checked = check(calibrated, runs)
    params = home_params(calibrated)
    projection = {}
    for n in sizes:
        sim = simulate(params, n, version, HOME, seed=0)
        projection[str(n)] = _summary(sim, params, n, version, HOME)
    held = heldout(runs) if len(runs) > 1 else None
    out: dict[str, Any] = {
        "sim_heldout_error": held["sim_heldout_error"] if held else None,
        "heldout": held,
        "sim_error_at_100": checked[key]["shards_p95_error"],
        "announce_error_at_100": checked[key]["announce_p95_error"],
        "calibrated_on_n": int(key),
        "load_average": runs[key].get("load_average"),
        "check": checked,
        "calibrated": asdict(calibrated),
        "synthetic_calibration": bool(runs[key].get("synthetic")),
        "projection": projection,
        "assumptions": {
            "checkpoint_gb": version / GB,
            "contributors": HOME.describe(),
            "origin": f"{ORIGIN_MBIT:g} Mbit/s upload, data centre",
            "gossip_hop_s": params.per_hop_s,
            "providers_per_fetcher": params.neighbors,
            "intellect2_s": INTELLECT2_S,
        },
    }
    if fine_n:
        fine = replace(params, max_transfers=params.max_transfers * 4)
        sim = simulate(fine, fine_n, version, HOME, seed=0)
        out["aggregation_check"] = {
            "n": fine_n,
            "finer": _summary(sim, fine, fine_n, version, HOME),
        }
    whatif = {}
    for name, change in (WHAT_IFS if what_ifs is None else what_ifs).items():
        change = dict(change)
        links = change.pop("links", HOME)
        p = replace(params, **change)
        sim = simulate(p, what_if_n, version, links, seed=0)
        whatif[name] = _summary(sim, p, what_if_n, version, links)
    out["what_if"] = {"n": what_if_n, "runs": whatif}
    return out


# --- command line -----------------------------------------------------------------------------
def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never"
    if seconds < 120:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def print_report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = "model vs measured" + (
        " (SYNTHETIC calibration)" if result["synthetic_calibration"] else ""
    )
    console.print(_check_table(title, result["check"]))
    held = result.get("heldout")
    if held:
        console.print(
            f"fitted on N = {held['fit_on_n']}, held out N = {held['held_out_n']}:"
            f" sim_heldout_error {held['sim_heldout_error']} (the largest error of announce p95"
            " and copy p95 at the sizes it was not fitted on)"
        )
    table = Table(title=f"62 GB to home contributors ({result['assumptions']['contributors']})")
    for col in (
        "case",
        "95% reached",
        "fluid bound",
        "x INTELLECT-2",
        "origin upload",
        "pieces",
        "gave up",
    ):
        table.add_column(col)
    rows = [(f"N = {n}", r) for n, r in result["projection"].items()]
    if "aggregation_check" in result:
        agg = result["aggregation_check"]
        rows.append((f"N = {agg['n']}, 4x finer pieces", agg["finer"]))
    rows += [
        (f"{name} (N = {result['what_if']['n']})", r)
        for name, r in result["what_if"]["runs"].items()
    ]
    for name, r in rows:
        table.add_row(
            name,
            _fmt(r["shards_p95_s"]),
            _fmt(r["fluid_bound_p95_s"]),
            f"{r['vs_intellect2']:g}",
            f"{r['origin_upload_gb']:.0f} GB ({r['origin_share']:.1%})",
            f"{r['pieces']} x {r['piece_mib']:g} MiB",
            str(r["gave_up"]),
        )
    console.print(table)


def _check_table(title: str, checked: dict[str, Any]) -> Any:
    """``check``'s result as a table: measured against simulated, by N."""
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "N",
        "announce p95 meas/sim",
        "shards p95 meas/sim",
        "origin share meas/sim",
        "error",
    ):
        table.add_column(col)
    for key, c in checked.items():
        m, s = c["measured"], c["simulated"]
        table.add_row(
            key,
            f"{m['announce_p95_s']:.2f} / {s['announce_p95_s']:.2f} s",
            f"{m['shards_p95_s']:.2f} / {s['shards_p95_s']:.2f} s",
            f"{m['origin_share']:.2f} / {s['origin_share']:.2f}",
            f"shards {c['shards_p95_error']}, announce {c['announce_p95_error']}",
        )
    return table


def print_heldout(held: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    title = f"fitted on N = {held['fit_on_n']}, checked on {held['held_out']}"
    console.print(_check_table(title, held["check"]))
    by_n = ", ".join(f"N = {n}: {e}" for n, e in held["error_by_n"].items())
    console.print(f"sim_heldout_error {held['sim_heldout_error']} ({by_n})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, help="JSON of bench/scale.py (default: synthetic runs)")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--quick", action="store_true", help="1,000 only, no what-ifs (a smoke run)")
    ap.add_argument(
        "--before-fixes",
        action="store_true",
        help="model the code before issue 17's fixes (no upload slots, every peer a source)",
    )
    ap.add_argument(
        "--heldout-against",
        type=Path,
        metavar="PATH",
        help="only the held-out check: fit on --runs (its smallest N that reached 95%%, or"
        " --fit-on) and check every run of this other bench/scale.py JSON (another run of the"
        " same sizes counts)",
    )
    ap.add_argument("--fit-on", help="the N of --runs to fit on (with --heldout-against)")
    args = ap.parse_args(argv)
    runs = json.loads(args.runs.read_text()) if args.runs else {"runs": SYNTHETIC_RUNS}
    if args.heldout_against is not None:
        if not args.runs:
            print("error: --heldout-against needs --runs (the run to fit on)", file=sys.stderr)
            return 2
        held = heldout(runs, args.fit_on, against=json.loads(args.heldout_against.read_text()))
        print_heldout(held)
        if args.json:
            args.json.write_text(json.dumps(held, indent=2, default=str))
        return 0
    if not _runs(runs):
        print(
            "error: no run to calibrate on in that file; run bench/scale.py --json PATH first",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    quick: dict[str, Any] = {"sizes": (1000,), "what_ifs": {}, "fine_n": None}
    result = project(runs, before_fixes=args.before_fixes, **(quick if args.quick else {}))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
