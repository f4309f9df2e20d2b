"""The engine's cost of one judgement, honest work and well-formed garbage, with the staged check
(a slice of 8 samples first) and with every sample checked at once, as before (issue 15).

    .venv/bin/python bench/judge_cost.py [--json PATH] [--repeats 7]

The demo parameters (16 prompts x 8 samples, 12 tokens), the embedded model in this process on
one thread (as the compute child runs it on a CPU), ``judge(...)`` with the precheck done.
Garbage is what ``tests/flood.py`` sends: the real assignment with random tokens and proofs.
CPU seconds (``time.process_time``: what the judgement takes from the machine's cores, not the
wall time, which other processes' load stretches), the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.roles import judge as judge_module
from node.roles.judge import JudgeContext, judge
from node.tasks.suite import default_suite
from node.up import DEMO_PARAMS as P
from swarm.assignment import assign
from swarm.identity import NodeKey
from swarm.ledger import Balances
from swarm.messages import RolloutSubmission, sign
from swarm.toploc import CHUNK_SIZE, proof_size

RUN = "ab" * 16
WORKER = NodeKey.from_seed(b"\x05" * 32)
MANIFEST = bytes(32)
"""Policy v3's manifest id (the assignment of a run with a quota mixes it)."""


def garbage(sub: RolloutSubmission, rng: random.Random) -> RolloutSubmission:
    chunks = -(-P.max_tokens // CHUNK_SIZE)
    samples = tuple(
        dataclasses.replace(
            s,
            tokens=tuple(rng.randrange(3, 256) for _ in range(P.max_tokens)),
            proofs=tuple(rng.randbytes(proof_size()) for _ in range(chunks)),
            finish_reason="length",
        )
        for s in sub.samples
    )
    return dataclasses.replace(sub, samples=samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    suite = default_suite()
    engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR)
    a = assign(
        RUN,
        3,
        WORKER.peer_id,
        0,
        n_prompts=P.batch_prompts,
        suite_size=suite.size,
        manifest_id=MANIFEST if P.quota else None,
    )
    honest = build_submission(
        generate_groups(engine, suite, a, P), run_id=RUN, version=3, counter=0
    )
    ctx = JudgeContext(
        RUN, P, suite, 3, Balances(P.initial_balance, P.ban_threshold), {3: MANIFEST}
    )
    rng = random.Random(0)
    staged = judge_module.slice_of
    modes = {"staged": staged, "whole": lambda _id, n: list(range(n))}
    times: dict[str, list[float]] = {}
    outcome: dict[str, str] = {}
    for _ in range(args.repeats):
        work = {"honest": sign(honest, WORKER), "garbage": sign(garbage(honest, rng), WORKER)}
        for mode, pick in modes.items():
            judge_module.slice_of = pick  # type: ignore[assignment]
            for kind, signed in work.items():
                started = time.process_time()
                j = judge(signed, ctx, engine, counter_seen=False, prechecked=True)
                times.setdefault(f"{kind} {mode}", []).append(time.process_time() - started)
                outcome[f"{kind} {mode}"] = (
                    "accepted"
                    if j.accepted
                    else f"{j.severity}, {j.metrics.get('samples')} checked"
                )
    judge_module.slice_of = staged
    result = {key: statistics.median(v) for key, v in times.items()}
    table = Table(title=f"one judgement ({len(honest.samples)} samples), CPU s, median")
    for column in ("work", "check", "CPU s", "outcome"):
        table.add_column(column)
    for key, cpu in result.items():
        kind, mode = key.split()
        table.add_row(kind, mode, f"{cpu:.4f}", outcome[key])
    Console(stderr=True).print(table)
    if args.json:
        args.json.write_text(json.dumps({"cpu_s": result, "outcome": outcome}, indent=2))


if __name__ == "__main__":
    main()
