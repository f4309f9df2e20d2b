"""The trainer role: queue accepted samples, step GRPO, publish each version through SHARDCAST.

Accepted samples arrive from validators on ``/swarm-node/<run>/samples/1`` as the pair
(submission, verdict), both signed; the trainer checks the verdict's signer is a genesis
validator and builds the groups from the worker's tokens and the validator's rewards. They wait
in a persisted queue (``node.roles.sample_queue``). A step takes ``submissions_per_step``
submissions made by versions inside the async window, trains (off the event loop), writes the
new version's weights, checkpoints, and publishes and announces the version.

After a restart the trainer resumes from its checkpoint: reservations of the step that did not
finish are released, so no accepted sample is lost or used twice.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import trio
from safetensors.torch import save_file

from node.compute.grpo import CollapseGuard, Group, GRPOConfig, GRPOTrainer, StepStats
from node.model import DEFAULT_MODEL_DIR, load_causal_lm, model_info
from node.model.card import check_dir
from node.model.text import ModelText, chat_template_wanted
from node.policy_feed import PolicyFeed
from node.roles.sample_queue import SampleQueue
from node.run import TaskSource, suite_for
from node.runtime import Node
from swarm.errors import MalformedError, NotAuthorizedError, ValidationError
from swarm.messages import REWARD_SCALE, RolloutSubmission, Verdict, decode
from swarm.net.names import SAMPLES
from swarm.net.protocols import SAMPLES_LIMITS

log = logging.getLogger(__name__)

POLICY_ARCHIVE_BYTES = 1 << 30
"""Published weights kept in ``policies/`` (and served by SHARDCAST, as many versions as fit
this budget) so that audits can replay old verdicts."""


@dataclass
class TrainerStats:
    steps: list[StepStats] = field(default_factory=list)
    reward_sum: dict[int, float] = field(default_factory=dict)
    reward_count: dict[int, int] = field(default_factory=dict)
    idle_seconds: float = 0.0
    busy_seconds: float = 0.0
    queued: int = 0
    rollbacks: int = 0
    started: float = field(default_factory=time.monotonic)
    published_at: dict[int, float] = field(default_factory=dict)
    """Seconds after the trainer started at which each version was announced."""

    def add_rewards(self, version: int, rewards: list[float]) -> None:
        self.reward_sum[version] = self.reward_sum.get(version, 0.0) + sum(rewards)
        self.reward_count[version] = self.reward_count.get(version, 0) + len(rewards)
        self.queued += 1

    def reward_by_version(self) -> dict[int, float]:
        return {v: self.reward_sum[v] / self.reward_count[v] for v in sorted(self.reward_sum)}


class Trainer:
    def __init__(
        self,
        node: Node,
        feed: PolicyFeed,
        run_dir: Path,
        *,
        model_dir: Path = DEFAULT_MODEL_DIR,
        max_versions: int | None = None,
        on_version: Callable[[int], None] | None = None,
        suite: TaskSource | None = None,
        device: str = "cpu",
    ) -> None:
        self.node = node
        self.feed = feed
        self.run_dir = run_dir
        self.params = node.config.genesis.message.params
        self.suite = suite or suite_for(node.config.genesis.message)
        self.max_versions = max_versions
        self.on_version = on_version
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "policies").mkdir(exist_ok=True)
        self.queue = SampleQueue(run_dir / "samples.db")
        self.checkpoint = run_dir / "trainer.ckpt"
        self.model_dir = model_dir
        info = model_info(model_dir)
        genesis = node.config.genesis.message
        self.text = ModelText(model_dir, chat_template=chat_template_wanted(genesis))
        model = load_causal_lm(model_dir, dtype="float32", device=device)
        self.grpo = GRPOTrainer(
            model,
            GRPOConfig.from_params(self.params),
            keep_versions=self.params.async_level + 1,
            pad_id=info.pad_id,
        )
        if self.checkpoint.exists():
            self.grpo.load_checkpoint(self.checkpoint)
            released = self.queue.recover(self.grpo.version)
            log.info(
                "resumed at policy v%d (%d samples back in the queue)", self.grpo.version, released
            )
        self.guard = CollapseGuard()
        self.stats = TrainerStats()
        self._arrived = trio.Event()
        self.done = trio.Event()

    @property
    def version(self) -> int:
        return self.grpo.version

    async def _on_samples(self, peer: str, body: bytes) -> bytes:
        try:
            raw_submission, raw_verdict = msgpack.unpackb(body, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise MalformedError(f"samples must be [submission, verdict]: {exc}") from exc
        submission = decode(raw_submission, RolloutSubmission)
        verdict = decode(raw_verdict, Verdict)
        g = self.node.config.genesis.message
        if verdict.signer not in g.validators:
            raise NotAuthorizedError(f"verdict signed by {verdict.signer}, not a validator")
        v = verdict.message
        if not v.accepted or v.submission_id != submission.id or v.run_id != self.node.run_id:
            raise ValidationError("the verdict does not accept this submission of this run")
        s = submission.message
        gs = self.params.group_size
        if len(v.rewards) != len(s.samples) or len(s.samples) != gs * len(s.prompt_ids):
            raise ValidationError("rewards do not match the samples")
        groups = []
        for i, pid in enumerate(s.prompt_ids):
            members = s.samples[i * gs : (i + 1) * gs]
            rewards = [r / REWARD_SCALE for r in v.rewards[i * gs : (i + 1) * gs]]
            prompt = self.text.encode_prompt(self.suite.task(int(pid)).prompt)
            groups.append(
                Group(prompt, [list(x.tokens) for x in members], rewards, s.policy_version)
            )
        if self.queue.put(submission.id, s.policy_version, groups):
            self.stats.add_rewards(s.policy_version, [r for grp in groups for r in grp.rewards])
            self._arrived.set()
        return b"ok"

    def _weights_path(self, version: int) -> Path:
        return self.run_dir / "policies" / f"v{version}.safetensors"

    async def _publish_current(self) -> None:
        version = self.grpo.version
        path = self._weights_path(version)
        card = self.node.config.genesis.message.model
        if version == 0 and card.weights is not None:
            # Version 0 is the model card's weights file, byte for byte (every node checks).
            await trio.to_thread.run_sync(
                lambda: check_dir(card, self.model_dir, what="trainer model")
            )
            source = self.model_dir / card.weights.name
            await trio.to_thread.run_sync(shutil.copyfile, source, path)
        else:
            weights = self.grpo.weights()
            await trio.to_thread.run_sync(lambda: save_file(weights, str(path)))
        # Auditors fetch the weights of old verdicts from the swarm: the trainer keeps serving
        # every published version that fits the archive budget, not only the async window.
        size = max(1, path.stat().st_size)
        self.feed.store.keep = max(self.feed.store.keep, POLICY_ARCHIVE_BYTES // size)
        await self.feed.publish(version, path)
        self._prune_policies(version)
        self.stats.published_at[version] = round(time.monotonic() - self.stats.started, 3)
        log.info("published policy v%d", version)
        if self.on_version is not None:
            self.on_version(version)

    def _prune_policies(self, newest: int) -> None:
        """Keep every version's weights for auditors while they fit in ``POLICY_ARCHIVE_BYTES``;
        past that drop the oldest, never one inside the async window."""
        files = sorted(self.run_dir.glob("policies/v*.safetensors"), key=lambda f: int(f.stem[1:]))
        total = sum(f.stat().st_size for f in files)
        for old in files:
            if (
                total <= POLICY_ARCHIVE_BYTES
                or int(old.stem[1:]) >= newest - self.params.async_level
            ):
                break
            total -= old.stat().st_size
            old.unlink(missing_ok=True)

    async def run(self) -> None:
        """Serve samples and train until ``max_versions`` versions exist (or cancelled)."""
        self.node.handle(SAMPLES, self._on_samples, SAMPLES_LIMITS)
        await self._publish_current()
        while self.max_versions is None or self.grpo.version < self.max_versions:
            min_version = max(0, self.grpo.version - self.params.async_level)
            idle_from = time.perf_counter()
            while self.queue.pending(min_version) < self.params.submissions_per_step:
                await self._arrived.wait()
                self._arrived = trio.Event()
            self.stats.idle_seconds += time.perf_counter() - idle_from
            busy_from = time.perf_counter()
            await self.step(min_version)
            self.stats.busy_seconds += time.perf_counter() - busy_from
        self.done.set()

    async def step(self, min_version: int) -> StepStats:
        step = self.grpo.version
        batch = self.queue.take(step, self.params.submissions_per_step, min_version)
        groups = [g for _, gs in batch for g in gs]
        stats = await trio.to_thread.run_sync(self.grpo.step, groups)
        self.stats.steps.append(stats)
        log.info(
            "step -> v%d: mean reward %.3f, %d/%d groups kept, loss %.4f",
            stats.version,
            stats.mean_reward,
            stats.kept_groups,
            stats.total_groups,
            stats.loss,
        )
        good = self.guard.observe(stats)
        if good is not None:
            good = self.grpo.rollback(good)  # the nearest held version if v{good} was pruned
            log.error(
                "policy collapse: reward and advantage signal fell to zero for %d steps;"
                " continuing from the weights of v%d (lower the learning rate if this repeats)",
                self.guard.patience,
                good,
            )
            self.stats.rollbacks += 1
        await trio.to_thread.run_sync(self.grpo.save_checkpoint, self.checkpoint)
        self.queue.prune(self.grpo.version - self.params.async_level, self.grpo.version)
        await self._publish_current()
        return stats

    def idle_fraction(self) -> float:
        total = self.stats.idle_seconds + self.stats.busy_seconds
        return self.stats.idle_seconds / total if total else math.nan
