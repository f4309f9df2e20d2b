"""Kill -9 of the publishing trainer, again and again, in a two-trainer swarm (processes on
127.0.0.1, ``node.up.LocalSwarm``): how long the run takes to go on, and the restarted trainer
to average with the other again.

    .venv/bin/python bench/trainer_kills.py [--cycles 5] [--out DIR] [--json PATH]

Each cycle kills the trainer that published the newest version, waits until the validator
accepts a newer one (``failover_s``), restarts the killed one with the same home and waits
until it has averaged a round with the other and the policy moved on (``rejoin_s``). A cycle
that does not recover within its limit ends the run (``"ok": false``); the node logs stay under
``--out`` (``logs/*.log``, ``homes/*/runs/*/trainer-child.log``). This is how the faults in
docs/RELIABILITY.md (partial all-reduce, stale adverts, a restarted node seen private) were
found: one cycle can pass by luck, five in a row rarely do.

Prints a table and writes JSON: ``failover_s`` and ``rejoin_s`` (lists, one per cycle),
``failover_max_s``, ``rejoin_max_s``, ``cycles_ok``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.up import DEMO_PARAMS, LocalSwarm, UpConfig

NAMES = ("trainer", "trainer-2")
FAILOVER_LIMIT_S = 120.0
REJOIN_LIMIT_S = 180.0


def _group(swarm: LocalSwarm, name: str) -> dict[str, Any]:
    trainer = swarm.proc(name).status.get("role_status", {}).get("trainer", {})
    return dict(trainer.get("group") or {})


def _policy(swarm: LocalSwarm) -> int:
    return int(swarm.proc("validator").status.get("policy_version") or 0)


async def _until(swarm: LocalSwarm, ok: Callable[[], bool], limit: float) -> float | None:
    """Seconds until ``ok()`` holds (polled every 0.5 s), or None past ``limit``."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        await swarm.poll()
        if ok():
            return time.monotonic() - start
        await trio.sleep(0.5)
    return None


async def run(out: Path, cycles: int) -> dict[str, Any]:
    swarm = LocalSwarm(
        UpConfig(
            out=out,
            workers=1,
            trainers=2,
            with_cheater=False,
            params=DEMO_PARAMS,
            versions=100_000,
            minutes=10 + 6 * cycles,
        )
    )
    swarm.prepare()
    await swarm.start()
    result: dict[str, Any] = {"failover_s": [], "rejoin_s": [], "killed": [], "ok": False}
    try:

        def both_averaged() -> bool:
            return all(_group(swarm, n).get("rounds_averaged", 0) > 0 for n in NAMES)

        if await _until(swarm, both_averaged, 300) is None:
            result["error"] = "the two trainers never averaged a round"
            return result
        for _ in range(cycles):
            publisher = next(
                (_group(swarm, n).get("publisher") for n in NAMES if _group(swarm, n)), None
            )
            name = next((p.name for p in swarm.procs if p.peer_id == publisher), NAMES[0])
            before = _policy(swarm)
            swarm.kill(name)
            result["killed"].append(name)

            def newer(before: int = before) -> bool:
                return _policy(swarm) > before

            failover = await _until(swarm, newer, FAILOVER_LIMIT_S)
            result["failover_s"].append(failover)
            if failover is None:
                result["error"] = f"no version after v{before} within {FAILOVER_LIMIT_S:g} s"
                return result
            swarm.respawn(name)
            swarm.proc(name).status = {}
            at = _policy(swarm)

            def rejoined(name: str = name, at: int = at) -> bool:
                group = _group(swarm, name)
                return (
                    group.get("rounds_averaged", 0) > 0
                    and group.get("samples_contributed", 0) > 0
                    and _policy(swarm) > at
                )

            rejoin = await _until(swarm, rejoined, REJOIN_LIMIT_S)
            result["rejoin_s"].append(rejoin)
            if rejoin is None:
                result["error"] = f"{name} did not rejoin within {REJOIN_LIMIT_S:g} s"
                return result
        result["ok"] = True
        return result
    finally:
        swarm.stop()
        done = [s for s in result["rejoin_s"] if s is not None]
        result["cycles_ok"] = len(done)
        result["failover_max_s"] = max((s for s in result["failover_s"] if s), default=None)
        result["rejoin_max_s"] = max(done, default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="where the swarm's homes and logs go")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="trainer-kills-"))
    result = trio.run(run, out, args.cycles)
    result["out"] = str(out)
    table = Table(title=f"kill -9 of the publishing trainer ({args.cycles} cycles)")
    for col in ("cycle", "killed", "failover s", "rejoin s"):
        table.add_column(col)
    for i, name in enumerate(result["killed"]):
        fail = result["failover_s"][i] if i < len(result["failover_s"]) else None
        back = result["rejoin_s"][i] if i < len(result["rejoin_s"]) else None
        table.add_row(
            str(i),
            name,
            "-" if fail is None else f"{fail:.1f}",
            "-" if back is None else f"{back:.1f}",
        )
    console = Console()
    console.print(table)
    console.print(f"ok: {result['ok']}" + (f" ({result['error']})" if "error" in result else ""))
    console.print(f"logs: {out}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
