"""What auditing a training step costs: the replay against the step, deterministic mode against
the default, the bytes an auditor fetches, and the auditor's share at the run's audit rate.

    .venv/bin/python bench/train_audit.py [--json PATH] [--steps 8] [--model DIR] [--threads 1]

One run, the same batches throughout: ``--groups`` groups (default ``submissions_per_step *
batch_prompts``) of ``group_size`` completions of up to ``max_tokens`` random tokens, rewards
mixed in every group (all carry signal), every other group sampled by the version before (so
``logp_old`` replays an older, published version). Default ``RunParams`` for the rest
(``serve_dtype`` bfloat16). One warm-up step, then medians over ``--steps`` of per-step ratios
(paired on the same step, so a noisy machine's drift cancels):

- ``replay_over_step``: the wall time of ``ReplayChild.replay`` (model and state load, the step,
  the commitments; run as ``node.roles.training_audit`` runs it, without the trainer's state after)
  over the wall time of ``TrainerChild.step`` on the same batch (the step, the checkpoint, the
  version's file, the state file and its commitment: the trainer's real cost). Also the replay's
  own ``load_seconds + step_seconds`` over the step. Goal <= 1.2.
- ``deterministic_over_default``: ``GRPOTrainer.step`` in this process under
  ``train_state.deterministic`` over the same step with deterministic algorithms off (same
  thread count, same seed), two trainers from the same weights on the same batches, the order of
  the modes alternating per step. Goal <= 1.1. Also what the trainer now pays per step on top,
  over the deterministic step: committing (``state_of`` + ``digest``) and ``write_state``.
- ``fetch_over_model``: bytes an auditor fetches for one step (the state file before it, the
  published files of the older versions its samples came from, the next version's published
  file) over the size of one version's published file (bfloat16, header included); also over
  the float32 model (the bytes of the state's ``w/`` tensors).
- ``audit_share``: ``train_audit_share * (replay wall + fetch bytes / --link-mb-s) / step wall``.
  Goal <= 0.05. ``audit_share_replay_only`` leaves the fetch out.
- Several trainers (``--group-rounds``, on by default): two training children average each
  batch through hivemind, A on its first half, B on the rest, and each round is audited as
  ``node.roles.training_audit`` audits it. ``averaging_update_error`` (the largest over the rounds):
  ``update_error`` of the publisher's state after against the averaging replayed from the
  members' committed gradients, the honest spread the tolerance is set against (hivemind's
  all-reduce sums in its own order); ``member_replay_bit_exact``: every member's gradient
  replays from its samples to its commitment, and every served gradient is its commitment;
  ``round_audit_over_step``: the averaging replay plus one member's gradient replay (what a
  validator does for a round) over the round's wall time (its slower member).
- ``replay_bit_exact``: every replay's state after has the trainer's commitment;
  ``update_error_threads``: ``update_error`` of the last step replayed with another thread count
  (1 against 2): the honest spread across reduction orders.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.compute.groups import Group
from node.compute.grpo import GRPOConfig, GRPOTrainer
from node.compute.train_child import ReplayChild, TrainerChild, tied_copies, tokenize_prompts
from node.compute.train_state import deterministic, digest, read_state, state_of, write_state
from node.model import DEFAULT_MODEL_DIR, load_causal_lm, model_info
from node.model.text import ModelText
from swarm.messages.run import RunParams

WORDS = ("what", "is", "seven", "times", "eight", "plus", "two", "sum", "of", "the", "list")
GOALS = {"replay_over_step": 1.2, "deterministic_over_default": 1.1, "audit_share": 0.05}


def batch(version: int, seed: int, groups: int, size: int, max_tokens: int) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for i in range(groups):
        completions = [
            [rng.randrange(256) for _ in range(rng.randint(max_tokens // 4, max_tokens))]
            for _ in range(size)
        ]
        rewards = [1.0, 0.0] + [float(rng.random() < 0.5) for _ in range(size - 2)]
        text = f"q {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(6)) + "?"
        out.append(Group([], completions, rewards, max(0, version - i % 2), text=text))
    return out


def train_and_replay(
    root: Path, model: Path, config: dict[str, Any], batches: list[list[Group]], threads: int
) -> dict[str, Any]:
    """Step the trainer child on each batch, replay each step at once in a replay child."""
    common = {"model_dir": str(model), "config": config, "serve_dtype": "bfloat16"}
    common["pad_id"] = model_info(model).pad_id
    files = {k: str(root / k) for k in ("checkpoint", "policies", "states")}
    spec = {"keep_versions": 3, "state_keep": len(batches) + 2, "threads": threads, "group": None}
    child = TrainerChild({**common, **files, **spec})
    replayer = ReplayChild()
    rows: list[dict[str, Any]] = []
    try:
        for parent, groups in enumerate(batches):
            started = time.perf_counter()
            out = child.step(groups, parent, seed=1000 + parent)
            stepped = time.perf_counter()
            old = {g.version for g in groups} - {parent}
            args = {
                **common,
                "chat_template": False,
                "threads": out["state"]["threads"],
                "seed": out["state"]["seed"],
                "parent": parent,
                "groups": [g.to_wire() for g in groups],
                "state": str(root / "states" / f"s{parent}.safetensors"),
                "old": {str(v): str(root / "policies" / f"v{v}.safetensors") for v in old},
                "published": out["weights"],
            }
            got = replayer.replay(args)
            replayed = time.perf_counter()
            fetched = [Path(args["state"]), *map(Path, args["old"].values()), Path(out["weights"])]
            rows.append(
                {
                    "step_s": stepped - started,
                    "replay_s": replayed - stepped,
                    "replay_inner_s": got["load_seconds"] + got["step_seconds"],
                    "exact": got["after"] == out["state"]["after"],
                    "fetch_bytes": sum(p.stat().st_size for p in fetched),
                    "model_bytes": Path(out["weights"]).stat().st_size,
                }
            )
        after = root / "states" / f"s{len(batches)}.safetensors"
        other = 2 if threads == 1 else 1
        spread = replayer.replay({**args, "threads": other, "after": str(after)})
        w32 = sum(t.nbytes for k, t in read_state(after).items() if k.startswith("w/"))
    finally:
        replayer.close()
        child.close()
    return {"rows": rows[1:], "update_error": spread["update_error"], "fp32_bytes": w32}


def group_rounds(
    root: Path, model: Path, config: dict[str, Any], batches: list[list[Group]]
) -> dict[str, Any]:
    """Two training children average each batch through hivemind (A takes the first half, B
    the rest); each round is audited as ``node.roles.training_audit`` audits it: the averaging
    replayed from both committed gradients, then each member's gradient from its samples."""
    import threading

    from swarm.identity import NodeKey
    from swarm.messages import GradientCommitment, decode, gradient_file

    common = {"model_dir": str(model), "config": config, "serve_dtype": "bfloat16"}
    common["pad_id"] = model_info(model).pad_id

    def spec(name: str) -> dict[str, Any]:
        files = {k: str(root / name / k) for k in ("checkpoint", "policies", "states")}
        group = {"peer": name, "run_id": "bench", "host": "127.0.0.1", "trainers": 2}
        group["key"] = NodeKey.generate().seed
        extra = {"keep_versions": 3, "state_keep": len(batches) + 2, "threads": 1}
        return {**common, **files, **extra, "group": group}

    children = {"A": TrainerChild(spec("A")), "B": TrainerChild(spec("B"))}
    replayer = ReplayChild()
    rows: list[dict[str, Any]] = []
    try:
        children["B"].connect(children["A"].hivemind_addrs)
        for parent, groups in enumerate(batches):
            half = len(groups) // 2
            mine = {"A": groups[:half], "B": groups[half:]}
            out: dict[str, dict[str, Any]] = {}
            took: dict[str, float] = {}

            def step(
                name: str, parent: int = parent, mine: Any = mine, out: Any = out, took: Any = took
            ) -> None:
                started = time.perf_counter()
                cited = [(os.urandom(32), g.version) for g in mine[name]]
                out[name] = children[name].step(mine[name], parent, 7, cited=cited)
                took[name] = time.perf_counter() - started

            threads = [threading.Thread(target=step, args=(n,)) for n in children]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            rnd = out["A"]["round"]
            publisher = str(rnd["publisher"])
            commits = {n: decode(rnd["commitments"][n], GradientCommitment) for n in children}
            states = {n: root / n / "states" for n in children}
            args = {
                **common,
                "chat_template": False,
                "threads": 1,
                "seed": 7,
                "parent": parent,
            }
            started = time.perf_counter()
            averaged = replayer.average(
                {
                    **args,
                    "state": str(states[publisher] / f"s{parent}.safetensors"),
                    "members": [
                        {
                            "path": str(
                                states[n] / gradient_file(parent + 1, commits[n].message.gradient)
                            ),
                            "samples": commits[n].message.samples,
                        }
                        for n in children
                    ],
                    "after": str(states[publisher] / f"s{parent + 1}.safetensors"),
                    "published": out[publisher]["weights"],
                }
            )
            averaged_s = time.perf_counter() - started
            member: dict[str, float] = {}
            exact = True
            for name in children:
                started = time.perf_counter()
                got = replayer.gradient(
                    {
                        **args,
                        # Its own older versions: B never adopts A's copy here, as a member of
                        # a swarm does (its copy of v-1 is then the published one).
                        "old": {
                            str(v): str(root / name / "policies" / f"v{v}.safetensors")
                            for v in {g.version for g in mine[name]} - {parent}
                        },
                        "groups": [g.to_wire() for g in mine[name]],
                        "state": str(states[name] / f"s{parent}.safetensors"),
                        "theirs": str(
                            states[name] / gradient_file(parent + 1, commits[name].message.gradient)
                        ),
                    }
                )
                member[name] = time.perf_counter() - started
                exact &= got["gradient"] == commits[name].message.gradient
            rows.append(
                {
                    "members": len(rnd["members"]),
                    "update_error": averaged["update_error"],
                    "commitments_match": averaged["gradients"]
                    == [commits[n].message.gradient for n in children],
                    "exact": exact,
                    "step_s": max(took.values()),
                    "average_s": averaged_s,
                    "member_s": statistics.median(member.values()),
                }
            )
    finally:
        replayer.close()
        for child in children.values():
            child.close()
    return {"rows": rows[1:]}


def modes(
    root: Path, model: Path, config: GRPOConfig, batches: list[list[Group]], threads: int
) -> list[dict[str, float]]:
    """Time ``GRPOTrainer.step`` deterministic and default, alternating; then the commitment
    and the state file after the deterministic step."""
    base = load_causal_lm(model, dtype="float32")
    pad = model_info(model).pad_id
    det, default = (
        GRPOTrainer(copy.deepcopy(base), config, pad_id=pad, serve_dtype="bfloat16")
        for _ in range(2)
    )
    tied = tied_copies(base)
    text = ModelText(model)
    rows = []
    for parent, groups in enumerate(batches):
        tokens = tokenize_prompts(groups, text)
        seconds = {}
        order = ("det", "default") if parent % 2 else ("default", "det")
        for mode in order:
            if mode == "det":
                deterministic(threads, 1000 + parent)
            else:
                torch.use_deterministic_algorithms(False)
                torch.set_num_threads(threads)
                torch.manual_seed(1000 + parent)
            started = time.perf_counter()
            (det if mode == "det" else default).step(tokens)
            seconds[mode] = time.perf_counter() - started
        started = time.perf_counter()
        state = state_of(det.model, det.optimizer, tied)
        digest(state)
        committed = time.perf_counter()
        write_state(root / "inproc" / f"s{parent + 1}.safetensors", state, parent + 1)
        written = time.perf_counter()
        seconds["commit"] = committed - started
        seconds["write"] = written - committed
        rows.append(seconds)
    torch.use_deterministic_algorithms(False)
    return rows[1:]


def median(rows: list[dict[str, Any]], key: str, over: str | None = None) -> float:
    return statistics.median(r[key] / r[over] if over else r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--threads", type=int, default=1, help="the trainer's thread count")
    p = RunParams()
    parser.add_argument("--groups", type=int, default=p.submissions_per_step * p.batch_prompts)
    parser.add_argument("--link-mb-s", type=float, default=100.0, help="auditor's fetch rate")
    parser.add_argument(
        "--group-rounds",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also two trainers averaging through hivemind, each round audited",
    )
    args = parser.parse_args()
    config = GRPOConfig.from_params(p)
    batches = [
        batch(v, seed=v + 3, groups=args.groups, size=p.group_size, max_tokens=p.max_tokens)
        for v in range(args.steps + 1)
    ]
    with tempfile.TemporaryDirectory(prefix="train-audit-") as tmp:
        root = Path(tmp)
        child = train_and_replay(
            root, args.model, dataclasses.asdict(config), batches, args.threads
        )
        inproc = modes(root, args.model, config, batches, args.threads)
        rounds = (
            group_rounds(root / "group", args.model, dataclasses.asdict(config), batches)["rows"]
            if args.group_rounds
            else []
        )
    rows = child["rows"]
    for r in rows:
        r["with_fetch_s"] = r["replay_s"] + r["fetch_bytes"] / (args.link_mb_s * 1e6)
    step_s = median(rows, "step_s")
    figures = {
        "replay_over_step": median(rows, "replay_s", "step_s"),
        "deterministic_over_default": median(inproc, "det", "default"),
        "fetch_over_model": median(rows, "fetch_bytes", "model_bytes"),
        "audit_share": p.train_audit_share * median(rows, "with_fetch_s", "step_s"),
        "replay_bit_exact": all(r["exact"] for r in rows),
        "update_error_threads": child["update_error"],
    }
    if rounds:
        figures["averaging_update_error"] = max(r["update_error"] for r in rounds)
        figures["member_replay_bit_exact"] = all(
            r["exact"] and r["commitments_match"] for r in rounds
        )
        figures["round_audit_over_step"] = median(
            [{**r, "audit_s": r["average_s"] + r["member_s"]} for r in rounds], "audit_s", "step_s"
        )
    details = {
        "replay_inner_over_step": median(rows, "replay_inner_s", "step_s"),
        "commit_over_step": median(inproc, "commit", "det"),
        "write_state_over_step": median(inproc, "write", "det"),
        "fetch_over_model_fp32": median(rows, "fetch_bytes") / child["fp32_bytes"],
        "audit_share_replay_only": p.train_audit_share * figures["replay_over_step"],
        "seconds": {
            "trainer_step": step_s,
            "replay_call": median(rows, "replay_s"),
            "replay_load_and_step": median(rows, "replay_inner_s"),
            "grpo_step_deterministic": median(inproc, "det"),
            "grpo_step_default": median(inproc, "default"),
            "commit": median(inproc, "commit"),
            "write_state": median(inproc, "write"),
        },
        "bytes": {
            "fetch_per_step": median(rows, "fetch_bytes"),
            "model_bf16_file": median(rows, "model_bytes"),
            "model_fp32": child["fp32_bytes"],
        },
        "steps": args.steps,
        "groups": args.groups,
        "group_size": p.group_size,
        "max_tokens": p.max_tokens,
        "threads": args.threads,
        "train_audit_share": p.train_audit_share,
        "link_mb_s": args.link_mb_s,
        "model": str(args.model),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
        },
        "command": " ".join(sys.argv),
    }
    table = Table(title=f"training audit, medians of {args.steps} steps ({args.model.name})")
    for column in ("figure", "value", "goal", "met"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    extra = ("replay_inner_over_step", "commit_over_step", "write_state_over_step")
    extra += ("fetch_over_model_fp32", "audit_share_replay_only")
    for name, value in {**figures, **{k: details[k] for k in extra}}.items():
        goal = GOALS.get(name)
        met = "" if goal is None else ("yes" if value <= goal else "NO")
        cell = str(value) if isinstance(value, bool) else f"{value:.4g}"
        table.add_row(name, cell, "" if goal is None else f"<= {goal:g}", met)
    for name in ("trainer_step", "replay_call", "grpo_step_deterministic"):
        table.add_row(f"{name} s", f"{details['seconds'][name]:.3g}", "", "")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({**figures, **details}, indent=2) + "\n")


if __name__ == "__main__":
    main()
