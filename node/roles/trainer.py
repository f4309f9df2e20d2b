"""The trainer role: queue accepted samples, drive the training child, publish each version.

Accepted samples arrive from validators on ``/swarm-node/<run>/samples/1`` as the pair
(submission, verdict), both signed; the trainer checks the verdict's signer is a genesis
validator and builds the groups from the worker's tokens and the validator's rewards. They wait
in a persisted queue (``node.roles.sample_queue``), kept to the async window (``prune`` after
each new version). The model, optimizer, checkpoint and each version's safetensors live in the
training child (``node.compute.train_child``), on the chosen ``device``: this process imports
neither torch nor hivemind. Prompts are tokenized here, with the run model's own tokenizer and
chat template (``node.model.text.ModelText``, as in issue 11), when a submission arrives, so that
the queue holds token ids and a busy child never delays a validator's hand-off; moving it into
the child is left to issue 17 (light main process).

Version 0 is the model card's weights file, byte for byte (every node checks it): the trainer
checks its model directory against the card and publishes that file as v0.

A lone trainer (the genesis names one) steps when ``submissions_per_step`` submissions inside
the async window wait, publishes every version, and after a restart releases the reservations of
the step that did not finish.

Several trainers (``_group_step``): validators hand each submission to one trainer, so each
takes ``ceil(submissions_per_step / live trainers)`` per round. Rounds average gradients through
hivemind in the children; the round's publisher (smallest peer id among its members) cuts and
announces the version, the others load the publisher's copy through SHARDCAST, so every trainer
continues from the one published policy. When the publisher dies before announcing, the next
live member publishes its own (averaged, so equal up to float noise) copy. Each round's members
are recorded in the group's DHT before the announcement; a trainer that restarts keeps the
reservations of rounds it was part of and releases the rest, so each sample trains once.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import msgpack
import trio

from node.compute.groups import CollapseGuard, Group, StepStats
from node.compute.train_child import TrainerChild
from node.model import DEFAULT_MODEL_DIR, model_info
from node.model.card import check_dir
from node.model.text import ModelText, chat_template_wanted
from node.policy_feed import PolicyFeed
from node.roles.sample_queue import SampleQueue
from node.roles.trainer_stats import GroupStatus, TrainerStats
from node.run import TaskSource, suite_for
from node.runtime import Node
from swarm.errors import MalformedError, NotAuthorizedError, SwarmError, ValidationError
from swarm.messages import REWARD_SCALE, RolloutSubmission, Verdict, decode
from swarm.net.names import SAMPLES
from swarm.net.protocols import SAMPLES_LIMITS

log = logging.getLogger(__name__)

POLICY_ARCHIVE_BYTES = 1 << 30
"""Published weights kept in ``policies/`` (and served by SHARDCAST, as many versions as fit
this budget) so that audits can replay old verdicts."""
IDLE_POLL_S = 0.5
"""How often an idle group trainer asks whether a peer wants a round."""
TAKEOVER_AFTER_S = 60.0
ADOPT_WAIT_S = 8.0
"""How long a member tries to fetch the publisher's copy before asking whether it is alive."""
"""A live publisher that announces nothing for this long is taken over anyway."""


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
        self.text = ModelText(model_dir, chat_template=chat_template_wanted(g))
        self.trainers = sorted(g.trainers)
        self.in_group = len(self.trainers) > 1
        self.max_versions = max_versions
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "policies").mkdir(exist_ok=True)
        self.queue = SampleQueue(run_dir / "samples.db")
        self.guard = CollapseGuard()
        self.stats = TrainerStats(group=GroupStatus() if self.in_group else None)
        self.child: TrainerChild | None = None
        self.version = 0
        self.window_floor = 0
        """Oldest version whose samples this trainer can train (after a jump in versions)."""
        self._arrived = trio.Event()
        self.done = trio.Event()

    # -- samples in ---------------------------------------------------------------------------

    def prompt_tokens(self, prompt_id: int) -> list[int]:
        """The token ids of a task's prompt (the one place the trainer tokenizes): the model's
        own tokenizer, through its chat template when the run asks for it."""
        return self.text.encode_prompt(self.suite.task(prompt_id).prompt)

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
            groups.append(
                Group(
                    self.prompt_tokens(int(pid)),
                    [list(x.tokens) for x in members],
                    rewards,
                    s.policy_version,
                )
            )
        if self.queue.put(submission.id, s.policy_version, groups):
            self.stats.add_rewards(s.policy_version, [r for grp in groups for r in grp.rewards])
            self._arrived.set()
        return b"ok"

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
                "nproc": self.nproc,
            },
            log_path=self.run_dir / "trainer-child.log",
        )

    def _child(self) -> TrainerChild:
        if self.child is None:
            raise RuntimeError("Trainer.run must be started first")
        return self.child

    def _weights_path(self, version: int) -> Path:
        return self.run_dir / "policies" / f"v{version}.safetensors"

    # -- publishing ---------------------------------------------------------------------------

    async def _publish(self, version: int) -> None:
        card = self.node.config.genesis.message.model
        if version == 0 and card.weights is not None:
            # Version 0 is the model card's weights file, byte for byte (every node checks).
            path, source = self._weights_path(0), self.model_dir / card.weights.name
            await trio.to_thread.run_sync(
                lambda: check_dir(card, self.model_dir, what="trainer model")
            )
            await trio.to_thread.run_sync(shutil.copyfile, source, path)
        # Auditors fetch the weights of old verdicts from the swarm: the trainer keeps serving
        # every published version that fits the archive budget, not only the async window.
        path = self._weights_path(version)
        size = max(1, path.stat().st_size)
        self.feed.store.keep = max(self.feed.store.keep, POLICY_ARCHIVE_BYTES // size)
        await self.feed.publish(version, path)
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

    async def _adopt(self, version: int) -> None:
        """Continue from the swarm's copy of ``version`` (fetched through SHARDCAST)."""
        announcement = await self.node.policy.wait_for(version)
        path = await self.feed.fetch(announcement)
        got = announcement.message.version
        await trio.to_thread.run_sync(self._child().load, got, path)
        if got > self.version + 1:
            # The weights of the versions jumped over are not held here, so their samples
            # cannot be trained (logp_old): the window starts at the adopted version for now.
            self.window_floor = got
        self.version = got
        log.info("continuing from the published policy v%d", got)

    # -- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve samples and train until ``max_versions`` versions exist (or cancelled)."""
        self.node.handle(SAMPLES, self._on_samples, SAMPLES_LIMITS)
        self.child = await trio.to_thread.run_sync(self._start_child)
        try:
            self.version = self.child.version
            if self.in_group:
                await self._join_group()
            else:
                released = self.queue.recover(self.version)
                if released or self.version:
                    log.info("resumed at policy v%d (%d samples back)", self.version, released)
                await self._publish(self.version)
            while self.max_versions is None or self.version < self.max_versions:
                min_version = max(0, self.version - self.params.async_level, self.window_floor)
                if self.in_group:
                    await self._group_step(min_version)
                    continue
                idle_from = time.perf_counter()
                while self.queue.pending(min_version) < self.params.submissions_per_step:
                    await self._arrived.wait()
                    self._arrived = trio.Event()
                self.stats.idle_seconds += time.perf_counter() - idle_from
                busy_from = time.perf_counter()
                await self.step(min_version)
                self.stats.busy_seconds += time.perf_counter() - busy_from
            self.done.set()
        finally:
            self.close()

    def close(self) -> None:
        if self.child is not None:
            self.child.close()
            self.child = None

    async def step(self, min_version: int) -> StepStats:
        """A lone trainer's step: train, publish, watch for collapse."""
        child = self._child()
        step = self.version
        batch = self.queue.take(step, self.params.submissions_per_step, min_version)
        out = await trio.to_thread.run_sync(child.step, [g for _, gs in batch for g in gs], step)
        stats = self._record(StepStats(**out["stats"]))
        self.version = child.version
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
        self._retain()
        await self._publish(self.version)
        return stats

    def _retain(self) -> None:
        """Drop queued work the async window left behind (the child checkpointed ``version``)."""
        self.queue.prune(self.version - self.params.async_level, self.version)

    def _record(self, stats: StepStats) -> StepStats:
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

    # -- several trainers ---------------------------------------------------------------------

    async def _trainer_addrs(self) -> list[str]:
        """The hivemind addresses in the other trainers' adverts (an advert read before its
        trainer's child started is read again)."""
        out: list[str] = []
        for peer in self.node.peers_by_role().get("trainer", []):
            advert = self.node.membership.advert_of(peer)
            if advert is not None and "hivemind" not in advert.message.capabilities:
                advert = await self.node.membership.refresh(peer)
            if advert is not None:
                out += [str(a) for a in advert.message.capabilities.get("hivemind", [])]
        return out

    async def _join_group(self) -> None:
        """Advertise our hivemind address, meet the other trainers, load the swarm's newest
        policy, settle the rounds a previous life left open, and publish v0 if nobody has."""
        child = self._child()
        caps = dict(self.node.membership.config.capabilities)
        caps["hivemind"] = child.hivemind_addrs
        self.node.membership.config.capabilities = caps
        await self.node.membership.publish()
        with trio.move_on_after(15):
            while not await self._trainer_addrs():
                await self.node.membership.discover()
                await trio.sleep(0.5)
        await trio.to_thread.run_sync(child.connect, await self._trainer_addrs())
        first = self.trainers[0]
        with trio.move_on_after(3 if self.node.peer_id == first else 10):
            await self.node.policy.wait_for(0)  # a running swarm answers the catch-up at once
        known = self.node.policy.version
        if known is not None and known >= self.version and known > 0:
            try:
                await self._adopt(known)
            except SwarmError as exc:  # the loop tries again (or a peer republishes)
                log.warning("policy v%d not fetched at start (%s)", known, exc)
        for step in self.queue.unsettled_steps():
            members = await trio.to_thread.run_sync(child.round_members, step)
            if members is not None and self.node.peer_id in members:
                self.queue.settle(step)
            else:
                n = self.queue.release(step)
                log.info("round of v%d never published with us: %d samples back", step, n)
        if self.node.policy.version is None:
            if self.node.peer_id != first:
                with trio.move_on_after(30):  # the first genesis trainer announces v0
                    await self.node.policy.wait_for(0)
            if self.node.policy.version is None:
                await self._publish(self.version)
        self._group_status().peers = sorted(await trio.to_thread.run_sync(child.live))

    def _group_status(self) -> GroupStatus:
        assert self.stats.group is not None
        return self.stats.group

    async def _round_wanted(self, min_version: int, share: int) -> bool:
        """Wait (at most ``IDLE_POLL_S``) until we have our share, or a peer wants a round."""
        if self.queue.pending(min_version) >= share:
            return True
        with trio.move_on_after(IDLE_POLL_S):
            await self._arrived.wait()
            self._arrived = trio.Event()
        if self.queue.pending(min_version) >= share:
            return True
        child = self._child()
        wanted = await trio.to_thread.run_sync(child.wanted, self.version)
        return any(p != self.node.peer_id for p in wanted)

    async def _group_step(self, min_version: int) -> None:
        child = self._child()
        known = self.node.policy.version
        if known is not None and known > self.version:
            try:
                await self._adopt(known)  # a round we were not in: continue from its result
            except SwarmError as exc:
                log.warning("policy v%d not fetched yet (%s); retrying", known, exc)
                await trio.sleep(1.0)
            return
        gs = self._group_status()
        live = await trio.to_thread.run_sync(child.live)
        gs.peers = sorted(live)
        share = max(1, math.ceil(self.params.submissions_per_step / max(1, len(live))))
        idle_from = time.perf_counter()
        if not await self._round_wanted(min_version, share):
            self.stats.idle_seconds += time.perf_counter() - idle_from
            await self._connect_new_trainers()
            return
        self.stats.idle_seconds += time.perf_counter() - idle_from
        busy_from = time.perf_counter()
        step = self.version
        batch = self.queue.take(step, share, min_version)
        groups = [g for _, gs_ in batch for g in gs_]
        out = await trio.to_thread.run_sync(child.step, groups, step)
        try:
            await self._finish_round(step, groups, out)
        finally:
            self.stats.busy_seconds += time.perf_counter() - busy_from

    async def _finish_round(self, step: int, groups: list[Group], out: dict[str, Any]) -> None:
        child = self._child()
        gs = self._group_status()
        if "failed" in out:
            gs.rounds_failed += 1
            self.queue.release(step)
            log.warning("%s; its samples are back in the queue", out["failed"])
            return
        rnd = out["round"]
        stats = self._record(StepStats(**out["stats"]))
        members = list(rnd["members"])
        if rnd["group_samples"] == 0 and not groups:
            # Nobody had signal: the weights did not move; undo the version step.
            await trio.to_thread.run_sync(child.discard, step)
            self.queue.release(step)
            return
        if rnd["void"] or await trio.to_thread.run_sync(child.void, step):
            gs.rounds_void += 1
            log.warning("round v%d was void (two groups formed); samples back", step)
            await trio.to_thread.run_sync(child.discard, step)
            self.queue.release(step)
            return
        published = await self._publish_round(step, members, rnd["publisher"])
        if not published:
            await trio.to_thread.run_sync(child.discard, step)
            self.queue.release(step)
            return
        self.queue.settle(step)
        self._retain()
        gs.rounds_averaged += len(members) > 1
        gs.samples_contributed += sum(len(g.completions) for g in groups)
        gs.publisher = published
        gs.averaging_seconds += float(rnd["seconds"])
        gs.bytes_averaged += int(rnd["bytes_averaged"])
        log.info(
            "round v%d -> v%d: %d trainers, %d samples (publisher %s)",
            step,
            stats.version,
            len(members),
            rnd["group_samples"],
            published[-8:],
        )

    async def _publish_round(self, step: int, members: list[str], publisher: str) -> str | None:
        """Publish ``step + 1`` when it is ours to, otherwise wait for the publisher's copy and
        load it; take over from a publisher that died. Returns who published it (None: the
        round is void, or another copy of this version won; the caller undoes it)."""
        child = self._child()
        me, new = self.node.peer_id, step + 1
        deadline = trio.current_time() + TAKEOVER_AFTER_S
        while publisher != me:
            known = self.node.policy.version
            if known is not None and known >= new:
                why = f"no copy within {ADOPT_WAIT_S:g} s"
                try:
                    with trio.move_on_after(ADOPT_WAIT_S):
                        await self._adopt(new)
                        return publisher
                except SwarmError as exc:
                    why = str(exc)
                if publisher in await trio.to_thread.run_sync(child.live):
                    log.warning("v%d not fetched yet (%s); retrying", new, why)
                    await trio.sleep(1.0)
                    continue
                return await self._republish(step, members, known + 1)
            if await trio.to_thread.run_sync(child.void, step):
                return None
            live = await trio.to_thread.run_sync(child.live)
            alive = [m for m in members if m in live]
            if publisher not in live or trio.current_time() > deadline:
                log.warning("v%d: publisher %s silent; the next member publishes", new, publisher)
                publisher = min(m for m in [*alive, me] if m != publisher)
                if publisher == me:
                    log.warning("v%d: the round's publisher is gone; publishing our copy", new)
                    self._group_status().takeovers += 1
            else:
                await trio.sleep(0.5)
        known = self.node.policy.version
        if known is not None and known >= new:
            log.warning("v%d was published by another round first; ours is undone", new)
            return None
        await trio.to_thread.run_sync(child.record_round, step, members)
        try:
            await self._publish(new)
        except SwarmError as exc:
            log.warning("v%d could not be announced (%s); the round is undone", new, exc)
            self.feed.discard_own(new)
            return None
        self.version = new
        self._group_status().published_here += 1
        return me

    async def _republish(self, step: int, members: list[str], version: int) -> str:
        """The publisher announced the round's version and died before anyone held its copy:
        publish our own copy of the round's result as ``version`` (versions only move forward),
        so the run goes on and the round's samples still count once."""
        child = self._child()
        log.warning(
            "the publisher died before serving v%d; publishing our copy as v%d", step + 1, version
        )
        self._group_status().takeovers += 1
        await trio.to_thread.run_sync(child.relabel, version)
        await trio.to_thread.run_sync(child.record_round, step, members)
        await self._publish(version)
        self.version = version
        self._group_status().published_here += 1
        return self.node.peer_id

    async def _connect_new_trainers(self) -> None:
        addrs = await self._trainer_addrs()
        if addrs:
            await trio.to_thread.run_sync(self._child().connect, addrs)

    def idle_fraction(self) -> float:
        total = self.stats.idle_seconds + self.stats.busy_seconds
        return self.stats.idle_seconds / total if total else math.nan
