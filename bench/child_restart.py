"""How long each role's child takes to come back after kill -9 (issue 28).

    .venv/bin/python bench/child_restart.py [--model DIR] [--rounds 3] [--json PATH]

- **Engine child** (a worker's and a validator's, ``node.compute.child``): weights of a held
  version loaded, then kill -9; ``noticed_s`` is the next call's ``EngineError`` after the kill,
  ``restart_s`` is ``restart()`` (a fresh child loads the model and the held weights again),
  ``first_call_s`` the first generation on it.
- **Training child** (a trainer's, ``node.compute.train_child``): after two steps, so it holds a
  checkpoint, its versions' weights and training states; kill -9, then a fresh child loads the
  checkpoint (``restart_s``, what ``Trainer.restart`` does) and steps again (``first_call_s``).

The healer's backoff (1, 2, 4 s; ``EngineHealer``) comes on top: it is a policy, not a cost.
Prints a table and writes JSON: ``engine_child_restart_s``, ``training_child_restart_s`` (the
medians) and every round.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_audit import batch
from node.compute.child import ChildEngine
from node.compute.train_child import TrainerChild
from node.model import DEFAULT_MODEL_DIR, model_info
from swarm.errors import EngineError

CONFIG = {"learning_rate": 1e-4, "max_tokens": 16}


def killed(pid: int | None, call: Any) -> float:
    """kill -9 ``pid``, then seconds until ``call`` raises ``EngineError``."""
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    started = time.perf_counter()
    try:
        call()
    except EngineError:
        return time.perf_counter() - started
    raise AssertionError("a call on a killed child succeeded")


def engine_rounds(model: Path, rounds: int) -> list[dict[str, float]]:
    engine = ChildEngine(model, threads=1)
    try:
        engine.load_weights(str(model / "model.safetensors"))
        prompt = engine.encode_prompts(["what is 2 + 2?"])

        def generate() -> Any:
            return engine.generate(prompt, [1], 1.0, 8)

        generate()
        out = []
        for _ in range(rounds):
            noticed = killed(engine.pid, generate)
            started = time.perf_counter()
            engine.restart()
            restarted = time.perf_counter()
            generate()
            out.append(
                {
                    "noticed_s": noticed,
                    "restart_s": restarted - started,
                    "first_call_s": time.perf_counter() - restarted,
                }
            )
        return out
    finally:
        engine.close()


def training_rounds(model: Path, rounds: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="child-restart-") as tmp:
        root = Path(tmp)
        spec = {
            "model_dir": str(model),
            "config": CONFIG,
            "serve_dtype": "float32",
            "pad_id": model_info(model).pad_id,
            "keep_versions": 3,
            "threads": 1,
            "group": None,
            **{k: str(root / k) for k in ("checkpoint", "policies", "states")},
        }
        child = TrainerChild(spec)
        out = []
        try:
            for v in range(2):
                child.step(batch(v, v, 2, 4, 16), v, seed=v)
            for _ in range(rounds):
                version = child.version
                noticed = killed(child.pid, child.status)
                child.close()
                started = time.perf_counter()
                child = TrainerChild(spec)  # what Trainer.restart does
                restarted = time.perf_counter()
                assert child.version == version, (child.version, version)
                child.step(batch(version, version, 2, 4, 16), version, seed=version)
                out.append(
                    {
                        "noticed_s": noticed,
                        "restart_s": restarted - started,
                        "first_call_s": time.perf_counter() - restarted,
                    }
                )
        finally:
            child.close()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {
        "engine child (worker, validator)": engine_rounds(args.model, args.rounds),
        "training child (trainer)": training_rounds(args.model, args.rounds),
    }
    table = Table(title=f"kill -9, then back ({args.rounds} rounds, medians; {args.model.name})")
    for col in ("child", "noticed s", "restart s", "first call s"):
        table.add_column(col)
    for name, rows in results.items():
        table.add_row(
            name,
            *(
                f"{statistics.median(r[k] for r in rows):.2f}"
                for k in ("noticed_s", "restart_s", "first_call_s")
            ),
        )
    Console().print(table)
    if args.json:
        medians = {
            name: statistics.median(r["restart_s"] for r in rows) for name, rows in results.items()
        }
        engine, training = medians.values()
        args.json.write_text(
            json.dumps(
                {
                    "engine_child_restart_s": engine,
                    "training_child_restart_s": training,
                    "model": str(args.model),
                    "rounds": results,
                    "cpus": os.cpu_count(),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
