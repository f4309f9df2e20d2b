"""Benchmark: does plain in-process GRPO learn on the embedded default model and task suite (CPU)?

    .venv/bin/python bench/rl_inprocess.py [--json PATH] [--minutes 3] [--lr 2e-4]
        [--group-size 8] [--batch-prompts 16] [--max-tokens 12] [--max-grad-norm 0.1]
        [--serve-dtype bfloat16|float32] [--versions N] [--run-id inprocess]

Runs :func:`node.rl.inprocess.train_inprocess` (one policy version per GRPO step, no network,
no proofs) for ``--minutes`` of wall time (or ``--versions`` steps, whichever comes first) and
reports:
  start / end     greedy and sampled (T = 1) reward per family on held-out tasks
                  (ids 90,000 + k, --eval-per-family per family, seeded, not used in training)
  reward_by_version  mean sampled reward of each version's own training batch
  seconds_and_version_to  wall seconds and version at which the trailing mean
                  (--window versions) of the batch reward first stands +0.1 / +0.2 / +0.3
                  above the start's held-out sampled mean
  params          the RunParams used (defaults here are the recommended demo set)
  reward_by_range mean batch reward per range of --window versions (0-24, 25-49, ...)
Rollouts come from each version as served (``--serve-dtype``, the genesis default when not
given): float32 masters rounded through it, loaded into the float32 CPU engine as a worker
loads the published file. The end evaluation runs the last version as served too.
Prints a table last. One torch thread by default: on two shared, oversubscribed cores two
threads ran up to 10x slower per version than one (the model is tiny; threads contend).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.compute.grpo import served_weights
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.model import tokenizer as tok
from node.rl.inprocess import VersionResult, train_inprocess
from node.tasks import default_suite
from node.tasks.suite import TaskSuite
from swarm.messages import RunParams

EVAL_BASE = 90_000
EVAL_SEED = 5


def evaluate(
    engine: TorchEngine, suite: TaskSuite, per_family: int, temperature: float, max_tokens: int
) -> dict[str, float]:
    """Mean reward per ``family+level`` (and ``mean``) on held-out tasks."""
    n = len(suite.mix)
    ids = [EVAL_BASE + i for i in range(per_family * n)]
    tasks = [suite.task(i) for i in ids]
    engine.model.eval()
    gens = engine.generate(
        [tok.encode(t.prompt) for t in tasks],
        [EVAL_SEED] * len(tasks),
        temperature,
        max_tokens,
        sample_indices=list(range(len(tasks))),
    )
    per: dict[str, list[float]] = {}
    for t, g in zip(tasks, gens, strict=True):
        per.setdefault(f"{t.family}{t.level}", []).append(t.reward(tok.decode(g.tokens)))
    out = {k: round(sum(v) / len(v), 3) for k, v in per.items()}
    out["mean"] = round(sum(sum(v) for v in per.values()) / len(tasks), 3)
    return out


def reached(
    results: list[VersionResult], base: float, gains: list[float], window: int
) -> dict[str, list[float] | None]:
    """``{"+0.1": [seconds, version], ...}``: first time the trailing mean passes base + gain."""
    out: dict[str, list[float] | None] = {f"+{g:.1f}": None for g in gains}
    for i in range(window - 1, len(results)):
        trailing = sum(r.mean_reward for r in results[i - window + 1 : i + 1]) / window
        for g in gains:
            key = f"+{g:.1f}"
            if out[key] is None and trailing >= base + g:
                out[key] = [round(results[i].elapsed_s, 1), results[i].version]
    return out


def by_range(results: list[VersionResult], width: int) -> dict[str, float]:
    """``{"0-24": mean batch reward of versions 0..24, ...}`` (the last range may be short)."""
    out = {}
    for lo in range(0, len(results), width):
        part = results[lo : lo + width]
        key = f"{part[0].version}-{part[-1].version}"
        out[key] = round(sum(r.mean_reward for r in part) / len(part), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="In-process GRPO on the embedded default model")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--max-grad-norm", type=float, default=0.1)
    ap.add_argument("--eval-per-family", type=int, default=100)
    ap.add_argument("--window", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--serve-dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--versions", type=int, default=1_000_000)
    ap.add_argument("--run-id", default="inprocess", help="assignments and seeds derive from it")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    suite = default_suite()
    params = RunParams(
        learning_rate=args.lr,
        group_size=args.group_size,
        batch_prompts=args.batch_prompts,
        max_tokens=args.max_tokens,
        max_grad_norm=args.max_grad_norm,
        **({"serve_dtype": args.serve_dtype} if args.serve_dtype else {}),
    )
    engine = TorchEngine.from_dir(args.model, dtype="float32")
    ev = args.eval_per_family, args.max_tokens
    start = {
        "greedy": evaluate(engine, suite, ev[0], 0.0, ev[1]),
        "sampled": evaluate(engine, suite, ev[0], params.temperature, ev[1]),
    }
    print(f"start greedy {start['greedy']}\nstart sampled {start['sampled']}", flush=True)

    every = max(1, args.window)

    def progress(r: VersionResult) -> None:
        if r.version % every == 0:
            print(f"v{r.version} {r.elapsed_s:6.1f}s batch reward {r.mean_reward:.3f}", flush=True)

    t0 = time.perf_counter()
    results = train_inprocess(
        params,
        steps=args.versions,
        model_dir=args.model,
        suite=suite,
        run_id=args.run_id,
        time_limit_s=args.minutes * 60,
        on_version=progress,
        engine=engine,
    )
    wall = time.perf_counter() - t0
    # The policy as served (workers, inference): the masters rounded through serve_dtype.
    engine.model.load_state_dict(served_weights(engine.model.state_dict(), params.serve_dtype))
    end = {
        "greedy": evaluate(engine, suite, ev[0], 0.0, ev[1]),
        "sampled": evaluate(engine, suite, ev[0], params.temperature, ev[1]),
    }
    w = min(args.window, len(results))
    first = sum(r.mean_reward for r in results[:w]) / w
    last = sum(r.mean_reward for r in results[-w:]) / w
    base = start["sampled"]["mean"]
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), torch threads"
        f" {args.threads}, torch {torch.__version__}",
        "model": str(args.model),
        "suite_mix": [f"{f}{lv}" for f, lv in suite.mix],
        "params": {k: v for k, v in params.to_wire().items() if k in _REPORTED},
        "minutes": args.minutes,
        "wall_s": round(wall, 1),
        "versions": len(results),
        "start": start,
        "end": end,
        "batch_reward_first_window": round(first, 3),
        "batch_reward_last_window": round(last, 3),
        "seconds_and_version_to": reached(results, base, [0.1, 0.2, 0.3], w),
        "reward_by_range": by_range(results, every),
        "reward_by_version": [[r.version, round(r.elapsed_s, 2), r.mean_reward] for r in results],
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    fams = [k for k in start["greedy"] if k != "mean"] + ["mean"]
    print(f"\n{'':22}" + "".join(f"{f:>7}" for f in fams))
    for when, res in (("start", start), ("end", end)):
        for kind in ("greedy", "sampled"):
            print(f"{when + ' ' + kind:22}" + "".join(f"{res[kind][f]:7.3f}" for f in fams))
    print(f"versions {len(results)} in {wall:.0f}s; batch reward, first {w}: {first:.3f}")
    print(f"batch reward, last {w} versions: {last:.3f}")
    print(f"[seconds, version] at which the trailing-{w} batch reward first reached the start's")
    print(f"held-out sampled mean + gain: {report['seconds_and_version_to']}")
    print(f"serve_dtype {params.serve_dtype}; batch reward by range: {report['reward_by_range']}")


_REPORTED = (
    "serve_dtype",
    "learning_rate",
    "group_size",
    "batch_prompts",
    "max_tokens",
    "max_grad_norm",
    "temperature",
    "entropy_coef",
    "clip_epsilon",
    "clip_delta",
)

if __name__ == "__main__":
    main()
