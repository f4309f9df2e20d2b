"""Idle cost of a node: CPU per node while nothing is published, and where it goes.

    .venv/bin/python bench/idle.py [--nodes 20] [--per-process 10] [--settle 30] [--window 20]
        [--profile] [--baseline REV [--rounds 2]] [--json PATH]

The swarm of ``bench/scale.py`` without a version: 2 bootstrap peers, the publisher (a genesis
trainer that publishes nothing) and ``--nodes`` inference nodes, ``--per-process`` (10) to a
process and trio loop (``bench/scale_node.py``). After ``--settle`` seconds (discovery backs
off, the DHT settles) it reads the CPU time of the node processes over ``--window`` seconds:
``idle_cpu_pct_per_node`` is that over the nodes, in % of one core. With ``--profile`` the
first process runs cProfile over the same window and the functions with the most own time and
the most cumulative time are printed (``profile_top`` in the JSON): what an idle node spends its
CPU on.
With ``--baseline REV`` the same idle swarm runs on a git worktree of ``REV`` (its ``swarm``,
``node`` and ``bench/scale_node.py``) and on this checkout, one after the other, ``--rounds``
times each, alternating (baseline first): ``idle_cpu_over_baseline`` is this code's mean idle CPU
per node over the baseline's, both measured in this one run on this machine.
Processes are killed and the temp dir (and worktree) removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from scale import (  # noqa: E402
    ROOT,
    Proc,
    kill_all,
    log,
    start_groups,
    start_publisher,
    write_spec,
)


def top(stats_path: Path, key: str, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` functions with the most ``key`` time ("tottime" or "cumtime")."""
    stats = pstats.Stats(str(stats_path))
    rows = []
    for (file, line, name), (_cc, calls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "fn": f"{Path(file).name}:{line}({name})",
                "calls": calls,
                "tottime": tt,
                "cumtime": ct,
            }
        )
    rows.sort(key=lambda r: -float(r[key]))
    return rows[:limit]


async def measure(args: argparse.Namespace, root: Path = ROOT) -> dict[str, Any]:
    """One idle swarm of the code at ``root``; its figures."""
    base = Path(tempfile.mkdtemp(prefix="swarm-idle-"))
    procs: list[Proc] = []
    try:
        spec, spec_path = write_spec(base)
        async with trio.open_nursery() as nursery:
            await start_publisher(nursery, spec, spec_path, procs, root=root)
            groups = await start_groups(
                nursery, spec_path, args.nodes, args.per_process, procs, root=root
            )
            log(f"idle: {args.nodes} nodes up; settling {args.settle:.0f} s")
            await trio.sleep(args.settle)
            profile_path = Path(args.profile_out) if args.profile_out else base / "idle.prof"
            before = [p.usage()[1] for p in groups]
            boot_before = [p.usage()[1] for p in procs[:2]]
            t0 = time.monotonic()
            if args.profile:
                await groups[0].send(cmd="profile", s=args.window, path=str(profile_path))
            await trio.sleep(args.window)
            if args.profile:
                with trio.fail_after(60):
                    await groups[0].wait("profiled")
            took = time.monotonic() - t0
            cpu = [p.usage()[1] - b for p, b in zip(groups, before, strict=True)]
            boot_cpu = [p.usage()[1] - b for p, b in zip(procs[:2], boot_before, strict=True)]
            result: dict[str, Any] = {
                "nodes": args.nodes,
                "nodes_per_process": args.per_process,
                "settle_s": args.settle,
                "window_s": took,
                "idle_cpu_pct_per_node": 100 * sum(cpu) / took / args.nodes,
                "bootstrap_cpu_pct": [100 * c / took for c in boot_cpu],
                "load_average": os.getloadavg(),
            }
            if args.profile:
                result["profile_top"] = {
                    "tottime": top(profile_path, "tottime", args.top),
                    "cumtime": top(profile_path, "cumtime", args.top),
                }
            nursery.cancel_scope.cancel()
    finally:
        kill_all(procs)
        shutil.rmtree(base, ignore_errors=True)
    return result


def side_by_side(args: argparse.Namespace) -> dict[str, Any]:
    """``--baseline REV``: the idle swarm of REV's code and of this checkout's, alternating."""
    rev = subprocess.run(
        ["git", "rev-parse", "--verify", f"{args.baseline}^{{commit}}"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if rev.returncode != 0:
        raise SystemExit(f"--baseline {args.baseline}: not a commit here ({rev.stderr.strip()})")
    sha = rev.stdout.strip()
    tree = Path(tempfile.mkdtemp(prefix="swarm-idle-baseline-")) / "tree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), sha],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
    try:
        for round_ in range(args.rounds):
            for name, root in (("baseline", tree), ("this", ROOT)):
                log(f"idle: round {round_ + 1}/{args.rounds}, {name}")
                runs[name].append(trio.run(measure, args, root))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        shutil.rmtree(tree.parent, ignore_errors=True)
    mean = {
        name: statistics.fmean(r["idle_cpu_pct_per_node"] for r in rs) for name, rs in runs.items()
    }
    return {
        "baseline": sha,
        "nodes": args.nodes,
        "rounds": args.rounds,
        "idle_cpu_pct_per_node": mean,
        "idle_cpu_over_baseline": mean["this"] / mean["baseline"],
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--settle", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--per-process", type=int, default=10, help="nodes sharing a process")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--profile-out", default=None, help="keep the pstats file here")
    parser.add_argument("--baseline", default=None, help="a commit to measure side by side")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, with --baseline")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.baseline:
        result = side_by_side(args)
        print(f"{'code':10} {'idle CPU per node (% of a core), each run':44} mean")
        for name, rs in result["runs"].items():
            each = ", ".join(f"{r['idle_cpu_pct_per_node']:.2f}" for r in rs)
            label = result["baseline"][:9] if name == "baseline" else "this"
            print(f"{label:10} {each:44} {result['idle_cpu_pct_per_node'][name]:.2f}")
        print(
            f"idle_cpu_over_baseline: {result['idle_cpu_over_baseline']:.2f}"
            f" ({args.nodes} nodes, {args.rounds} rounds each, alternating)"
        )
    else:
        result = trio.run(measure, args)
        for key in ("tottime", "cumtime"):
            for row in result.get("profile_top", {}).get(key, []):
                print(f"{key:8} {row[key]:7.3f} s {row['calls']:8d} calls  {row['fn']}")
        print(
            f"idle CPU per node: {result['idle_cpu_pct_per_node']:.2f}% of a core"
            f" ({args.nodes} nodes, {result['window_s']:.0f} s window);"
            f" bootstrap peers {', '.join(f'{c:.1f}%' for c in result['bootstrap_cpu_pct'])};"
            f" load {result['load_average'][0]:.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
