"""One training child against an FSDP2 group of ranks (``join --role trainer --nproc N``) on
the same batches: start-up time and seconds per step (a child's step includes writing the
version's safetensors and the checkpoint; with ranks, rank 0 gathers the full state for both).

    .venv/bin/python bench/trainer_ranks.py [--json PATH] [--steps K] [--nproc 1 2]

A batch is the demo's (``DEMO_PARAMS``: 16 groups of 8 completions of up to 12 tokens) made of
random tokens with mixed rewards, on the embedded model, one torch thread per rank. Every step
trains on a fresh batch of the child's current version. The first step is left out (warm-up).
On one machine the ranks share its cores: the ratio shows the cost of the collectives, not the
gain of more devices. Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from node.compute.groups import Group
from node.compute.train_child import TrainerChild
from node.model import DEFAULT_MODEL_DIR, model_info
from node.up import DEMO_PARAMS


def demo_batch(version: int, seed: int) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    p = DEMO_PARAMS
    groups = []
    for i in range(p.batch_prompts):
        completions = [
            torch.randint(40, 250, (4 + (i + j) % (p.max_tokens - 3),), generator=gen).tolist()
            for j in range(p.group_size)
        ]
        rewards = [float((i + j) % 3 == 0) for j in range(p.group_size)]
        groups.append(Group([60 + i % 50, 61, 43, 70], completions, rewards, version))
    return groups


def measure(nproc: int, steps: int, root: Path) -> dict[str, Any]:
    p = DEMO_PARAMS
    spec = {
        "model_dir": str(DEFAULT_MODEL_DIR),
        "config": {"learning_rate": p.learning_rate, "max_tokens": p.max_tokens},
        "keep_versions": p.async_level + 1,
        "pad_id": model_info(DEFAULT_MODEL_DIR).pad_id,
        "checkpoint": str(root / "trainer.ckpt"),
        "policies": str(root / "policies"),
        "threads": 1,
        "group": None,
        "nproc": nproc,
    }
    started = time.perf_counter()
    child = TrainerChild(spec)
    start_s = time.perf_counter() - started
    times = []
    try:
        for k in range(steps + 1):
            batch = demo_batch(child.version, seed=k)
            t = time.perf_counter()
            child.step(batch, child.version)
            times.append(time.perf_counter() - t)
    finally:
        child.close()
    return {
        "nproc": nproc,
        "start_s": round(start_s, 2),
        "step_s_median": round(statistics.median(times[1:]), 3),
        "step_s_all": [round(x, 3) for x in times],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.nproc:
            rows.append(measure(n, args.steps, Path(tmp) / f"n{n}"))
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "steps": args.steps,
        "runs": rows,
    }
    base = rows[0]["step_s_median"]
    table = Table(title="training child: 1 process against FSDP2 ranks (demo batch)")
    for col in ("nproc", "start s", "step s (median)", "step vs first row"):
        table.add_column(col)
    for r in rows:
        ratio = f"{r['step_s_median'] / base:.2f}" if base else "-"
        table.add_row(str(r["nproc"]), str(r["start_s"]), str(r["step_s_median"]), ratio)
    Console().print(table)
    Console().print(
        f"load average before {result['load_average_before']}, after {result['load_average_after']}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
