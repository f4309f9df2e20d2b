"""A plain in-process GRPO loop: same model, tasks, batch and recipe as the swarm, but no network,
no proofs and no validator. It is the ceiling the swarm is measured against (bench/rl_loop.py),
and a quick way to check that a model and task mix leave RL something to learn.

Rollouts come from each version *as served*: with ``params.serve_dtype`` other than float32, the
trainer's float32 masters are written in that dtype and loaded into a float32 generation engine,
as a CPU worker loads the published file (``load_weights_into``); with float32 the trained model
generates itself (the same weights)."""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from node.compute.groups import Group
from node.compute.grpo import GRPOConfig, GRPOTrainer, StepStats, served_weights
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.rollout import generate_groups, score_samples
from node.tasks.suite import TaskSuite, default_suite
from swarm.assignment import assign
from swarm.messages import RunParams


@dataclass(frozen=True)
class VersionResult:
    version: int
    mean_reward: float
    elapsed_s: float
    stats: StepStats | None


def train_inprocess(
    params: RunParams,
    *,
    steps: int,
    model_dir: Path = DEFAULT_MODEL_DIR,
    suite: TaskSuite | None = None,
    run_id: str = "inprocess",
    time_limit_s: float | None = None,
    on_version: Callable[[VersionResult], None] | None = None,
    engine: TorchEngine | None = None,
) -> list[VersionResult]:
    """Train for ``steps`` versions; one result per version with the mean reward of its samples.

    ``engine`` (float32, e.g. ``TorchEngine.from_dir(model_dir)``) is trained in place when
    given, so the caller can evaluate the final policy (its float32 masters: round them through
    ``served_weights`` for the policy as served); otherwise one is loaded from ``model_dir``.
    Rollouts are generated from each version as served (``params.serve_dtype``)."""
    suite = suite or default_suite()
    engine = engine or TorchEngine.from_dir(model_dir, dtype="float32")
    trainer = GRPOTrainer(
        engine.model,
        GRPOConfig.from_params(params),
        keep_versions=params.async_level + 1,
        pad_id=engine.info.pad_id,
        serve_dtype=params.serve_dtype,
    )
    with tempfile.TemporaryDirectory(prefix="inprocess-") as tmp:
        served = _ServedPolicy(engine, trainer, params.serve_dtype, Path(tmp))
        return _loop(params, steps, suite, run_id, time_limit_s, on_version, trainer, served)


class _ServedPolicy:
    """The engine that generates: each version as a worker runs it."""

    def __init__(
        self, engine: TorchEngine, trainer: GRPOTrainer, serve_dtype: str, tmp: Path
    ) -> None:
        self.trainer, self.serve_dtype, self.file = trainer, serve_dtype, tmp / "policy.safetensors"
        if serve_dtype == "float32":
            self.engine = engine
            return
        info = engine.info
        self.engine = TorchEngine(
            copy.deepcopy(engine.model),
            eos_id=info.eos_id,
            pad_id=info.pad_id,
            text=engine.text,
            eos_ids=info.eos_ids,
        )
        self.load()

    def load(self) -> None:
        """After a step: the new version, written in ``serve_dtype`` and loaded (a worker)."""
        from safetensors.torch import save_file

        self.trainer.model.eval()
        if self.engine.model is self.trainer.model:
            return
        save_file(served_weights(self.trainer.weights(), self.serve_dtype), str(self.file))
        self.engine.load_weights(str(self.file))


def _loop(
    params: RunParams,
    steps: int,
    suite: TaskSuite,
    run_id: str,
    time_limit_s: float | None,
    on_version: Callable[[VersionResult], None] | None,
    trainer: GRPOTrainer,
    served: _ServedPolicy,
) -> list[VersionResult]:
    engine = served.engine
    results: list[VersionResult] = []
    start = time.perf_counter()
    for _ in range(steps + 1):
        version = trainer.version
        assignment = assign(
            run_id,
            version,
            "inprocess",
            0,
            n_prompts=params.batch_prompts,
            suite_size=suite.size,
            excluded=suite.excluded,
        )
        rollout = generate_groups(engine, suite, assignment, params)
        g = params.group_size
        flat = [gen.tokens for gens in rollout.generations for gen in gens]
        pids = [pid for pid in assignment.prompt_ids for _ in range(g)]
        flat_rewards = score_samples(engine, suite, pids, flat, params)
        groups = [
            Group(prompt, flat[i * g : (i + 1) * g], flat_rewards[i * g : (i + 1) * g], version)
            for i, prompt in enumerate(rollout.prompts)
        ]
        rewards = [r for g in groups for r in g.rewards]
        mean = sum(rewards) / len(rewards)
        last = len(results) == steps or (
            time_limit_s is not None and time.perf_counter() - start > time_limit_s
        )
        stats = None if last else trainer.step(groups)
        served.load()
        result = VersionResult(version, mean, time.perf_counter() - start, stats)
        results.append(result)
        if on_version is not None:
            on_version(result)
        if last:
            break
    return results
