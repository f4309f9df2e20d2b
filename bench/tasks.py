"""Task sources: items built per second per source, the scorer's time per item, and the share
of a validator's time that held-out evaluation takes at the default cadence (issue 26).

    .venv/bin/python bench/tasks.py [--json PATH] [--gym-size 400] [--repeats 3]

- ``items_per_s``: the default suite (``task(i)``, in process), reasoning-gym (``gym.build``:
  the child process that builds with ``PYTHONHASHSEED=0``, start-up included, per data set and
  for a mix of two), a parquet data set loaded with ``datasets`` and a JSONL file (our reader).
- ``score_ms``: ``Task.reward`` per item on the reference answer and on a wrong one, per
  verifier (exact, math, and each reasoning-gym data set's own scorer); the first call of each
  scorer (building it) is outside the timing.
- ``eval_share``: one evaluation (``node.rl.evaluation.evaluate``: ``eval_size`` seeded
  completions scored on the embedded model, default genesis parameters with the demo's
  sampling) over the validator's time for the ``eval_every`` versions it covers, counted as low
  as it can be: ``submissions_per_step`` honest judgements per version (``judge`` on a demo
  submission, as ``bench/judge_cost.py``), plus the evaluation itself. A real validator judges
  more than one submission per version, so the share it sees is at most this. CPU seconds
  (``time.process_time``), medians of ``--repeats``, one thread as the compute child runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.evaluation import evaluate
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.roles.judge import JudgeContext, judge
from node.tasks import gym, hf
from node.tasks.dataset import load_dataset
from node.tasks.suite import Task, default_suite
from node.up import DEMO_PARAMS
from swarm.assignment import assign
from swarm.identity import NodeKey
from swarm.ledger import Balances
from swarm.messages import RunParams, eval_seed, sign

GYMS = ("leg_counting", "basic_arithmetic", "spell_backward", "chain_sum")
RUN = "cd" * 16
WORKER = NodeKey.from_seed(b"\x07" * 32)


def _median_cpu(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return statistics.median(times)


def _median_wall(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def items_per_s(tmp: Path, gym_size: int, repeats: int) -> dict[str, float]:
    out: dict[str, float] = {}
    suite = default_suite()
    n = 20_000
    out["default suite"] = n / _median_cpu(lambda: [suite.task(i) for i in range(n)], repeats)
    version = gym.installed_version() or "?"
    mixes = {f"reasoning-gym {name}": (name,) for name in GYMS}
    mixes["reasoning-gym leg_counting+basic_arithmetic"] = GYMS[:2]
    for label, names in mixes.items():
        spec = gym.GymSpec(version, tuple(gym.GymDataset(x) for x in names), 0, gym_size)
        # Wall time: the build runs in a child process (its CPU is not this process's).
        wall = _median_wall(lambda s=spec: gym.build(s, tmp / "items.jsonl"), repeats)
        out[label] = gym_size / wall
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(20_000)]
    import datasets

    datasets.disable_progress_bars()
    folder = tmp / "parquet"
    folder.mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(folder / "train.parquet"))
    spec_h = hf.HfSpec("parquet")
    files = [folder / "train.parquet"]
    out["datasets parquet"] = len(rows) / _median_wall(lambda: hf.load(files, spec_h), repeats)
    jsonl = tmp / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out["jsonl"] = len(rows) / _median_cpu(lambda: load_dataset(jsonl), repeats)
    return out


def score_ms(tmp: Path, repeats: int) -> dict[str, float]:
    out: dict[str, float] = {}
    exact = [Task(i, "data", 0, f"{i}+{i}=", str(2 * i)) for i in range(2000)]
    math_tasks = [
        Task(i, "data", 0, f"{i}/2=", f"\\frac{{{i}}}{{2}}", None, "math") for i in range(200)
    ]
    for label, tasks in (("exact", exact), ("math (math-verify)", math_tasks)):
        _score(tasks[:2])
        out[label] = _median_cpu(lambda t=tasks: _score(t), repeats) / len(tasks) * 1000
    version = gym.installed_version() or "?"
    for name in GYMS:
        spec = gym.GymSpec(version, (gym.GymDataset(name),), 0, 200)
        built = gym.build(spec, tmp / f"{name}.jsonl")
        source = gym.tasks_of(
            gym.GymSpec(version, spec.datasets, 0, 200, built), (tmp / f"{name}.jsonl").read_bytes()
        )
        tasks = [source.task(i) for i in range(source.size)]
        _score(tasks[:2])
        out[f"reasoning-gym {name}"] = (
            _median_cpu(lambda t=tasks: _score(t), repeats) / len(tasks) * 1000
        )
    return out


def _score(tasks: list[Task]) -> None:
    for task in tasks:
        task.reward(task.answer)
        task.reward("<answer>wrong 17</answer>")


def eval_share(repeats: int) -> dict[str, float]:
    defaults = RunParams()
    params = DEMO_PARAMS  # what a validator of the demo judges and samples with
    torch.set_num_threads(1)
    engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR)
    suite = default_suite()
    held = list(range(suite.size - defaults.eval_size, suite.size))
    seed = eval_seed(RUN, 5)
    evaluate(engine, suite, held[:2], params, seed)  # warm-up
    eval_s = _median_cpu(lambda: evaluate(engine, suite, held, params, seed), repeats)
    a = assign(
        RUN,
        3,
        WORKER.peer_id,
        0,
        n_prompts=params.batch_prompts,
        suite_size=suite.size,
        manifest_id=bytes(32) if params.quota else None,
    )
    honest = sign(
        build_submission(
            generate_groups(engine, suite, a, params), run_id=RUN, version=3, counter=0
        ),
        WORKER,
    )
    ctx = JudgeContext(
        RUN,
        params,
        suite,
        3,
        Balances(params.initial_balance, params.ban_threshold),
        {3: bytes(32)},
    )
    judge_s = _median_cpu(
        lambda: judge(honest, ctx, engine, counter_seen=False, prechecked=True), repeats
    )
    covered = defaults.eval_every * params.submissions_per_step * judge_s
    return {
        "eval_s": eval_s,
        "judge_s": judge_s,
        "eval_every": float(defaults.eval_every),
        "eval_size": float(defaults.eval_size),
        "eval_share": eval_s / (covered + eval_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--gym-size", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="bench-tasks-") as tmp:
        built = items_per_s(Path(tmp), args.gym_size, args.repeats)
        scored = score_ms(Path(tmp), args.repeats)
    share = eval_share(args.repeats)
    table = Table(title="task sources: items built per second, scorer ms per item")
    for column in ("source", "items_per_s", "score_ms"):
        table.add_column(column)
    for key, rate in built.items():
        table.add_row(key, f"{rate:,.0f}", "")
    for key, ms in scored.items():
        table.add_row(key, "", f"{ms:.4f}")
    console.print(table)
    console.print(
        f"evaluation of {share['eval_size']:.0f} items: {share['eval_s']:.3f} CPU s; one honest"
        f" judgement: {share['judge_s']:.3f} CPU s; eval_share at eval_every="
        f"{share['eval_every']:.0f}: {share['eval_share']:.4f} (goal <= 0.05)"
    )
    result = {
        "items_per_s": built,
        "score_ms": scored,
        "eval_share": share["eval_share"],
        "eval": share,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
