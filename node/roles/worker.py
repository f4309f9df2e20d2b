"""The inference role: follow the newest policy, generate the assigned groups with proofs, sign
and submit them to a validator.

The model runs off the event loop (a child process in production, a thread in tests), so the
node keeps gossiping and serving shards while it generates. A newer version is fetched in the
background while generation continues on the one loaded; work made with a version that has left
the async window by the time it is done is dropped, never submitted.

Request counters (``RequestCounters``) are persisted in the run's folder and advanced *before*
the work starts, so a restarted worker never repeats a counter: a validator would take that as a
replay and slash it. In a run with a quota (``RunParams.quota``, requests per worker per
version) each version has its own counters ``0 .. quota - 1`` (``worker.counters``); once the
newest version's are used the worker waits for the next version instead of going past them (a
validator refuses a counter outside the quota). The assignment of such a run mixes the version's
manifest id, which the worker learns from the announcement of the version it fetched
(``Held.manifest_id``). A legacy run (``quota == 0``) keeps one counter across versions
(``worker.counter``) and the assignment without the manifest, as before.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from node.compute.engine import Engine
from node.compute.healing import EngineHealer
from node.policy_feed import PolicyFeed
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.run import TaskSource, suite_for
from node.runtime import Node
from swarm.assignment import assign, assignment_key
from swarm.errors import (
    ConfigError,
    EngineError,
    NetworkError,
    PeerError,
    ProofError,
    SwarmError,
)
from swarm.messages import PolicyAnnouncement, RolloutSubmission, Signed, Verdict, decode, sign
from swarm.net.names import SUBMIT
from swarm.net.protocols import SUBMIT_LIMITS

log = logging.getLogger(__name__)
SUBMIT_ATTEMPTS = 10
"""Tries to hand one submission to a validator before its work is given up."""

Tamper = Callable[[RolloutSubmission], RolloutSubmission]
"""A cheating worker's edit of its own submission (tests and the demo's cheater only)."""


def _write_durably(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, synced to disk before it replaces the old file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


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
        _write_durably(self.path, str(value + 1))
        self._value = value + 1
        return value


class RequestCounters:
    """A worker's durable request counters for each policy version.

    ``quota == 0`` (a legacy run): one ``Counter`` for every version (``worker.counter``), as
    before quotas. ``quota > 0``: per version, ``0 .. quota - 1``, stored as a JSON map
    (``worker.counters``: version -> next counter) before ``next`` returns; the map keeps the
    ``keep`` newest versions (older ones can no longer be submitted)."""

    def __init__(self, run_dir: Path, quota: int, *, keep: int) -> None:
        self.quota = quota
        self.keep = max(1, keep)
        self._legacy = Counter(run_dir / "worker.counter") if quota == 0 else None
        self.path = run_dir / "worker.counters"
        self._next: dict[int, int] = {}
        if self._legacy is None:
            try:
                stored = json.loads(self.path.read_text())
                self._next = {int(v): int(n) for v, n in stored.items()}
            except FileNotFoundError:
                pass
            except (ValueError, AttributeError) as exc:
                raise ConfigError(
                    f"the request counters in {self.path} are unreadable ({exc}); a worker that"
                    " forgets them would repeat a counter and be slashed: restore the file, or"
                    " delete it only if this key never worked on the versions of the window"
                ) from exc

    def left(self, version: int) -> int | None:
        """Requests of ``version`` still to make (None: unbounded, a legacy run)."""
        if self._legacy is not None:
            return None
        return max(0, self.quota - self._next.get(version, 0))

    def used(self, version: int) -> int:
        return 0 if self._legacy is not None else min(self.quota, self._next.get(version, 0))

    def next(self, version: int) -> int | None:
        """The next counter of ``version``, stored as used before it is returned; None once
        the quota of ``version`` is used."""
        if self._legacy is not None:
            return self._legacy.next()
        value = self._next.get(version, 0)
        if value >= self.quota:
            return None
        self._next[version] = value + 1
        for old in sorted(self._next)[: -self.keep]:
            del self._next[old]
        _write_durably(self.path, json.dumps({str(v): n for v, n in sorted(self._next.items())}))
        return value


@dataclass(frozen=True)
class Held:
    """A fetched policy version: its weights file and its manifest id (from the announcement
    it was fetched by; the file was checked against that manifest)."""

    path: Path
    manifest_id: bytes


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
    quota: int = 0
    """Requests per version the run allows (0: unbounded, a legacy run)."""
    quota_used: dict[str, str] = field(default_factory=dict)
    """Requests made of each version held, as ``"37 of 64"`` (runs with a quota)."""
    quota_waits: int = 0
    """Times the newest version's quota was used up and the worker waited for the next one."""
    unprovable_versions: list[int] = field(default_factory=list)
    """Versions whose weights gave work no proof can commit to (inf or NaN): left unused."""


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
        self.counters = RequestCounters(
            run_dir, self.params.quota, keep=self.params.async_level + 2
        )
        self.tamper = tamper
        self.stats = WorkerStats(quota=self.params.quota)
        self.loaded: int | None = None
        self._loaded_manifest: bytes | None = None
        self._fetched: dict[int, Held] = {}
        self._have_new = trio.Event()
        self._refused = False
        """The last ``submit`` was refused by a validator's answer (not lost on the way)."""
        self.healer = EngineHealer(engine, on_give_up=self._withdraw)
        """Restarts a dead engine child (the validator's backoff and limit)."""

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
                if self.counters.left(held) == 0:
                    # Every request of the newest version is made: the next version brings a
                    # new quota; going past this one would only be refused.
                    if self._have_new.is_set():  # set by a fetch already looked at
                        self._have_new = trio.Event()
                        continue
                    self.stats.quota_waits += 1
                    log.info(
                        "all %d requests of policy v%d made; waiting for the next version",
                        self.params.quota,
                        held,
                    )
                    await self._have_new.wait()
                    self._have_new = trio.Event()
                    continue
                try:
                    await self._load_newest()
                    await self.work_once()
                except EngineError as exc:
                    # The request's counter is spent (never reused); its work is lost, the
                    # next request starts on the restarted child, which reloads its weights.
                    if not await self.healer.recover(exc):
                        await trio.sleep_forever()  # given up: status and the log say why
                except ProofError as exc:
                    self._leave_unprovable(exc)

    def _leave_unprovable(self, exc: ProofError) -> None:
        """The loaded version's weights give work no proof can commit to (a broken policy:
        inf or NaN in its hidden states). Leave it, and work on an older version still in the
        window or wait for the next one; the node stays up."""
        bad = self.loaded
        log.error(
            "policy v%s gives work no proof can commit to (%s); not used: working on the next"
            " version",
            bad,
            exc,
        )
        if bad is not None:
            self._fetched.pop(bad, None)
            self.stats.unprovable_versions.append(bad)
        self.loaded = None

    async def _withdraw(self, why: str) -> None:
        """The engine cannot be brought back: stop advertising the inference role (the node
        stays up: its shards are still served, ``status`` says why it no longer works)."""
        await self.node.membership.withdraw()

    async def _follow(self) -> None:
        """Fetch every newer announced version in the background."""
        wanted = 0
        while True:
            announcement = await self.node.policy.wait_for(wanted)
            version = announcement.message.version
            try:
                path = await self.feed.fetch(announcement)
                self._fetched[version] = Held(path, announcement.message.manifest_id)
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
            held = self._fetched[version]
            await trio.to_thread.run_sync(self.engine.load_weights, str(held.path))
            self.loaded = version
            self._loaded_manifest = held.manifest_id
            log.info("inference on policy v%d", version)

    def _newest_version(self) -> int:
        newest: Signed[PolicyAnnouncement] | None = self.node.policy.newest
        return -1 if newest is None else newest.message.version

    async def work_once(self) -> None:
        """One request: assignment, generation with proofs, signature, submission."""
        assert self.loaded is not None
        version = self.loaded
        counter = self.counters.next(version)
        self._show_quota()
        if counter is None:
            return  # the quota of this version is used: ``run`` waits for the next one
        assignment = assign(
            self.node.run_id,
            version,
            self.node.peer_id,
            counter,
            n_prompts=self.params.batch_prompts,
            suite_size=self.suite.size,
            excluded=self.suite.excluded,
            manifest_id=assignment_key(self.params.quota, self._loaded_manifest),
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
        signed = sign(submission, self.node.key)
        # The request's counter is spent: work no validator took is offered again (each try
        # waits a second when none took it), not lost, while its version is in the window.
        # Seen under CI load: one of a quota's three submissions found no validator once.
        for _ in range(SUBMIT_ATTEMPTS):
            self._refused = False
            if await self.submit(signed) is not None or self._refused:
                break  # judged, or refused by a validator (an answer, not a lost message)
            if self._newest_version() - version > self.params.async_level:
                self.stats.dropped_stale += 1
                log.info("dropped work of v%d: outside the async window", version)
                break
        else:
            log.warning(
                "gave up on request %d of v%d: no validator took it in %d tries",
                counter,
                version,
                SUBMIT_ATTEMPTS,
            )
        self.stats.submit_seconds += time.perf_counter() - started

    def _show_quota(self) -> None:
        """``stats.quota_used``: requests made of each version held (runs with a quota)."""
        if self.params.quota:
            self.stats.quota_used = {
                f"v{v}": f"{self.counters.used(v)} of {self.params.quota}"
                for v in sorted(self._fetched)
            }

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
                self._refused = self._refused or isinstance(exc, PeerError)
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
