"""A discrete-event simulation (SimPy) of one SHARDCAST broadcast and its policy gossip.

``simulate(params, n, version_bytes, links, seed)`` broadcasts one version from an origin to
``n`` nodes; ``bench/scale_sim.py`` calibrates it on ``bench/scale.py`` and projects with it.

What the model copies from our implementation (the decisions it does not own):

- fetch (``swarm.shardcast.fetch``): each node runs ``parallel_sources`` (``FetchConfig.
  concurrency``, 4) pulls at once, at most ``per_peer`` (2) from one provider; the next piece is
  the startable one (among the first 64 pending, in the node's own random order) whose best free
  holder is fastest in factors of two, rarer first, then pending order; the provider is a
  weighted random choice, ``rate * success**2 / (1 + in_flight)**3`` (``PeerBoard``; unmeasured
  peers count as the best known one, 50 MiB/s before anything is measured; uniform with
  probability 0.1); refusals spend the failure budget (3, then the peer is dropped for the
  version), a ``PeerBusy`` answer (all 4 upload slots taken) only rests the provider for 1-2
  ``have_refresh_s``; the endgame pulls the slowest running piece again from an idle holder,
  one at a time, and the first copy wins;
- who holds what: a fetcher's providers are fixed when its fetch starts (``ShardcastService.
  providers``: the trainers and ``MAX_SOURCES`` (8) random connected run peers); a
  provider's new pieces become visible ``have_refresh_s`` (0.5 s, ``PolicyFeed``) after it
  verified them; every holder serves at once;
- serving limits: the data channel accepts ``channel_slots`` (64) connections, kept per asker
  and reused until the fetch ends (``DataChannelSource``) or they idle for 60 s; an asker the
  channel turns away uses libp2p streams to that peer for the rest of the fetch, and the shard
  protocol serves ``stream_slots`` (16, ``StreamLimits`` default) requests at once, refusing
  more (a failure for the asker);
- a fetch that sees no verified piece for 30 s with nothing running gives up (``give_up_after``);
  the sim counts it and restarts the fetch with a fresh provider board 2 s later (the catch-up
  loop of ``PolicyFeed``);
- gossip (``swarm.net.overlay``): GossipSub forwards a new message at once to its mesh peers
  (degree D = 6); a node starts its fetch when the announcement arrives, after ``lookup_s``
  (0 with the issue-17 code, which skips the DHT lookup when it knows 8 peers; the run's
  lookup p50 before it), growing with log N as Kademlia lookups do.

Simplifications, and why they do not change the answer much:

- bandwidth is shared per node, not by TCP: a flow's rate is the smallest of its source's upload
  split evenly over that source's flows, its receiver's download split over its flows, and (one
  machine hosting every node: the calibration) the host's capacity split over all flows.
  Rates are recomputed whenever a flow starts or ends at either end. This conserves every
  node's capacity and ignores TCP's slow start and RTT unfairness: at home rates a 32 MiB shard
  takes seconds to minutes, far beyond a WAN RTT;
- pieces: a 62 GB checkpoint is 1,848 shards of 32 MiB; 10,000 nodes x 1,848 transfers is too
  much for a bounded run, so shards are grouped into equal pieces so that nodes x pieces stays
  under ``max_transfers`` (30,000: about 1 GB pieces at 1,000 nodes, 10 GB at 10,000), and the
  scheduler's clocks (have refresh, busy rest, give-up, retry, idle timeout) stretch by the
  same factor: an aggregated run is the same system with fewer, larger shards, slowed down
  uniformly. Coarser pieces pipeline worse, so grouping makes the projection slower, never
  faster; the projection reruns 1,000 nodes with 4x finer pieces to show by how much;
- rates: a flow's rate is updated when it moves by more than 2% (``RATE_TOLERANCE``);
- no churn, no NAT/relayed links (every link is direct), no CPU limit on a home node, no disk
  limit, no losses; ``have`` requests and the manifest fetch cost nothing; the gossip mesh is a
  random graph in which every node grafts ceil(D/2) peers (mean degree D), and a hop's latency
  is gamma distributed (shape 2) around ``per_hop_s``; no IHAVE/IWANT repair (the mesh reaches
  every node of a connected graph);
- the run's measured figures are taken as they are: per-node serving rate (the bench's upload
  cap), the origin's rate, connections per node (the size of a fetcher's provider set, also
  kept at 1,000 and 10,000 nodes: libp2p connection limits bound it, see ``HostLimits``).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import simpy

MIB = 1024 * 1024
MBIT = 1_000_000 / 8
"""Bytes/s of one Mbit/s."""
GB = 1_000_000_000
DEFAULT_RATE = 50.0 * MIB
"""``swarm.shardcast.peers.DEFAULT_RATE``: a provider's rate before anything is measured."""
SCAN = 64
"""``swarm.shardcast.fetch._SCAN``: pending pieces weighed per pick."""
WAKE_PER_SLOT = 4
"""Askers woken when a busy provider frees a slot (``busy_wake="slot"``)."""
RATE_TOLERANCE = 0.02
"""Flow rates are updated when they move by more than 2% (a big server's every new flow would
otherwise reschedule all of its flows)."""


@dataclass(frozen=True)
class HomeLinks:
    """Contributors' links: upload lognormal with median ``median_mbit`` and 10% at or above
    ``p90_mbit`` (capped at ``max_mbit``); download ``down_factor`` x upload, clamped to
    [``down_min_mbit``, ``down_max_mbit``] (asymmetric cable/DSL; fibre is symmetric at the cap).

    The default is an assumption, not a measurement: home uplinks in rich countries mostly sit
    at 10-40 Mbit/s (cable, DSL) with a fibre tail at 100-1,000 Mbit/s."""

    median_mbit: float = 20.0
    p90_mbit: float = 100.0
    max_mbit: float = 1000.0
    down_factor: float = 5.0
    down_min_mbit: float = 100.0
    down_max_mbit: float = 1000.0

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(upload, download) in bytes/s for ``n`` contributors."""
        sigma = math.log(self.p90_mbit / self.median_mbit) / 1.2815515655446004
        up = np.minimum(rng.lognormal(math.log(self.median_mbit), sigma, n), self.max_mbit)
        down = np.clip(up * self.down_factor, self.down_min_mbit, self.down_max_mbit)
        return up * MBIT, down * MBIT

    def describe(self) -> str:
        return (
            f"upload lognormal, median {self.median_mbit:g} Mbit/s, 10% >= {self.p90_mbit:g}"
            f" Mbit/s, cap {self.max_mbit:g}; download {self.down_factor:g}x upload in"
            f" [{self.down_min_mbit:g}, {self.down_max_mbit:g}] Mbit/s"
        )


@dataclass(frozen=True)
class SimParams:
    """Everything the model needs; rates in bytes/s, times in seconds."""

    origin_up: float
    node_up: float
    node_down: float = math.inf
    host_cap: float | None = None
    """One machine hosts every node (the calibration run): all flows share this capacity."""
    shard_bytes: int = 32 * MIB
    parallel_sources: int = 4
    per_peer: int = 2
    channel_slots: int = 64
    stream_slots: int = 16
    origin_slots: int | None = None
    """Data channel connections of the origin and relays (``None``: ``channel_slots``)."""
    upload_slots: int | None = 4
    """``ShardServer.max_uploads`` (``node.shardcast.UPLOAD_SLOTS``): spans a node sends at
    once; past them the asker is told ``PeerBusy`` (no fault) and rests that provider for
    ``have_refresh_s`` x U(1, 2). ``None``: no limit (the code before issue 17)."""
    origin_upload_slots: int | None = None
    """The origin's and relays' upload slots when they differ (a what-if)."""
    busy_wake: str = "timer"
    """"timer": a rested provider is asked again when its rest is over (the code); "slot":
    when it frees a slot (cheaper to simulate: no polling; optimistic by at most one rest)."""
    idle_timeout_s: float = 60.0
    failure_budget: int = 3
    explore: float = 0.1
    have_refresh_s: float = 0.5
    give_up_s: float = 30.0
    retry_s: float = 2.0
    lookup_s: float = 0.0
    """Delay between the announcement and the first pull (provider lookup, manifest)."""
    lookup_ref_n: int = 100
    per_hop_s: float = 0.01
    gossip_degree: int = 6
    neighbors: int = 8
    """Providers per fetch besides origin and relays: ``node.shardcast.MAX_SOURCES`` (8) of the
    connected run peers, at random (before issue 17: all of them)."""
    serve: bool = True
    """False: nodes fetch from the origin (and relays) only and serve nobody."""
    relays: int = 0
    relay_up: float = 10_000 * MBIT
    relay_down: float = 10_000 * MBIT
    endgame: bool = True
    max_transfers: int = 30_000
    horizon_s: float = 30 * 24 * 3600.0


class _Flow:
    """One pull of one piece from ``src`` to ``dst``, at the rate ``Simulation._rate`` gives."""

    __slots__ = (
        "at",
        "cancelled",
        "done",
        "dst",
        "gen",
        "left",
        "path",
        "pi",
        "rate",
        "size",
        "src",
    )

    def __init__(self, src: int, dst: int, size: float, pi: int, path: str, done: Any) -> None:
        self.src, self.dst, self.size, self.pi, self.path, self.done = (
            src,
            dst,
            size,
            pi,
            path,
            done,
        )
        self.left, self.rate, self.at, self.gen, self.cancelled = size, 0.0, 0.0, 0, False


@dataclass
class _Fetcher:
    node: int
    prov: np.ndarray
    pending: list[int]
    rate: np.ndarray = field(init=False)
    success: np.ndarray = field(init=False)
    failures: np.ndarray = field(init=False)
    inflight: np.ndarray = field(init=False)
    dropped: np.ndarray = field(init=False)
    no_channel: np.ndarray = field(init=False)
    busy_until: np.ndarray = field(init=False)
    running: dict[int, list[_Flow]] = field(default_factory=dict)
    claimed: set[int] = field(default_factory=set)
    memory_pulls: int = 0
    last_progress: float = 0.0
    done: int = 0
    finished_at: float = math.inf
    changed: Any = None
    wake_pending: bool = False
    index: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {int(node): i for i, node in enumerate(self.prov)}
        self.reset()

    def reset(self) -> None:
        c = len(self.prov)
        self.rate = np.full(c, np.nan)
        self.success = np.ones(c)
        self.failures = np.zeros(c, dtype=np.int64)
        self.inflight = np.zeros(c, dtype=np.int64)
        self.dropped = np.zeros(c, dtype=bool)
        self.no_channel = np.zeros(c, dtype=bool)
        self.busy_until = np.zeros(c)


class Simulation:
    """One broadcast of one version from node 0 (the origin) to ``n`` contributors."""

    def __init__(
        self,
        p: SimParams,
        n: int,
        version_bytes: int,
        upload_dist: HomeLinks | None = None,
        seed: int = 0,
    ) -> None:
        self.p = p
        self.n = n
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(seed)
        self.prng = random.Random(seed)
        shards = max(1, math.ceil(version_bytes / p.shard_bytes))
        per = max(1, math.ceil(shards * (n + p.relays) / p.max_transfers))
        piece = per * p.shard_bytes
        self.pieces = math.ceil(version_bytes / piece)
        self.piece_size = [float(piece)] * self.pieces
        self.piece_size[-1] = float(version_bytes - piece * (self.pieces - 1))
        self.shards, self.shards_per_piece = shards, per
        # The scheduler's clocks stretch with the piece: an aggregated run is the same system
        # with fewer, larger shards, slowed down uniformly (a 30 s give-up on a 32 MiB shard is
        # a 30 x per s give-up on a piece of ``per`` shards).
        self.t = replace(
            p,
            have_refresh_s=p.have_refresh_s * per,
            give_up_s=p.give_up_s * per,
            retry_s=p.retry_s * per,
            idle_timeout_s=p.idle_timeout_s * per,
        )
        r = p.relays
        m = 1 + r + n
        self.first = 1 + r  # contributors are first .. m - 1
        up = np.full(m, p.node_up, dtype=float)
        down = np.full(m, p.node_down, dtype=float)
        if upload_dist is not None:
            up[self.first :], down[self.first :] = upload_dist.sample(self.rng, n)
        up[0], down[0] = p.origin_up, math.inf
        up[1 : self.first], down[1 : self.first] = p.relay_up, p.relay_down
        self.up, self.down = up, down
        self.got_at = np.full((m, self.pieces), np.inf)
        self.got_at[0, :] = -np.inf
        # Flows in dicts, not sets: insertion order keeps a seed's run reproducible.
        self.up_flows: list[dict[_Flow, None]] = [{} for _ in range(m)]
        self.down_flows: list[dict[_Flow, None]] = [{} for _ in range(m)]
        self.active: dict[_Flow, None] = {}
        self.share = np.full(m, np.inf)  # each source's share when last reflowed
        self.level = np.full(m, np.inf)  # each receiver's water level
        self.busy_waiters: list[list[int]] = [[] for _ in range(m)]
        self.chan: list[dict[int, list[float]]] = [
            {} for _ in range(m)
        ]  # asker: [conns, used, busy]
        self.chan_total = np.zeros(m, dtype=np.int64)
        self.slots = np.full(m, p.channel_slots, dtype=np.int64)
        self.slots[: self.first] = p.origin_slots or p.channel_slots
        self.origin_slots = p.origin_upload_slots or p.upload_slots
        self.stream_active = np.zeros(m, dtype=np.int64)
        self.served = np.zeros(m)
        self.announced = np.full(m, np.inf)
        self.fetchers: dict[int, _Fetcher] = {}
        self.starved: set[int] = set()
        self.finished = 0
        self.all_done = self.env.event()
        self.counts = {
            "busy": 0,
            "refusals": 0,
            "stream_fallbacks": 0,
            "gave_up": 0,
            "endgame_pulls": 0,
        }
        self.peers = self._provider_graph()

    # --- graphs -----------------------------------------------------------------------------
    def _random_graph(self, half_degree: int) -> list[list[int]]:
        """Contributors only: each grafts ``half_degree`` random others; links are symmetric."""
        n, first = self.n, self.first
        adj: list[set[int]] = [set() for _ in range(n)]
        if n > 1 and half_degree > 0:
            k = min(half_degree, n - 1)
            picks = self.rng.integers(0, n - 1, size=(n, k))
            for i in range(n):
                for j in picks[i]:
                    j = int(j) + (j >= i)  # skip self
                    adj[i].add(j)
                    adj[j].add(i)
        return [sorted(first + j for j in a) for a in adj]

    def _provider_graph(self) -> list[list[int]]:
        if not self.p.serve:
            return [[] for _ in range(self.n)]
        return self._random_graph(math.ceil(self.p.neighbors / 2))

    # --- gossip -----------------------------------------------------------------------------
    def _gossip(self) -> None:
        """The announcement floods the mesh from the origin (linked to D random nodes) and the
        relays; each arrival starts that node's fetch after the provider lookup."""
        d = self.p.gossip_degree
        mesh = self._random_graph(math.ceil(d / 2))
        ids = list(range(self.first, self.first + self.n))
        origin_peers = self.prng.sample(ids, min(d, len(ids)))
        lookup = self.p.lookup_s * max(1.0, math.log(self.n) / math.log(self.p.lookup_ref_n))

        def hop() -> float:
            return float(self.rng.exponential(self.p.per_hop_s)) if self.p.per_hop_s else 0.0

        def arrive(node: int) -> None:
            if self.announced[node] <= self.env.now:
                return
            self.announced[node] = self.env.now
            self.env.process(self._fetch(node, lookup))
            if node >= self.first:
                for peer in mesh[node - self.first]:
                    if self.announced[peer] == np.inf:
                        self.env.timeout(hop()).callbacks.append(lambda _e, v=peer: arrive(v))

        for relay in range(1, self.first):
            arrive(relay)  # the relays are told directly, with the publish
        for peer in origin_peers:
            self.env.timeout(hop()).callbacks.append(lambda _e, v=peer: arrive(v))

    # --- bandwidth --------------------------------------------------------------------------
    def _advance(self, f: _Flow) -> None:
        now = self.env.now
        f.left = max(0.0, f.left - f.rate * (now - f.at))
        f.at = now

    def _share(self, src: int) -> float:
        """A source's upload split evenly over its flows (the cap each flow brings along)."""
        return float(self.up[src]) / len(self.up_flows[src])

    def _level(self, dst: int) -> float:
        """Max-min water level of ``dst``'s download over its flows, each capped by its source's
        share: a flow gets min(its cap, level), so a fast source can use what slow ones leave."""
        left = float(self.down[dst])
        if left == math.inf:
            return math.inf
        caps = sorted(self._share(f.src) for f in self.down_flows[dst])
        for i, cap in enumerate(caps):
            fair = left / (len(caps) - i)
            if cap >= fair:
                return fair
            left -= cap
        return math.inf

    def _reflow(self, src: int, dst: int) -> None:
        """Rates after a flow started or ended between ``src`` and ``dst``: the flows into
        ``dst``, and into each receiver of ``src`` whose level ``src``'s new share can move (a
        share that stays at or above a receiver's level leaves that level alone)."""
        old, new = self.share[src], self._share(src) if self.up_flows[src] else math.inf
        receivers = {dst}
        if math.isinf(old) or math.isinf(new) or abs(new - old) > RATE_TOLERANCE * old:
            self.share[src] = new
            low = min(old, new)
            receivers |= {f.dst for f in self.up_flows[src] if low < self.level[f.dst]}
        host = self.p.host_cap / len(self.active) if self.p.host_cap and self.active else math.inf
        if host < math.inf:  # one machine: every flow's host share moved
            receivers |= {f.dst for f in self.active}
        for r in receivers:
            self.level[r] = self._level(r)
        for r in receivers:
            for f in self.down_flows[r]:
                rate = min(self._share(f.src), self.level[r], host)
                if abs(rate - f.rate) <= RATE_TOLERANCE * f.rate:
                    continue
                self._advance(f)
                f.rate, f.gen = rate, f.gen + 1
                self.env.timeout(f.left / rate).callbacks.append(
                    lambda _e, g=f.gen, fl=f: self._arrived(fl, g)
                )

    def _arrived(self, f: _Flow, gen: int) -> None:
        if f.gen != gen or f.cancelled:
            return
        self._advance(f)
        f.left = 0.0
        self._stop(f)
        f.done.succeed(True)

    def _start(self, f: _Flow) -> None:
        f.at = self.env.now
        self.up_flows[f.src][f] = None
        self.down_flows[f.dst][f] = None
        self.active[f] = None
        self._reflow(f.src, f.dst)

    def _stop(self, f: _Flow) -> None:
        self._advance(f)
        self.served[f.src] += f.size - f.left
        self.up_flows[f.src].pop(f, None)
        self.down_flows[f.dst].pop(f, None)
        self.active.pop(f, None)
        f.gen += 1
        self._reflow(f.src, f.dst)
        waiters = self.busy_waiters[f.src]
        for node in waiters[:WAKE_PER_SLOT]:  # a slot is free: the first turned away ask again
            fe = self.fetchers[node]
            fe.busy_until[fe.index[f.src]] = 0.0
            self._notify(fe)
        del waiters[:WAKE_PER_SLOT]

    def _cancel(self, f: _Flow) -> None:
        if f.done.triggered:
            return
        f.cancelled = True
        self._stop(f)
        f.done.succeed(False)

    # --- serving limits ---------------------------------------------------------------------
    def _admit(self, fe: _Fetcher, pi: int) -> str | None:
        """The path a pull from provider ``pi`` takes: an idle or new data channel connection,
        else (for the rest of this fetch) a libp2p stream slot; "busy": every upload slot is
        taken; ``None``: refused (the stream protocol's limit: a failure)."""
        src = int(fe.prov[pi])
        slots = self.p.upload_slots if src >= self.first else self.origin_slots
        if slots is not None and len(self.up_flows[src]) >= slots:
            self.counts["busy"] += 1
            return "busy"
        if not fe.no_channel[pi]:
            conns = self.chan[src]
            entry = conns.get(fe.node)
            if entry is not None and entry[0] > entry[2]:
                entry[2] += 1
                return "channel"
            if self.chan_total[src] >= self.slots[src]:
                self._reclaim(src)
            if self.chan_total[src] < self.slots[src]:
                entry = conns.setdefault(fe.node, [0, 0.0, 0])
                entry[0] += 1
                entry[2] += 1
                self.chan_total[src] += 1
                return "channel"
            fe.no_channel[pi] = True  # the channel closed on us: streams to this peer from now
            self.counts["stream_fallbacks"] += 1
        if self.stream_active[src] < self.p.stream_slots:
            self.stream_active[src] += 1
            return "stream"
        self.counts["refusals"] += 1
        return None

    def _reclaim(self, src: int) -> None:
        """Close connections idle for ``idle_timeout_s`` (the data channel's idle timeout)."""
        conns, now = self.chan[src], self.env.now
        for asker, (count, used, busy) in list(conns.items()):
            if busy == 0 and now - used > self.t.idle_timeout_s:
                del conns[asker]
                self.chan_total[src] -= int(count)

    def _release(self, fe: _Fetcher, src: int, path: str) -> None:
        if path == "stream":
            self.stream_active[src] -= 1
            return
        entry = self.chan[src].get(fe.node)
        if entry is not None:  # None: closed with the fetch (a cancelled endgame copy)
            entry[1], entry[2] = self.env.now, entry[2] - 1

    def _close_all(self, fe: _Fetcher) -> None:
        """The fetch ended: its source closes every idle data channel connection."""
        for src in fe.prov:
            entry = self.chan[int(src)].pop(fe.node, None)
            if entry is not None:
                self.chan_total[int(src)] -= int(entry[0])

    # --- the fetch scheduler ----------------------------------------------------------------
    def _weights(self, fe: _Fetcher) -> np.ndarray:
        known = fe.rate[~np.isnan(fe.rate) & ~fe.dropped]
        default = known.max() if known.size else DEFAULT_RATE
        rate = np.where(np.isnan(fe.rate), default, fe.rate)
        return np.maximum(rate, 1.0) * np.maximum(fe.success, 0.01) ** 2 / (1 + fe.inflight) ** 3

    def _choose(self, fe: _Fetcher, candidates: np.ndarray, w: np.ndarray) -> int | None:
        if candidates.size == 0:
            return None
        if candidates.size == 1:
            return int(candidates[0])
        if self.prng.random() < self.p.explore:
            return int(self.prng.choice(candidates))
        return int(self.prng.choices(candidates, weights=w[candidates], k=1)[0])

    def _holds(self, fe: _Fetcher, pieces: list[int]) -> np.ndarray:
        """(providers x pieces): which providers this fetcher knows to hold which pieces."""
        seen = self.env.now - self.t.have_refresh_s
        return (self.got_at[np.ix_(fe.prov, pieces)] <= seen) & ~fe.dropped[:, None]

    def _next(self, fe: _Fetcher) -> tuple[int, int] | None:
        scan = fe.pending[:SCAN]
        if not scan:
            return None
        free = ~fe.dropped & (fe.inflight < self.p.per_peer) & (fe.busy_until <= self.env.now)
        if not free.any():
            return None
        hold = self._holds(fe, scan)
        w = self._weights(fe)
        best = (hold * np.where(free, w, 0.0)[:, None]).max(axis=0)
        if not (best > 0).any():
            return None
        speed = np.where(best > 0, np.round(np.log2(np.maximum(best, 1.0))), -np.inf)
        j = int(np.lexsort((np.arange(len(scan)), hold.sum(axis=0), -speed))[0])
        pi = self._choose(fe, np.flatnonzero(hold[:, j] & free), w)
        if pi is None:
            return None
        del fe.pending[j]
        return scan[j], pi

    def _endgame(self, fe: _Fetcher) -> tuple[int, int] | None:
        if not self.p.endgame or fe.memory_pulls > 0:
            return None
        runs = [
            (f.size - f.left + f.rate * (self.env.now - f.at), piece, f)
            for piece, flows in fe.running.items()
            if len(flows) == 1 and piece not in fe.claimed
            for f in flows
        ]
        for _received, piece, f in sorted(runs, key=lambda r: r[0]):
            hold = self._holds(fe, [piece])[:, 0]
            hold[f.pi] = False
            idle = np.flatnonzero(hold & (fe.inflight == 0) & (fe.busy_until <= self.env.now))
            pi = self._choose(fe, idle, self._weights(fe))
            if pi is not None:
                return piece, pi
        return None

    def _fail(self, fe: _Fetcher, pi: int) -> None:
        fe.failures[pi] += 1
        fe.success[pi] *= 0.7  # PeerBoard.alpha = 0.3
        if fe.failures[pi] >= self.p.failure_budget:
            fe.dropped[pi] = True

    def _tell(self, holder: int) -> None:
        """``holder`` verified a piece: the starved fetchers that have it among their providers
        see it at their next ``have`` round."""
        if not self.starved:
            return
        if holder >= self.first:
            askers = [v for v in self.peers[holder - self.first] if v in self.starved]
        else:
            askers = list(self.starved)
        for v in askers:
            fe = self.fetchers[v]
            if not fe.wake_pending:
                fe.wake_pending = True
                self.env.timeout(self.t.have_refresh_s * (1 + 1e-9)).callbacks.append(
                    lambda _e, f=fe: self._wake(f)
                )

    def _wake(self, fe: _Fetcher) -> None:
        fe.wake_pending = False
        self._notify(fe)

    def _notify(self, fe: _Fetcher) -> None:
        event, fe.changed = fe.changed, self.env.event()
        event.succeed()

    def _pull(self, fe: _Fetcher, piece: int, pi: int, in_memory: bool) -> Any:
        path = self._admit(fe, pi)
        if path is None or path == "busy":
            if path is None:
                self._fail(fe, pi)
            else:
                rest = self.t.have_refresh_s * (1 + self.prng.random())
                fe.busy_until[pi] = self.env.now + rest
                if self.p.busy_wake == "slot":
                    waiters = self.busy_waiters[int(fe.prov[pi])]
                    if fe.node not in waiters:
                        waiters.append(fe.node)
            if piece not in fe.claimed and piece not in fe.running and not in_memory:
                fe.pending.append(piece)
            return
        src = int(fe.prov[pi])
        f = _Flow(src, fe.node, self.piece_size[piece], pi, path, self.env.event())
        fe.running.setdefault(piece, []).append(f)
        fe.inflight[pi] += 1
        fe.memory_pulls += in_memory
        self.counts["endgame_pulls"] += in_memory
        started = self.env.now
        self._start(f)
        verified = yield f.done
        fe.inflight[pi] -= 1
        fe.memory_pulls -= in_memory
        self._release(fe, src, path)
        fe.running[piece].remove(f)
        if not fe.running[piece]:
            del fe.running[piece]
        if not verified:
            return  # another copy of the piece won: no blame
        rate = f.size / max(self.env.now - started, 1e-9)
        fe.rate[pi] = rate if np.isnan(fe.rate[pi]) else 0.7 * fe.rate[pi] + 0.3 * rate
        fe.success[pi] = 0.7 * fe.success[pi] + 0.3
        if piece in fe.claimed:
            return
        fe.claimed.add(piece)
        for other in list(fe.running.get(piece, [])):
            self._cancel(other)
        self.got_at[fe.node, piece] = self.env.now
        self._tell(fe.node)
        fe.done += 1
        fe.last_progress = self.env.now
        if fe.done == self.pieces:
            fe.finished_at = self.env.now
            self._close_all(fe)
            if fe.node >= self.first:
                self.finished += 1
                if self.finished == self.n:
                    self.all_done.succeed()

    def _worker(self, fe: _Fetcher) -> Any:
        while fe.pending or fe.running:
            picked, in_memory = self._next(fe), False
            if picked is None:
                picked = self._endgame(fe)
                in_memory = picked is not None
            if picked is None:
                if not fe.pending:
                    yield fe.changed
                    continue
                stuck = not fe.running and self.env.now - fe.last_progress > self.t.give_up_s
                if stuck or fe.dropped.all():
                    # PeerError "every provider failed": the node fetches again, board afresh.
                    self.counts["gave_up"] += 1
                    fe.reset()
                    fe.last_progress = self.env.now + self.t.retry_s
                    yield self.env.timeout(self.t.retry_s)
                    continue
                # The real scheduler asks its providers ``have`` every ``have_refresh_s``; here a
                # provider's new piece wakes the starved fetchers that know it (``_tell``).
                self.starved.add(fe.node)
                wait = math.inf if fe.running else fe.last_progress + self.t.give_up_s
                if self.p.busy_wake == "timer":
                    backoff = fe.busy_until[fe.busy_until > self.env.now]
                    wait = min(wait, float(backoff.min()) if backoff.size else math.inf)
                if wait == math.inf:
                    yield fe.changed
                else:
                    yield fe.changed | self.env.timeout(max(wait - self.env.now, 0.0) + 1e-6)
                self.starved.discard(fe.node)
                continue
            yield from self._pull(fe, picked[0], picked[1], in_memory)
            self._notify(fe)

    def _fetch(self, node: int, lookup: float) -> Any:
        if lookup:
            yield self.env.timeout(lookup)
        if node < self.first:
            prov = [0, *(r for r in range(1, self.first) if r != node)]
        else:
            prov = [0, *range(1, self.first), *self.peers[node - self.first]]
        order = list(range(self.pieces))
        self.prng.shuffle(order)  # receivers fetch in different orders, so they can trade
        fe = _Fetcher(node, np.array(prov, dtype=np.int64), order)
        fe.changed = self.env.event()
        fe.last_progress = self.env.now
        self.fetchers[node] = fe
        for _ in range(max(1, self.p.parallel_sources)):
            self.env.process(self._worker(fe))

    # --- run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started, cpu = time.perf_counter(), time.process_time()
        self._gossip()
        self.env.run(until=self.all_done | self.env.timeout(self.p.horizon_s))
        contributors = slice(self.first, self.first + self.n)
        done = np.array(
            [
                self.fetchers[i].finished_at if i in self.fetchers else np.inf
                for i in range(self.first, self.first + self.n)
            ]
        )
        total = float(self.served.sum())
        out: dict[str, Any] = {
            "n": self.n,
            "pieces": self.pieces,
            "piece_mib": round(self.piece_size[0] / MIB, 1),
            "shards_per_piece": self.shards_per_piece,
        }
        for name, times in (("announce", self.announced[contributors]), ("shards", done)):
            for q in (50, 95, 100):
                out[f"{name}_p{q}_s"] = _reach(times, q)
        out |= {
            "origin_share": float(self.served[0] / total) if total else 0.0,
            "origin_upload_gb": float(self.served[0] / GB),
            "relay_upload_gb": float(self.served[1 : self.first].sum() / GB),
            "served_gb": total / GB,
            "complete": int(np.isfinite(done).sum()),
            **self.counts,
            "sim_wall_s": round(time.perf_counter() - started, 2),
            "sim_cpu_s": round(time.process_time() - cpu, 2),
        }
        return out


def _reach(times: np.ndarray, q: int) -> float:
    """The time by which ``q``% of the nodes had it (the ceil(q% of n)-th arrival)."""
    ordered = np.sort(times)
    k = max(1, math.ceil(q / 100 * len(ordered)))
    value = float(ordered[k - 1])
    return round(value, 3) if math.isfinite(value) else math.inf


def simulate(
    params: SimParams,
    n: int,
    version_bytes: int,
    upload_dist: HomeLinks | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """One broadcast: announce and shard reach times at 50/95/100% of ``n`` nodes (seconds from
    the publish), the origin's share of the bytes served, and the model's own counters."""
    return Simulation(params, n, version_bytes, upload_dist, seed).run()
