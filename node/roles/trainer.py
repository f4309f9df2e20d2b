"""The trainer role: queue accepted samples, drive the training child, publish each version.

Decisions this module owns:

- **Intake** (``_on_samples``): accepted samples arrive from validators on
  ``/swarm-node/<run>/samples/1`` as the pair (submission, verdict), both signed; the verdict's
  signer must be a genesis validator. The groups are built from the worker's tokens, the
  validator's rewards and the task's prompt *text*, and wait in a persisted queue
  (``node.roles.sample_queue``), kept to the async window (``prune`` after each new version).
- **Light process**: the model, its tokenizer and chat template, the optimizer, checkpoints,
  each version's safetensors and (several trainers) hivemind live in the training child
  (``node.compute.train_child``), which tokenizes the queued prompts when it trains them. This
  process imports none of torch, transformers or hivemind (``status`` shows it:
  ``process.heavy_modules``), so a busy child never delays a validator's hand-off.
- **Version 0** is the model card's weights file, byte for byte (every node checks it): the
  trainer checks its model directory against the card and publishes that file as v0.
- **Archive** (``_prune_policies``): published weights stay while they fit
  ``POLICY_ARCHIVE_BYTES``, so auditors can replay old verdicts.
- **A lone trainer** (the genesis names one) steps when ``submissions_per_step`` submissions
  inside the async window wait, publishes every version, rolls back on collapse
  (``CollapseGuard``), and after a restart releases the reservations of the step that did not
  finish. Several trainers step in rounds: ``node.roles.trainer_group``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import trio

from node.compute.groups import CollapseGuard, StepStats
from node.compute.healing import EngineHealer
from node.compute.train_child import TrainerChild
from node.model import DEFAULT_MODEL_DIR, model_info
from node.model.card import check_dir
from node.model.text import chat_template_wanted
from node.policy_feed import PolicyFeed
from node.roles.cheats import TrainerCheat
from node.roles.sample_queue import SampleQueue
from node.roles.trainer_group import GroupRounds
from node.roles.trainer_records import STATE_LIMITS, TrainingLog, groups_of
from node.roles.trainer_stats import TrainerStats
from node.run import TaskSource, suite_for
from node.runtime import Node
from swarm.errors import EngineError, MalformedError, NotAuthorizedError, ValidationError
from swarm.ledger.training import TrainingStore
from swarm.messages import (
    PolicyAnnouncement,
    RolloutSubmission,
    Signed,
    Verdict,
    decode,
    train_seed,
)
from swarm.net.names import SAMPLES, TRAIN_STATE
from swarm.net.protocols import SAMPLES_LIMITS
from swarm.shardcast.fetch import ProgressCallback

log = logging.getLogger(__name__)

POLICY_ARCHIVE_BYTES = 1 << 30
"""Published weights kept in ``policies/`` (and served by SHARDCAST, as many versions as fit
this budget) so that audits can replay old verdicts."""


class Trainer:
    def __init__(
        self,
        node: Node,
        feed: PolicyFeed,
        run_dir: Path,
        *,
        model_dir: Path = DEFAULT_MODEL_DIR,
        max_versions: int | None = None,
        threads: int | None = None,
        suite: TaskSource | None = None,
        device: str = "cpu",
        nproc: int = 1,
        training: TrainingStore | None = None,
        cheat: TrainerCheat | None = None,
    ) -> None:
        self.node = node
        self.nproc = nproc  # ranks of the training child (node.compute.fsdp)
        self.feed = feed
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.threads = threads
        self.device = device
        g = node.config.genesis.message
        self.params = g.params
        self.suite = suite or suite_for(g)
        self.chat_template = chat_template_wanted(g)
        self.trainers = sorted(g.trainers)
        self.in_group = len(self.trainers) > 1
        self.max_versions = max_versions
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "policies").mkdir(exist_ok=True)
        self.queue = SampleQueue(run_dir / "samples.db")
        self.guard = CollapseGuard()
        self.group = GroupRounds(self) if self.in_group else None
        self.stats = TrainerStats(group=None if self.group is None else self.group.status)
        self.child: TrainerChild | None = None
        self.version = 0
        self.window_floor = 0
        """Oldest version whose samples this trainer can train (after a jump in versions)."""
        self._arrived = trio.Event()
        self.done = trio.Event()
        self.log = TrainingLog(node, training, run_dir / "states")
        self.cheat = cheat  # tests only: a rogue trainer (node.roles.cheats.TRAINER_CHEATS)
        self._dropped = ""
        self.healer = EngineHealer(self, on_give_up=self._withdraw, what="training child")
        """Restarts a dead training child (the validator's backoff and limit)."""

    # -- samples in ---------------------------------------------------------------------------

    async def arrived(self) -> None:
        """Wait until a new submission is queued."""
        await self._arrived.wait()
        self._arrived = trio.Event()

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
        if s.policy_version < self.version - self.params.async_level:
            # Late work (a restarted validator's outbox, a slow worker): no step can take it
            # any more. Taken and dropped, not queued: a row older than the window would only
            # wait for the next ``retain`` to delete it.
            self.stats.too_old += 1
            return self.log.receipt(submission, verdict, trainer_version=self.version, seq=None).raw
        groups = groups_of(submission, verdict, self.params.group_size, self.suite)
        if self.queue.put(
            submission.id, s.policy_version, groups, verdict_id=verdict.id, worker=submission.signer
        ):
            self.stats.add_rewards(s.policy_version, [r for grp in groups for r in grp.rewards])
            self._arrived.set()
        seq = self.queue.seq_of(submission.id)
        return self.log.receipt(submission, verdict, trainer_version=self.version, seq=seq).raw

    # -- the child ----------------------------------------------------------------------------

    def _start_child(self) -> TrainerChild:
        info = model_info(self.model_dir)
        c = self.params
        group = None
        if self.in_group:
            host = next(
                (a.split("/")[2] for a in self.node.config.listen if a.startswith("/ip4/")),
                "127.0.0.1",
            )
            group = {
                "peer": self.node.peer_id,
                "run_id": self.node.run_id,
                "host": "127.0.0.1" if host == "0.0.0.0" else host,
                "trainers": len(self.trainers),
                # The child signs this member's gradient commitments (over its own pipe).
                "key": self.node.key.seed,
            }
        return TrainerChild(
            {
                "model_dir": str(self.model_dir),
                "device": self.device,
                "config": {
                    "learning_rate": c.learning_rate,
                    "clip_epsilon": c.clip_epsilon,
                    "clip_delta": c.clip_delta,
                    "entropy_coef": c.entropy_coef,
                    "kl_coef": c.kl_coef,
                    "max_grad_norm": c.max_grad_norm,
                    "max_tokens": c.max_tokens,
                },
                "keep_versions": c.async_level + 1,
                "pad_id": info.pad_id,
                "checkpoint": str(self.run_dir / "trainer.ckpt"),
                "policies": str(self.run_dir / "policies"),
                "threads": self.threads,
                "group": group,
                "chat_template": self.chat_template,
                "nproc": self.nproc,
                "serve_dtype": c.serve_dtype,  # versions are written in it; masters stay fp32
                "states": str(self.log.states),  # each version's training state, for audits
                "state_keep": c.train_state_keep,
            },
            log_path=self.run_dir / "trainer-child.log",
        )

    def child_or_fail(self) -> TrainerChild:
        if self.child is None:
            raise RuntimeError("Trainer.run must be started first")
        return self.child

    def _weights_path(self, version: int) -> Path:
        return self.run_dir / "policies" / f"v{version}.safetensors"

    # -- publishing ---------------------------------------------------------------------------

    async def publish(self, version: int) -> None:
        card = self.node.config.genesis.message.model
        path = self._weights_path(version)
        weights: list[Path] = [path]
        if version == 0 and card.bound:
            # Version 0 is the model card's weights, byte for byte (every node checks).
            await trio.to_thread.run_sync(
                lambda: check_dir(card, self.model_dir, what="trainer model")
            )
            if card.weights is not None:
                await trio.to_thread.run_sync(
                    shutil.copyfile, self.model_dir / card.weights.name, path
                )
            else:
                # A sharded checkpoint travels as its shard files, in the card's order. Auditors
                # replay version 0 on the model itself: the child's one-file v0 (its own cast of
                # the weights, not the card's bytes) leaves the archive.
                weights = [self.model_dir / ref.name for ref in card.weight_files]
                path.unlink(missing_ok=True)
        # Auditors fetch the weights of old verdicts from the swarm: the trainer keeps serving
        # every published version that fits the archive budget, not only the async window.
        size = max(1, sum(p.stat().st_size for p in weights))
        self.feed.store.keep = max(self.feed.store.keep, POLICY_ARCHIVE_BYTES // size)
        await self.feed.publish(version, weights[0] if len(weights) == 1 else weights)
        self._prune_policies(version)
        self.stats.published_at[version] = round(time.monotonic() - self.stats.started, 3)
        log.info("published policy v%d", version)

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

    async def adopt(
        self,
        version: int,
        announced: Signed[PolicyAnnouncement] | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        """Continue from the swarm's copy of ``version`` or newer (fetched through SHARDCAST;
        ``announced``: that announcement, an older one than the newest)."""
        announcement = announced or await self.node.policy.wait_for(version)
        path = await self.feed.fetch(announcement, on_progress)
        got = announcement.message.version
        await trio.to_thread.run_sync(self.child_or_fail().load, got, path)
        if got > self.version + 1:
            # The weights of the versions jumped over are not held here, so their samples
            # cannot be trained (logp_old): the window starts at the adopted version for now.
            self.window_floor = got
        self.version = got
        log.info("continuing from the published policy v%d", got)

    # -- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve samples and train until ``max_versions`` versions exist (or cancelled). A
        training child that dies is restarted (``EngineHealer``: the validator's backoff and
        limit) and the trainer resumes from the child's checkpoint, as after a restart of the
        node; past the limit it withdraws its advert and says why in ``status``."""
        self.node.handle(SAMPLES, self._on_samples, SAMPLES_LIMITS)
        self.node.handle(TRAIN_STATE, self.log.serve_state, STATE_LIMITS)
        self.child = await trio.to_thread.run_sync(self._start_child)
        for line in self.child.internals_missing:  # hivemind's, checked in the child
            log.warning("%s (swarm/internals.py)", line)
            self.node.warnings.append(line)
        try:
            while True:
                try:
                    await self._resume()
                    await self._train()
                    break
                except EngineError as exc:
                    if not await self.healer.recover(exc):
                        await trio.sleep_forever()  # given up: status and the log say why
            self.done.set()
        finally:
            self.close()

    def restart(self) -> None:
        """A fresh training child (the old one died): it loads the checkpoint (``EngineHealer``
        calls this off the event loop)."""
        self.close()
        self.child = self._start_child()

    async def _withdraw(self, why: str) -> None:
        await self.node.membership.withdraw()

    async def _resume(self) -> None:
        """Continue from the child's version: its checkpoint, written after every version."""
        child = self.child_or_fail()
        self.version = child.version
        if self.group is not None:
            await self.group.join()
            return
        released = self.queue.recover(self.version)
        # Before ``retain``: it drops the reservations of steps the checkpoint covers whose
        # samples left the window, and the unanswered step's citations are among them.
        await self._record_unanswered_step()
        self.retain()  # what arrived while the child started, checked against v0
        if released or self.version:
            log.info("resumed at policy v%d (%d samples back)", self.version, released)
        await self.publish(self.version)

    async def _record_unanswered_step(self) -> None:
        """The child died after its checkpoint reached ``version`` and before it answered the
        step: the version is published (``publish``) and its record is signed here, from the
        step's files and reservations, so no version goes out without one."""
        store, version = self.log.store, self.version
        cited = self.queue.cited_by(version - 1) if version else []
        if store is None or not cited or store.record(version) is not None:
            return
        seed = train_seed(self.node.run_id, version)
        state = await trio.to_thread.run_sync(self.child_or_fail().step_state, version, seed)
        parent = version - 1
        min_version = max(0, parent - self.params.async_level, self.window_floor)
        log.warning("v%d was trained but never recorded (the child died); recording it", version)
        await self.log.publish_record(
            self.params, parent=parent, min_version=min_version, cited=cited, state=state
        )

    async def _train(self) -> None:
        while self.max_versions is None or self.version < self.max_versions:
            min_version = max(0, self.version - self.params.async_level, self.window_floor)
            if self.group is not None:
                await self.group.step(min_version)
                continue
            idle_from = time.perf_counter()
            skip = self._skip_at(self.version, min_version)
            while (
                self.queue.pending(min_version, skip_worker=skip) < self.params.submissions_per_step
            ):
                await self.arrived()
                skip = self._skip_at(self.version, min_version)
            self.stats.idle_seconds += time.perf_counter() - idle_from
            busy_from = time.perf_counter()
            await self.step(min_version)
            self.stats.busy_seconds += time.perf_counter() - busy_from

    def close(self) -> None:
        if self.child is not None:
            self.child.close()
            self.child = None

    async def step(self, min_version: int) -> StepStats:
        """A lone trainer's step: train, publish, watch for collapse."""
        child = self.child_or_fail()
        step = self.version
        batch = self.queue.take(
            step,
            self.params.submissions_per_step,
            min_version,
            skip_worker=self._skip_at(step, min_version),
        )
        groups = [g for _, gs in batch for g in gs]
        cheat = (
            self.cheat.pick(step, sum(g.signal for g in groups)) if self.cheat is not None else None
        )
        cited = self.queue.cited_by(step)
        if cheat == "unaccepted-sample" and groups:
            # One more group, with rewards no validator gave, cited by a verdict nobody signed.
            forged = groups[0]
            groups.append(replace(forged, rewards=[1.0 - r for r in forged.rewards]))
            cited.append((os.urandom(32), forged.version))
        seed = train_seed(self.node.run_id, step + 1)
        child_cheat = cheat if cheat in ("learning-rate", "perturb-weights") else None
        out = await trio.to_thread.run_sync(child.step, groups, step, seed, child_cheat)
        stats = self.record(StepStats(**out["stats"]))
        self.version = child.version
        await self.log.publish_record(
            self.params, parent=step, min_version=min_version, cited=cited, state=out["state"]
        )
        good = self.guard.observe(stats)
        if good is not None:
            rolled = await trio.to_thread.run_sync(child.rollback, good)
            log.error(
                "policy collapse: reward and advantage signal fell to zero for %d steps;"
                " continuing from the weights of v%d (lower the learning rate if this repeats)",
                self.guard.patience,
                rolled["taken"],
            )
            self.stats.rollbacks += 1
            self.version = child.version
            # A rollback is no step: its record says so, and an audit checks its weights only.
            await self.log.publish_record(
                self.params,
                parent=self.version - 1,
                min_version=min_version,
                cited=[],
                state={**out["state"], **rolled.get("state", {})},
                rollback_to=rolled["taken"],
            )
        self.retain()
        await self.publish(self.version)
        return stats

    def _skip_at(self, step: int, min_version: int) -> str:
        """Tests only (``drop-worker``): the worker a rogue trainer leaves out of ``step``, or
        "". It is the worker of the oldest work waiting in the window when the first such step
        begins (kept for the later ones), and the trainer waits for others' work instead. The
        worker of the run's first submission, as before, may have had nothing older waiting
        than the work trained instead, which left no skip to find (the CI of ``dc5be45``)."""
        if self.cheat is None or self.cheat.at(step) != "drop-worker":
            return ""
        if not self._dropped:
            self._dropped = self.queue.first_worker(min_version)
        return self._dropped

    def retain(self) -> None:
        """Drop queued work the async window left behind (the child checkpointed ``version``)."""
        self.queue.prune(self.version - self.params.async_level, self.version)

    def record(self, stats: StepStats) -> StepStats:
        self.stats.steps.append(stats)
        log.info(
            "step -> v%d: mean reward %.3f, %d/%d groups kept, loss %.4f",
            stats.version,
            stats.mean_reward,
            stats.kept_groups,
            stats.total_groups,
            stats.loss,
        )
        return stats

    def idle_fraction(self) -> float:
        total = self.stats.idle_seconds + self.stats.busy_seconds
        return self.stats.idle_seconds / total if total else math.nan
