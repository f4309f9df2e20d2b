"""The inference role: follow the newest policy, generate the assigned groups with proofs, sign
and submit them to a validator.

The model runs off the event loop (a child process in production, a thread in tests), so the
node keeps gossiping and serving shards while it generates. A newer version is fetched in the
background while generation continues on the one loaded; work made with a version that has left
the async window by the time it is done is dropped, never submitted.

The request counter is persisted (``worker.counter`` in the run's folder) and advanced *before*
the work starts, so a restarted worker never repeats a counter: a validator would take that as a
replay and slash it.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from node.compute.engine import Engine
from node.policy_feed import PolicyFeed
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.run import TaskSource, suite_for
from node.runtime import Node
from swarm.assignment import assign
from swarm.errors import NetworkError, SwarmError
from swarm.messages import PolicyAnnouncement, RolloutSubmission, Signed, Verdict, decode, sign
from swarm.net.names import SUBMIT
from swarm.net.protocols import SUBMIT_LIMITS

log = logging.getLogger(__name__)

Tamper = Callable[[RolloutSubmission], RolloutSubmission]
"""A cheating worker's edit of its own submission (tests and the demo's cheater only)."""


class Counter:
    """A durable request counter: ``next()`` returns n and has stored n + 1 before it returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._value = int(path.read_text())
        except (FileNotFoundError, ValueError):
            self._value = 0

    def next(self) -> int:
        value = self._value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(value + 1))
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        tmp.replace(self.path)
        self._value = value + 1
        return value


@dataclass
class WorkerStats:
    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    dropped_stale: int = 0
    generate_seconds: float = 0.0
    submit_seconds: float = 0.0
    """Waiting for validators' answers (the next generation starts after the verdict)."""
    samples: int = 0
    last_reasons: list[str] = field(default_factory=list)


class InferenceWorker:
    def __init__(
        self,
        node: Node,
        feed: PolicyFeed,
        engine: Engine,
        run_dir: Path,
        *,
        tamper: Tamper | None = None,
        suite: TaskSource | None = None,
    ) -> None:
        self.node = node
        self.feed = feed
        self.engine = engine
        self.params = node.config.genesis.message.params
        self.suite = suite or suite_for(node.config.genesis.message)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.counter = Counter(run_dir / "worker.counter")
        self.tamper = tamper
        self.stats = WorkerStats()
        self.loaded: int | None = None
        self._fetched: dict[int, Path] = {}
        self._have_new = trio.Event()

    async def run(self) -> None:
        """Work until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow)
            while True:
                held = max(self._fetched, default=None)
                if held is None or self._newest_version() - held > self.params.async_level:
                    # Nothing held, or only versions whose work would be refused: wait for
                    # the fetch of a newer one rather than generate in vain.
                    await self._have_new.wait()
                    self._have_new = trio.Event()
                    continue
                await self._load_newest()
                await self.work_once()

    async def _follow(self) -> None:
        """Fetch every newer announced version in the background."""
        wanted = 0
        while True:
            announcement = await self.node.policy.wait_for(wanted)
            version = announcement.message.version
            try:
                self._fetched[version] = await self.feed.fetch(announcement)
            except SwarmError as exc:
                log.warning("fetching policy v%d failed: %s", version, exc)
                await trio.sleep(1.0)  # back off, then try the newest announcement again
                continue
            for old in [v for v in self._fetched if v < version - self.params.async_level]:
                del self._fetched[old]
            self._have_new.set()
            wanted = version + 1

    async def _load_newest(self) -> None:
        version = max(self._fetched)
        if version != self.loaded:
            await trio.to_thread.run_sync(self.engine.load_weights, str(self._fetched[version]))
            self.loaded = version
            log.info("inference on policy v%d", version)

    def _newest_version(self) -> int:
        newest: Signed[PolicyAnnouncement] | None = self.node.policy.newest
        return -1 if newest is None else newest.message.version

    async def work_once(self) -> None:
        """One request: assignment, generation with proofs, signature, submission."""
        assert self.loaded is not None
        version = self.loaded
        counter = self.counter.next()
        assignment = assign(
            self.node.run_id,
            version,
            self.node.peer_id,
            counter,
            n_prompts=self.params.batch_prompts,
            suite_size=self.suite.size,
            excluded=self.suite.excluded,
        )

        def make() -> RolloutSubmission:
            rollout = generate_groups(self.engine, self.suite, assignment, self.params)
            return build_submission(
                rollout, run_id=self.node.run_id, version=version, counter=counter
            )

        started = time.perf_counter()
        submission = await trio.to_thread.run_sync(make)
        self.stats.generate_seconds += time.perf_counter() - started
        self.stats.samples += len(submission.samples)
        if self._newest_version() - version > self.params.async_level:
            self.stats.dropped_stale += 1
            log.info("dropped work of v%d: outside the async window", version)
            return
        if self.tamper is not None:
            submission = self.tamper(submission)
        started = time.perf_counter()
        await self.submit(sign(submission, self.node.key))
        self.stats.submit_seconds += time.perf_counter() - started

    async def submit(self, signed: Signed[RolloutSubmission]) -> Signed[Verdict] | None:
        """Send to a validator found by role; another one on failure."""
        validators = list(self.node.peers_by_role().get("validator", []))
        random.shuffle(validators)
        for validator in validators:
            try:
                raw = await self.node.request(validator, SUBMIT, signed.raw, SUBMIT_LIMITS)
                verdict = decode(raw, Verdict)
            except (NetworkError, SwarmError) as exc:
                log.warning("validator %s did not take the submission: %s", validator[-8:], exc)
                if type(exc) is NetworkError:  # no stream at all: dial afresh next time
                    await self.node.forget_peer(validator)
                continue
            self.stats.submitted += 1
            if verdict.message.accepted:
                self.stats.accepted += 1
            else:
                self.stats.rejected += 1
                self.stats.last_reasons = list(verdict.message.reasons[:3])
                log.info(
                    "validator %s rejected work of v%d: %s",
                    validator[-8:],
                    signed.message.policy_version,
                    "; ".join(self.stats.last_reasons),
                )
            return verdict
        log.warning("no validator took the submission (%d known)", len(validators))
        await trio.sleep(1.0)  # none reachable now: give discovery a moment
        return None
