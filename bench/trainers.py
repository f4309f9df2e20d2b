"""One trainer against two (processes on 127.0.0.1, hivemind gradient averaging), at the same
samples per version, and the time to fail over when the publisher is killed.

    .venv/bin/python bench/trainers.py [--json PATH] [--versions K] [--workers N]

Each run is a `swarm-node up` swarm (node/up.py) with the demo parameters and
``submissions_per_step = 2``: one trainer steps on 2 submissions, two trainers on 1 each per
round (their gradients averaged, weighted by samples). Measured on the validator's view of the
policy (the time each version is accepted from gossip), after a warm-up of 2 versions:

- ``seconds_per_version`` for 1 and 2 trainers;
- ``bytes_averaged_per_version``: gradient bytes the trainers put into averaging per version;
- ``averaging_share``: seconds inside averaging rounds over the trainers' busy seconds;
- ``averaging_mb_per_s``: bytes averaged per second of averaging (the loopback rate);
- ``failover_s``: kill -9 of the publisher -> the next version accepted by the validator.

Prints a table last and writes JSON. The projection to separate GPUs is in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

from node.up import DEMO_PARAMS, LocalSwarm, UpConfig

WARMUP = 2


def _trainer(swarm: LocalSwarm, name: str) -> dict[str, Any]:
    return dict(swarm.proc(name).status.get("role_status", {}).get("trainer", {}))


def _policy(swarm: LocalSwarm) -> int:
    return int(swarm.proc("validator").status.get("policy_version") or 0)


async def _seen_at(swarm: LocalSwarm, upto: int, deadline_s: float) -> dict[int, float]:
    """Poll until the validator holds version ``upto``; when each version was first seen."""
    seen: dict[int, float] = {}
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        await swarm.poll()
        v = _policy(swarm)
        seen.setdefault(v, time.monotonic())
        if v >= upto:
            break
        await trio.sleep(0.25)
    return seen


async def run(trainers: int, versions: int, workers: int, out: Path) -> dict[str, Any]:
    params = dataclasses.replace(DEMO_PARAMS, submissions_per_step=2)
    swarm = LocalSwarm(
        UpConfig(
            out=out,
            workers=workers,
            trainers=trainers,
            with_cheater=False,
            params=params,
            versions=10_000,
            minutes=60,
        )
    )
    swarm.prepare()
    await swarm.start()
    names = [p.name for p in swarm.procs if p.role == "trainer"]
    result: dict[str, Any] = {"trainers": trainers}
    try:
        seen = await _seen_at(swarm, WARMUP + versions, 900)
        first, last = WARMUP, max(seen)
        if last > first and first in seen:
            result["seconds_per_version"] = (seen[last] - seen[first]) / (last - first)
        result["versions_measured"] = last - first
        groups = [_trainer(swarm, n).get("group") or {} for n in names]
        busy = sum(float(_trainer(swarm, n).get("busy_s") or 0.0) for n in names)
        averaging = sum(float(g.get("averaging_seconds", 0.0)) for g in groups)
        averaged = sum(int(g.get("bytes_averaged", 0)) for g in groups)
        top = max(last, 1)
        result["bytes_averaged_per_version"] = averaged / top
        result["averaging_share"] = averaging / busy if busy else 0.0
        result["averaging_mb_per_s"] = averaged / averaging / 1e6 if averaging else None
        result["rounds_averaged"] = [g.get("rounds_averaged", 0) for g in groups]
        result["samples_contributed"] = [g.get("samples_contributed", 0) for g in groups]
        if trainers > 1:
            publisher = groups[0].get("publisher")
            victim = next(p.name for p in swarm.procs if p.peer_id == publisher)
            before = _policy(swarm)
            killed = time.monotonic()
            swarm.kill(victim)
            after = await _seen_at(swarm, before + 1, 300)
            if before + 1 in after:
                result["failover_s"] = after[before + 1] - killed
            result["killed"] = victim
    finally:
        swarm.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--versions", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-trainers-"))
    one = trio.run(run, 1, args.versions, args.workers, root / "one")
    two = trio.run(run, 2, args.versions, args.workers, root / "two")
    figures = {
        "seconds_per_version": {
            "1": one.get("seconds_per_version"),
            "2": two.get("seconds_per_version"),
        },
        "bytes_averaged_per_version": two.get("bytes_averaged_per_version"),
        "averaging_share": two.get("averaging_share"),
        "averaging_mb_per_s": two.get("averaging_mb_per_s"),
        "failover_s": two.get("failover_s"),
        "runs": [one, two],
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
        },
        "command": "bench/trainers.py",
    }
    table = Table(title=f"1 against 2 trainers ({args.versions} versions, 2 submissions each)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in ("bytes_averaged_per_version", "averaging_share", "averaging_mb_per_s"):
        value = figures[key]
        table.add_row(key, "-" if value is None else f"{value:.3g}")
    for n, s in figures["seconds_per_version"].items():
        table.add_row(f"seconds_per_version ({n} trainer(s))", "-" if s is None else f"{s:.2f}")
    fo = figures["failover_s"]
    table.add_row("failover_s (publisher killed)", "-" if fo is None else f"{fo:.1f}")
    table.add_row("load average", " ".join(f"{x:.1f}" for x in os.getloadavg()))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    Console().print(table)


if __name__ == "__main__":
    main()
