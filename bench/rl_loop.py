"""The RL loop across a real local swarm (processes on 127.0.0.1), against the same loop with no
swarm at all.

    .venv/bin/python bench/rl_loop.py [--json PATH] [--versions K] [--minutes M] [--workers N]

Three runs in one invocation, on the embedded model and the demo parameters (node/up.py):
1. the swarm with async level 2 (trainer, validator, N workers, a bootstrap; no cheater), to K
   versions or M minutes;
2. the same swarm with async level 0 (workers wait for every new version);
3. the plain in-process GRPO loop (same model, tasks, batch and recipe; no network, no proofs,
   no validator) for the same wall time (at most 150 s: it reaches +0.2 well before).

Prints a table last and writes JSON with ``accepted_samples_per_s``, ``trainer_idle_fraction``,
``validator_over_generate``, ``async_speedup``, ``reward_delta_async``, ``reward_delta_sync``,
``swarm_vs_inprocess`` (the in-process loop's wall time to +0.2 mean reward over the swarm's; null
when one of them never gets there) and the curves behind them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

from node.rl.inprocess import train_inprocess
from node.up import DEMO_PARAMS, LocalSwarm, UpConfig

GAIN = 0.2
SMOOTH = 5


def smoothed(curve: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Running mean over SMOOTH points: one version's mean reward is noisy."""
    out = []
    for i in range(len(curve)):
        window = curve[max(0, i - SMOOTH + 1) : i + 1]
        out.append((curve[i][0], sum(r for _, r in window) / len(window)))
    return out


def time_to_gain(curve: list[tuple[float, float]], gain: float) -> float | None:
    """Seconds until the running mean first stands ``gain`` above the mean of the first SMOOTH
    versions (one version's reward is noisy: a lucky or unlucky version 0 decides nothing)."""
    if len(curve) < SMOOTH:
        return None
    points = smoothed(curve)[SMOOTH - 1 :]
    start = points[0][1]
    return next((t for t, r in points if r - start >= gain), None)


async def run_swarm(
    out: Path, params: Any, versions: int, minutes: float, workers: int
) -> dict[str, Any]:
    swarm = LocalSwarm(
        UpConfig(
            out=out,
            workers=workers,
            versions=versions,
            minutes=minutes,
            with_cheater=False,
            params=params,
        )
    )
    swarm.prepare()
    await swarm.start()
    try:
        while (reason := swarm.finished()) is None:
            await swarm.poll()
            await trio.sleep(1.0)
        await swarm.poll()
    finally:
        swarm.stop()
    trainer = swarm.trainer_status()
    validator = swarm.proc("validator").status.get("role_status", {}).get("validator", {})
    worker_stats = [
        p.status.get("role_status", {}).get("worker", {})
        for p in swarm.procs
        if p.name.startswith("worker-")
    ]
    published = {int(v): t for v, t in trainer.get("published_at", {}).items()}
    rewards = swarm.reward_by_version()
    curve = [(published[v], r) for v, r in rewards if v in published]
    generate_s = sum(w.get("generate_seconds", 0.0) for w in worker_stats)
    accepted_samples = validator.get("accepted", 0) * params.batch_prompts * params.group_size
    wall = published.get(max(published), 0.0) if published else swarm.elapsed()
    return {
        "stopped_because": reason,
        "versions": trainer.get("version", 0),
        "wall_s": wall,
        "reward_by_version": [r for _, r in rewards],
        "curve": curve,
        "accepted_samples_per_s": accepted_samples / wall if wall else 0.0,
        "trainer_idle_fraction": trainer.get("idle_fraction"),
        "validator_over_generate": validator.get("judge_seconds", 0.0) / generate_s
        if generate_s
        else None,
        "reward_delta": rewards[-1][1] - rewards[0][1] if len(rewards) > 1 else None,
        "time_to_gain_s": time_to_gain(curve, GAIN),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rl-loop-"))

    asynchronous = trio.run(
        run_swarm, root / "async", DEMO_PARAMS, args.versions, args.minutes, args.workers
    )
    sync_params = dataclasses.replace(DEMO_PARAMS, async_level=0)
    synchronous = trio.run(
        run_swarm, root / "sync", sync_params, args.versions, args.minutes, args.workers
    )
    import torch

    torch.set_num_threads(1)  # as the swarm's trainer and engines: fastest on these cores
    started = time.perf_counter()
    inprocess = train_inprocess(
        DEMO_PARAMS, steps=10_000, time_limit_s=min(max(asynchronous["wall_s"], 30.0), 150.0)
    )
    in_curve = [(r.elapsed_s, r.mean_reward) for r in inprocess]
    in_gain_s = time_to_gain(in_curve, GAIN)
    swarm_gain_s = asynchronous["time_to_gain_s"]

    per_version = lambda run: run["wall_s"] / max(1, run["versions"])  # noqa: E731
    result = {
        "accepted_samples_per_s": round(asynchronous["accepted_samples_per_s"], 2),
        "trainer_idle_fraction": asynchronous["trainer_idle_fraction"],
        "validator_over_generate": asynchronous["validator_over_generate"],
        "async_speedup": round(per_version(synchronous) / per_version(asynchronous), 3),
        "reward_delta_async": asynchronous["reward_delta"],
        "reward_delta_sync": synchronous["reward_delta"],
        "swarm_vs_inprocess": round(in_gain_s / swarm_gain_s, 3)
        if in_gain_s and swarm_gain_s
        else None,
        "inprocess_time_to_gain_s": in_gain_s,
        "swarm_time_to_gain_s": swarm_gain_s,
        "inprocess_versions": len(inprocess) - 1,
        "inprocess_wall_s": round(time.perf_counter() - started, 1),
        "inprocess_reward_delta": in_curve[-1][1] - in_curve[0][1] if len(in_curve) > 1 else None,
        "async": asynchronous,
        "sync": synchronous,
        "params": DEMO_PARAMS.to_wire(),
        "machine": f"{platform.machine()}, 2 shared cores, Python {platform.python_version()}",
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")

    table = Table(title=f"RL loop: {args.workers} workers, up to {args.versions} versions")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")

    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    table.add_row("accepted samples / s (async)", fmt(result["accepted_samples_per_s"]), "")
    table.add_row("trainer idle fraction", fmt(result["trainer_idle_fraction"]), "")
    table.add_row("validator time / generation time", fmt(result["validator_over_generate"]), "")
    table.add_row("s per version, sync / async", fmt(result["async_speedup"]), ">= 1.5")
    table.add_row("reward delta, async (last - v0)", fmt(result["reward_delta_async"]), "")
    table.add_row("reward delta, sync (last - v0)", fmt(result["reward_delta_sync"]), "")
    table.add_row(
        f"time to +{GAIN}: in-process / swarm", fmt(result["swarm_vs_inprocess"]), ">= 0.5"
    )
    table.add_row("  in-process s to gain", fmt(in_gain_s), "")
    table.add_row("  swarm s to gain", fmt(swarm_gain_s), "")
    Console().print(table)


if __name__ == "__main__":
    main()
