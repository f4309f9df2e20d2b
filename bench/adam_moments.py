"""Do a group's trainers need their Adam moments averaged? (issue 13)

    .venv/bin/python bench/adam_moments.py [--json PATH] [--warmup K] [--after N]

In a group every member steps its own AdamW on the *same* averaged gradient from the *same*
adopted weights, so members that were there all along hold the same moments (up to float
noise), and averaging them each round would send twice the model's bytes again for nothing.
They differ only for a trainer that restarted (its checkpoint's moments are older) or joined
(zero moments). This measures how far such a trainer's update is from the one the group's
continuous optimizer makes, on the same gradients (in process, the embedded model, the run's
AdamW settings):

- ``same``: a second continuous trainer (same history): ``|dA - dB| / |dA|`` per step;
- ``fresh``: a trainer that joined with zero moments after ``--warmup`` steps, adopting the
  publisher's weights after each step as members do, for ``--after`` steps;
- ``restarted``: one whose moments are ``--warmup`` / 2 steps old.

A large relative difference for the first steps after a join means the policy's trajectory
depends on who publishes; it decays as the joiner's moments fill with the shared gradients.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from node.compute.groups import Group
from node.compute.grpo import GRPOConfig, GRPOTrainer
from node.model import DEFAULT_MODEL_DIR, load_causal_lm, model_info
from node.up import DEMO_PARAMS


def batch(version: int, seed: int) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for _ in range(4):
        prompt = [rng.randrange(40, 120) for _ in range(6)]
        completions = [[rng.randrange(40, 120) for _ in range(8)] for _ in range(4)]
        groups.append(Group(prompt, completions, [rng.random() for _ in range(4)], version))
    return groups


def trainer(model: Any) -> GRPOTrainer:
    p = DEMO_PARAMS
    config = GRPOConfig(
        learning_rate=p.learning_rate,
        clip_epsilon=p.clip_epsilon,
        clip_delta=p.clip_delta,
        entropy_coef=p.entropy_coef,
        kl_coef=p.kl_coef,
        max_grad_norm=p.max_grad_norm,
        max_tokens=p.max_tokens,
    )
    return GRPOTrainer(model, config, pad_id=model_info(DEFAULT_MODEL_DIR).pad_id)


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten().float() for v in state.values()])


def update_gap(a: GRPOTrainer, b: GRPOTrainer, seed: int) -> float:
    """Both at the same weights and version: step each on the same batch; how far apart are
    the updates? Then ``b`` adopts ``a``'s weights (a member loads the publisher's copy)."""
    before = flat(a.weights())
    a.step(batch(a.version, seed))
    b.step(batch(b.version, seed))
    da, db = flat(a.weights()) - before, flat(b.weights()) - before
    b.load_version(a.version, {k: v.clone() for k, v in a.weights().items()})
    return float((da - db).norm() / da.norm())


def run(warmup: int, after: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = load_causal_lm(DEFAULT_MODEL_DIR, dtype="float32")
    a = trainer(copy.deepcopy(base))
    same = trainer(copy.deepcopy(base))
    snapshot = None
    for i in range(warmup):
        update_gap(a, same, seed=i)
        if i == warmup // 2:
            snapshot = copy.deepcopy(same.optimizer.state_dict())
    fresh = trainer(copy.deepcopy(base))
    fresh.load_version(a.version, {k: v.clone() for k, v in a.weights().items()})
    restarted = trainer(copy.deepcopy(base))
    restarted.load_version(a.version, {k: v.clone() for k, v in a.weights().items()})
    restarted.optimizer.load_state_dict(snapshot)
    rows: dict[str, list[float]] = {"same": [], "fresh": [], "restarted": []}
    for j in range(after):
        seed = 1000 + j
        # Each follower is compared with its own copy of the group's continuous optimizer.
        for name, follower in (("same", same), ("fresh", fresh), ("restarted", restarted)):
            lead = copy.deepcopy(a)
            rows[name].append(update_gap(lead, follower, seed))
        a.step(batch(a.version, seed))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--after", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(args.warmup, args.after)
    table = Table(title=f"|dA - dB| / |dA| after {args.warmup} shared steps (AdamW, same grads)")
    table.add_column("step after")
    for name in rows:
        table.add_column(name, justify="right")
    for j in range(args.after):
        table.add_row(str(j + 1), *(f"{rows[n][j]:.2e}" for n in rows))
    Console().print(table)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "warmup": args.warmup,
                    "relative_update_gap": rows,
                    "machine": platform.platform(),
                    "load_average": os.getloadavg(),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
