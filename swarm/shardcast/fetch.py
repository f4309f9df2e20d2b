"""Fetching a policy version from many providers at once.

The scheduler knows nothing about sockets: it drives a ``ShardSource`` (the data channel, a
libp2p stream, or a test double) and owns every decision:

- the manifest is checked (signature, genesis trainer, run, version) before any shard is asked
  for (``verify_manifest``);
- ``concurrency`` shard pulls run at once, each from a provider chosen by ``PeerBoard``
  (throughput and success averages, weighted random choice with exploration);
- every byte goes through a ``ShardSink`` that hashes it and writes it at its offset in the
  preallocated file; a shard counts only when its length and sha256 match the manifest, and it
  is fsynced and journalled before the next one is trusted to be on disk;
- a stall (no byte for ``stall_timeout`` seconds) cancels the pull; a corrupt or truncated shard
  drops that peer for the version at once, other failures spend its ``failure_budget``; the
  shard goes back in the queue for another provider; a provider whose upload slots are all
  taken (``PeerBusy``) is not at fault: it rests for ``have_refresh`` to twice that, and the
  shard goes back in the queue;
- the origin may refuse a shard it gave to enough peers already (``ShardElsewhere``,
  super-seeding): no fault; that shard is not asked of it for ``ELSEWHERE_DEFER`` s to twice
  that, and the origin rests as if busy;
- providers that hold only part of the version (nodes still fetching it) say which shards they
  hold (``have``); each is asked again as soon as it answers, saying how many shards we know
  it holds, and it holds the answer back until it holds more or ``have_wait`` seconds passed
  (a push of its new shards over our own request). A provider that answers at once with
  nothing new (one that cannot wait) is asked every ``have_refresh`` seconds instead.

Cancellation leaves the store consistent: verified shards stay verified, nothing is marked
complete, and the next fetch resumes where this one stopped.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from swarm.errors import (
    PeerError,
    PeerUnreachable,
    StorageError,
    SwarmError,
)
from swarm.messages import ShardManifest, Signed
from swarm.shardcast.manifest import fetch_manifest, verify_manifest
from swarm.shardcast.peers import PeerBoard
from swarm.shardcast.source import (
    PeerBusy,
    ShardElsewhere,
    ShardNotHeld,
    ShardSink,
    ShardSource,
)
from swarm.shardcast.store import ShardStore, VersionFile

log = logging.getLogger(__name__)

__all__ = [  # the manifest checks and the source types are re-exported for existing callers
    "FetchConfig",
    "FetchProgress",
    "FetchResult",
    "ProgressCallback",
    "ShardNotHeld",
    "ShardSink",
    "ShardSource",
    "fetch_manifest",
    "fetch_version",
    "verify_manifest",
]

_SCAN = 64
"""How many pending shards ``_next`` weighs per pick (bounds the cost for huge versions)."""
MIN_SOURCES = 2
"""Fewer peers than this holding any of a version, once each has answered, and the fetch asks
for more (``more_peers``)."""
RECRUIT_MAX_S = 60.0
"""While fewer than ``MIN_SOURCES`` peers hold the version, ``more_peers`` is asked again after
``have_wait`` seconds, twice that, and so on up to this: holders that finish their copies
later place their provider records later, and a real version takes minutes to copy."""
RECRUIT_AFTER_S = 1.0
"""The first ask for more holders comes once every peer has said what it holds, or after this
(a peer that has not answered by then is being dialed, at a cap or over a slow link). It
waited up to ``have_wait`` (5 s): in a 30-node run the newcomer copied the version from the
one holder it knew in 6 s, before the records named the other three."""
MorePeers = Callable[[], Awaitable[Sequence[str]]]
ELSEWHERE_DEFER = 2.5
"""Seconds (to twice that) a shard the origin refused to super-seed is not asked of it again."""


@dataclass(frozen=True)
class FetchConfig:
    concurrency: int = 4
    stall_timeout: float = 10.0
    failure_budget: int = 3
    explore: float = 0.1
    have_refresh: float = 1.0
    have_wait: float = 5.0
    """How long a provider may hold a ``have`` answer back until it holds a new shard."""
    per_peer: int = 2
    """At most this many pulls from one provider at once (spreads load, avoids thin slices)."""
    endgame: bool = True
    """When nothing is left to start, pull the slowest running shard again from an idle
    provider (into memory, one at a time); the first verified copy wins."""
    give_up_after: float = 30.0
    """Seconds without a verified shard, with no pull running, before the fetch gives up."""
    durable: bool = True


@dataclass
class FetchProgress:
    """A live view of one fetch (what the progress bar and ``status`` show)."""

    version: int
    total_bytes: int
    shards_total: int
    done_bytes: int = 0
    shards_done: int = 0
    resumed_shards: int = 0
    fetched_bytes: int = 0
    started_at: float = 0.0
    elapsed: float = 0.0
    pulls: dict[int, int] = field(default_factory=dict)
    board: PeerBoard | None = None
    empty: set[str] = field(default_factory=set)
    """Peers whose last holdings answer held none of the version, while the fetch runs: it
    polls them (they may start to hold it), and they are no use yet
    (``swarm.net.connections.ConnectionTrimmer.expendable``)."""

    @property
    def rate(self) -> float:
        """Bytes/s fetched by this run (resumed shards do not count)."""
        return self.fetched_bytes / self.elapsed if self.elapsed > 0 else 0.0

    def peers(self) -> list[dict[str, object]]:
        return [s.view() for s in self.board.stats.values()] if self.board else []

    def view(self) -> dict[str, object]:
        return {
            "version": self.version,
            "total_bytes": self.total_bytes,
            "done_bytes": self.done_bytes,
            "shards": f"{self.shards_done}/{self.shards_total}",
            "resumed_shards": self.resumed_shards,
            "rate_mib_s": round(self.rate / (1024 * 1024), 1),
            "peers": self.peers(),
        }


ProgressCallback = Callable[[FetchProgress], None]


@dataclass(frozen=True)
class FetchResult:
    version: int
    path: Path
    fetched_shards: int
    resumed_shards: int
    seconds: float
    progress: FetchProgress


class _Fetch:
    def __init__(
        self,
        vf: VersionFile,
        source: ShardSource,
        peers: Sequence[str],
        config: FetchConfig,
        rng: random.Random,
        on_progress: ProgressCallback | None,
        origins: Sequence[str] = (),
        more_peers: MorePeers | None = None,
    ) -> None:
        self.vf = vf
        self.more_peers = more_peers
        self.m = vf.manifest
        self.source = source
        self.config = config
        self.board = PeerBoard(
            failure_budget=config.failure_budget,
            explore=config.explore,
            rng=rng,
            origins=frozenset(origins),
        )
        self.board.add(peers)
        self.holdings: dict[str, bytes | None] = {}
        self.deferred: dict[tuple[str, int], float] = {}
        """(origin, shard) it refused to super-seed -> when to ask it for that shard again."""
        missing = vf.missing_indices()
        rng.shuffle(missing)  # receivers fetch in different orders, so they can trade shards
        self.pending: list[int] = missing
        self.running: dict[int, dict[str, ShardSink]] = {}
        self.claimed: set[int] = set()
        self.memory_pulls = 0
        self.changed = trio.Event()
        n = len(self.m.shard_hashes)
        self.progress = FetchProgress(
            version=self.m.version,
            total_bytes=self.m.total_size,
            shards_total=n,
            shards_done=n - len(missing),
            resumed_shards=n - len(missing),
            done_bytes=vf.verified_bytes(),
            started_at=trio.current_time(),
            board=self.board,
        )
        self.on_progress = on_progress
        self.last_progress = trio.current_time()
        self.error: SwarmError | None = None

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()
        self.progress.elapsed = trio.current_time() - self.progress.started_at
        if self.on_progress is not None:
            self.on_progress(self.progress)

    def _holds(self, peer: str, index: int) -> bool:
        if peer not in self.holdings:
            return False
        if self.deferred and self.deferred.get((peer, index), 0.0) > trio.current_time():
            return False
        bits = self.holdings[peer]
        return bits is None or (index < len(bits) and bits[index] == 1)

    async def _watch(self, peer: str) -> None:
        """Keep ``peer``'s holdings current until it holds everything or is dropped."""
        stats = self.board.stats[peer]
        while not stats.dropped:
            known = -1 if peer not in self.holdings else sum(self.holdings[peer] or b"")
            asked = trio.current_time()
            try:
                bits = await self.source.have(peer, self.m.version, known, self.config.have_wait)
            except ShardNotHeld:
                bits = b""
            except PeerBusy:  # its request slots are full: no fault, ask again in a moment
                await trio.sleep(self.config.have_refresh * (1 + self.board.rng.random()))
                continue
            except SwarmError as exc:
                self._failed(peer, str(exc), unreachable=self._worth_waiting(peer, exc))
                # Past its budget an unreachable holder rests (``PeerBoard.record_failure``).
                rest = stats.busy_until - trio.current_time()
                await trio.sleep(max(self.config.have_refresh, rest))
                continue
            self.holdings[peer] = bits
            if bits is not None and not any(bits):
                self.progress.empty.add(peer)
            else:
                self.progress.empty.discard(peer)
            self._notify()
            if bits is None:
                return  # it holds the whole version: nothing more to learn
            quick = trio.current_time() - asked < self.config.have_wait / 2
            if known >= 0 and sum(bits) <= known and quick:
                await trio.sleep(self.config.have_refresh)  # it cannot wait: poll it

    async def _refresh_holdings(self) -> None:
        async with trio.open_nursery() as nursery:
            for peer in self.board.usable():
                nursery.start_soon(self._watch, peer)
            nursery.start_soon(self._recruit, nursery)

    async def _recruit(self, nursery: trio.Nursery) -> None:
        """Once every peer has said what it holds (or ``RECRUIT_AFTER_S`` passed), and fewer than
        ``MIN_SOURCES`` of them hold any of the version, ask ``more_peers`` and watch the new
        ones too; again, less and less often (``RECRUIT_MAX_S``), while that stays so. A node
        with bounded connections holds a sample of the run, which may hold the version at one
        peer (the trainer): a newcomer of 30 loopback nodes with marks of 8 and 12 took all 31
        shards from one peer while 4 others held them, and another took all 123 from the
        trainer while the records of the 4 that had just copied it were still being placed
        (tests/integration/test_connection_bounds.py)."""
        if self.more_peers is None:
            return
        with trio.move_on_after(min(self.config.have_wait, RECRUIT_AFTER_S)):
            while any(p not in self.holdings for p in self.board.usable()):
                await self.changed.wait()
        pause = self.config.have_wait
        while True:
            holders = [p for p, bits in self.holdings.items() if bits is None or any(bits)]
            if len(holders) >= MIN_SOURCES:
                return
            added = [p for p in await self.more_peers() if p not in self.board.stats]
            log.info(
                "v%d: %d of our %d peers hold it; %d more from the records",
                self.m.version,
                len(holders),
                len(self.board.stats),
                len(added),
            )
            for peer in added:
                self.board.add([peer])
                nursery.start_soon(self._watch, peer)
            self._notify()
            await trio.sleep(pause)
            pause = min(2 * pause, RECRUIT_MAX_S)

    def _failed(
        self, peer: str, reason: str, *, fatal: bool = False, unreachable: bool = False
    ) -> bool:
        log.debug("v%d: %s failed: %s", self.m.version, peer, reason)
        return self.board.record_failure(
            peer, reason, fatal=fatal, unreachable=unreachable, now=trio.current_time()
        )

    def _worth_waiting(self, peer: str, exc: SwarmError) -> bool:
        """A failure to reach ``peer`` that should rest it, not drop it: it holds shards, as
        far as we know (a peer whose last ``have`` answer held nothing is not worth a dial
        at our cap: our trimmer lets such peers go first, and redialing them pushed out others
        we had polled for nothing, round and round, in the 30-node test)."""
        return isinstance(exc, PeerUnreachable) and peer not in self.progress.empty

    def _failure_report(self) -> str:
        return (
            "; ".join(
                f"{s.peer}: {s.last_error or 'holds none of the missing shards'}"
                for s in self.board.stats.values()
            )
            or "no providers"
        )

    def _free(self, peer: str) -> bool:
        s = self.board.stats[peer]
        return s.in_flight < self.config.per_peer and s.busy_until <= trio.current_time()

    def _next(self) -> tuple[int, str] | None:
        """The next (shard, peer) to pull: among the first ``_SCAN`` pending shards (in this
        receiver's random order), the one whose best free holder is fastest, rarer shards
        first on ties; the peer is then a weighted random choice among its free holders."""
        best: tuple[int, int, int] | None = None
        for pos, index in enumerate(self.pending[:_SCAN]):
            holders = [p for p in self.board.usable() if self._holds(p, index)]
            free = [p for p in holders if self._free(p)]
            if not free:
                continue
            # Speed in factors of two: among about equally fast choices the rarer shard wins.
            speed = round(math.log2(max(self.board.weight(p) for p in free)))
            key = (speed, -len(holders), -pos)
            if best is None or key > best:
                best = key
        if best is None:
            return None
        pos = -best[2]
        index = self.pending[pos]
        free = [p for p in self.board.usable() if self._holds(p, index) and self._free(p)]
        peer = self.board.choose(free)
        if peer is None:
            return None
        del self.pending[pos]
        return index, peer

    def _endgame(self) -> tuple[int, str] | None:
        """A shard being pulled from one peer, and an idle holder to pull it again from.

        Only idle peers are asked, so an endgame copy never slows a peer's other pulls."""
        if not self.config.endgame or self.memory_pulls > 0:
            return None
        running = sorted(
            (
                sinks
                for index, sinks in self.running.items()
                if len(sinks) == 1 and index not in self.claimed
            ),
            key=lambda sinks: next(iter(sinks.values())).received,
        )
        for sinks in running:
            index = next(iter(sinks.values())).index
            holders = [
                p
                for p in self.board.usable()
                if p not in sinks
                and self._holds(p, index)
                and not self.board.stats[p].in_flight
                and self._free(p)
            ]
            peer = self.board.choose(holders)
            if peer is not None:
                return index, peer
        return None

    async def worker(self, scope: trio.CancelScope) -> None:
        try:
            await self._work()
        except SwarmError as exc:  # the first error ends the fetch, and is what the caller sees
            if self.error is None:
                self.error = exc
            scope.cancel()

    async def _work(self) -> None:
        while self.pending or self.running:
            picked = self._next()
            in_memory = False
            if picked is None:  # nothing new can start: pull a slow running shard again
                picked = self._endgame()
                in_memory = picked is not None
            if picked is None:
                if not self.pending:
                    await self.changed.wait()
                    continue
                idle = trio.current_time() - self.last_progress
                if not self.board.usable() or (
                    not self.running and idle > self.config.give_up_after
                ):
                    raise PeerError(
                        f"version {self.m.version}: every provider failed, {len(self.pending)}"
                        f" shards missing ({self._failure_report()})"
                    )
                with trio.move_on_after(self.config.have_refresh):
                    await self.changed.wait()
                continue
            index, peer = picked
            ok = await self._pull(index, peer, in_memory)
            if not ok and index not in self.claimed and index not in self.running:
                self.pending.append(index)
            self._notify()

    async def _pull(self, index: int, peer: str, in_memory: bool = False) -> bool:
        sink = ShardSink(self.vf, index, self.config.stall_timeout, in_memory=in_memory)
        self.running.setdefault(index, {})[peer] = sink
        self.memory_pulls += in_memory
        self.board.started(peer)
        try:
            return await self._pull_into(sink, peer)
        finally:
            self.board.finished(peer)
            self.memory_pulls -= in_memory
            sinks = self.running.get(index, {})
            sinks.pop(peer, None)
            if not sinks:
                self.running.pop(index, None)

    async def _pull_into(self, sink: ShardSink, peer: str) -> bool:
        index = sink.index
        self.progress.pulls[index] = self.progress.pulls.get(index, 0) + 1
        start = trio.current_time()
        try:
            with trio.CancelScope(deadline=start + self.config.stall_timeout) as scope:
                sink.scope = scope
                await self.source.pull(peer, self.m.version, index, sink)
            if sink.superseded:
                return False
            if scope.cancelled_caught:
                self._failed(
                    peer, f"stalled: no byte of shard {index} for {self.config.stall_timeout:g} s"
                )
                return False
        except StorageError:
            raise
        except ShardElsewhere:
            # Not this shard for a while (its holders serve it), and not the origin at all for
            # a moment: asked for every other shard at once, it would refuse them in a storm
            # (11,000 refusals in one N = 25 bench run before this rest).
            now, jitter = trio.current_time(), 1 + self.board.rng.random()
            self.deferred[(peer, index)] = now + ELSEWHERE_DEFER * jitter
            self.board.record_busy(peer, now + self.config.have_refresh * jitter)
            self.board.stats[peer].elsewhere += 1
            return False
        except PeerBusy:
            rest = self.config.have_refresh * (1 + self.board.rng.random())
            self.board.record_busy(peer, trio.current_time() + rest)
            return False
        except ShardNotHeld:
            # Stop asking it for this shard until its next ``have`` answer says otherwise.
            n = len(self.m.shard_hashes)
            held = self.holdings.get(peer, b"")
            # It said it held this shard (that is why it was asked): that costs its budget.
            self._failed(peer, f"said it holds shard {index}, then refused it")
            bits = bytearray(b"\x01" * n if held is None else held.ljust(n, b"\0"))
            bits[index] = 0
            self.holdings[peer] = bytes(bits)
            return False
        except SwarmError as exc:
            if sink.superseded:
                return False
            self._failed(peer, str(exc), unreachable=self._worth_waiting(peer, exc))
            return False
        finally:
            sink.scope = None
        if sink.received != sink.length:
            self._failed(
                peer, f"truncated shard {index}: {sink.received} of {sink.length} bytes", fatal=True
            )
            return False
        if sink.digest() != self.m.shard_hashes[index]:
            self._failed(peer, f"corrupt shard {index}: sha256 mismatch", fatal=True)
            return False
        self.board.record_success(peer, sink.length, trio.current_time() - start)
        if index in self.claimed:
            return True  # another pull of this shard verified first
        self.claimed.add(index)
        for other in self.running.get(index, {}).values():
            if other is not sink and other.scope is not None:
                other.superseded = True
                other.scope.cancel()
        sink.commit()
        if self.config.durable:  # fdatasync blocks: keep it off the event loop
            await trio.to_thread.run_sync(self.vf.mark_verified, index)
        else:
            self.vf.mark_verified(index, durable=False)
        self.progress.shards_done += 1
        self.progress.done_bytes += sink.length
        self.progress.fetched_bytes += sink.length
        self.last_progress = trio.current_time()
        return True

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._refresh_holdings)
                async with trio.open_nursery() as workers:
                    for _ in range(max(1, self.config.concurrency)):
                        workers.start_soon(self.worker, nursery.cancel_scope)
                nursery.cancel_scope.cancel()
        finally:
            self.progress.empty.clear()  # polled no more
        if self.error is not None:
            raise self.error


async def fetch_version(
    store: ShardStore,
    manifest: Signed[ShardManifest],
    source: ShardSource,
    peers: Sequence[str],
    *,
    config: FetchConfig | None = None,
    on_progress: ProgressCallback | None = None,
    rng: random.Random | None = None,
    origins: Sequence[str] = (),
    more_peers: MorePeers | None = None,
) -> FetchResult:
    """Fetch ``manifest``'s version into ``store`` from ``peers``; resumes what is on disk.
    ``origins``: the peers that published it (trainers), asked last for shards others hold.
    ``more_peers``: asked for other providers while fewer than ``MIN_SOURCES`` of the peers
    hold any of it (``RECRUIT_MAX_S``).

    Returns when every shard is verified, fsynced and the version is marked complete (the
    caller then advertises it and serves it). Raises ``StorageError`` (no room, disk full),
    ``PeerError`` when no usable provider is left for the missing shards.
    """
    config = config or FetchConfig()
    store.check_room(manifest.message)
    with store.open(manifest) as vf:
        if not vf.complete:
            vf.preallocate()
        job = _Fetch(
            vf, source, peers, config, rng or random.Random(), on_progress, origins, more_peers
        )
        if not vf.complete:
            await job.run()
            await trio.to_thread.run_sync(vf.mark_complete)
        job._notify()
    store.prune(keep_also=manifest.message.version)
    progress = job.progress
    return FetchResult(
        version=manifest.message.version,
        path=store.directory(manifest.message.version) / "data",
        fetched_shards=progress.shards_done - progress.resumed_shards,
        resumed_shards=progress.resumed_shards,
        seconds=progress.elapsed,
        progress=progress,
    )
