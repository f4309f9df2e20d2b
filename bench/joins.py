"""What joining costs a swarm with bounded connections: N nodes started one after another in one
trio loop (a trainer, a validator, then workers), then newcomers, on 127.0.0.1.

    .venv/bin/python bench/joins.py [--nodes 30] [--newcomers 5] [--low 8] [--high 12]
        [--json PATH]

It reports how long the N starts took (``start_s``), the trims they caused
(``trims_by_formation``), the CPU per node over ``--window`` seconds once they are up
(``idle_cpu_pct_per_node``, % of one core, this process's CPU over the nodes; the first
minute, while discovery backs off), and for each newcomer: its start, when it knew the trainer
(``trainer_known_s``), and how many peers sat in py-libp2p's negative dial cache then
(``blocked``: a dial refused by our own connection cap put healthy peers there for 60 s before
``swarm.net.host._CapDials``). Every node and the bootstrap peer stop at the end
(``stop_s``). This is what ``tests/integration/test_connection_bounds.py`` pays before its
checks.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.net.connections import ConnectionBounds
from tests.netfactory import NetFactory


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    bounds = ConnectionBounds(low=args.low, high=args.high)
    out: dict[str, Any] = {"nodes": args.nodes, "low": args.low, "high": args.high}
    net = NetFactory(heartbeat=1.0, discover_every_s=1.0)
    async with net:
        await net.bootstrap()
        started = time.monotonic()
        nodes = [
            await net.node("trainer", connections=bounds),
            await net.node("validator", connections=bounds),
        ]
        while len(nodes) < args.nodes:
            nodes.append(await net.node("inference", connections=bounds))
        out["start_s"] = round(time.monotonic() - started, 1)
        out["trims_by_formation"] = sum(n.connections.stats.trims for n in nodes)
        before = cpu_s()
        await trio.sleep(args.window)
        out["idle_cpu_pct_per_node"] = round((cpu_s() - before) / args.window / len(nodes) * 100, 2)
        newcomers = []
        for _ in range(args.newcomers):
            t = time.monotonic()
            fresh = await net.node("inference", connections=bounds)
            start = time.monotonic() - t
            with trio.move_on_after(60):
                while not fresh.peers_by_role().get("trainer"):
                    await trio.sleep(0.1)
            known = time.monotonic() - t if fresh.peers_by_role().get("trainer") else None
            negative = fresh.overlay.host.get_network()._negative_peer_cache
            newcomers.append(
                {
                    "start_s": round(start, 1),
                    "trainer_known_s": None if known is None else round(known, 1),
                    "blocked": sum(negative.is_blocked(p) for p in list(negative._cache)),
                    "connections": fresh.connections.count(),
                }
            )
        out["newcomers"] = newcomers
        stopping = time.monotonic()
    out["stop_s"] = round(time.monotonic() - stopping, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=30)
    parser.add_argument("--newcomers", type=int, default=5)
    parser.add_argument("--low", type=int, default=8)
    parser.add_argument("--high", type=int, default=12)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = trio.run(measure, args)
    print(f"{'figure':<34} value")
    for key in ("nodes", "start_s", "trims_by_formation", "idle_cpu_pct_per_node", "stop_s"):
        print(f"{key:<34} {result[key]}")
    for i, n in enumerate(result["newcomers"]):
        print(
            f"newcomer {i}: start {n['start_s']} s, knew the trainer after"
            f" {n['trainer_known_s']} s, {n['blocked']} peers in the negative dial cache,"
            f" {n['connections']} connections"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
