"""A discrete-event simulation (SimPy) of one SHARDCAST broadcast and its policy gossip.

``simulate(params, n, version_bytes, links, seed)`` broadcasts one version from an origin to
``n`` nodes; ``bench/scale_sim.py`` calibrates it on ``bench/scale.py`` and projects with it.
This module owns the gossip, the fetch scheduler and the run; ``scale_links`` moves the bytes
(bandwidth sharing, serving limits) and ``scale_params`` holds the parameters and links.

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
- gossip (``swarm.net.overlay``): the origin sends its announcement to every subscriber it is
  connected to (flood publishing, ``origin_links``), GossipSub forwards a new message at once
  to its mesh peers (degree D = 6); a node starts its fetch when the announcement arrives,
  after ``lookup_s`` (0 with the issue-17 code, which skips the DHT lookup when it knows 8
  peers; the run's lookup p50 before it), growing with log N as Kademlia lookups do.

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
from dataclasses import replace
from typing import Any

import numpy as np
import simpy
from scale_links import Fetcher, Flow, Links
from scale_params import (
    DEFAULT_RATE,
    GB,
    MBIT,
    MIB,
    RATE_TOLERANCE,
    SCAN,
    WAKE_PER_SLOT,
    HomeLinks,
    SimParams,
)

__all__ = [
    "DEFAULT_RATE",
    "GB",
    "MBIT",
    "MIB",
    "RATE_TOLERANCE",
    "SCAN",
    "WAKE_PER_SLOT",
    "Fetcher",
    "Flow",
    "HomeLinks",
    "SimParams",
    "Simulation",
    "simulate",
]


class Simulation(Links):
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
        self.up_flows: list[dict[Flow, None]] = [{} for _ in range(m)]
        self.down_flows: list[dict[Flow, None]] = [{} for _ in range(m)]
        self.active: dict[Flow, None] = {}
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
        self.fetchers: dict[int, Fetcher] = {}
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
        fan = d if self.p.origin_links is None else self.p.origin_links
        origin_peers = self.prng.sample(ids, min(fan, len(ids)))
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

    # --- the fetch scheduler ----------------------------------------------------------------
    def _weights(self, fe: Fetcher) -> np.ndarray:
        known = fe.rate[~np.isnan(fe.rate) & ~fe.dropped]
        default = known.max() if known.size else DEFAULT_RATE
        rate = np.where(np.isnan(fe.rate), default, fe.rate)
        return np.maximum(rate, 1.0) * np.maximum(fe.success, 0.01) ** 2 / (1 + fe.inflight) ** 3

    def _choose(self, fe: Fetcher, candidates: np.ndarray, w: np.ndarray) -> int | None:
        if candidates.size == 0:
            return None
        if candidates.size == 1:
            return int(candidates[0])
        if self.prng.random() < self.p.explore:
            return int(self.prng.choice(candidates))
        return int(self.prng.choices(candidates, weights=w[candidates], k=1)[0])

    def _holds(self, fe: Fetcher, pieces: list[int]) -> np.ndarray:
        """(providers x pieces): which providers this fetcher knows to hold which pieces."""
        seen = self.env.now - self.t.have_refresh_s
        return (self.got_at[np.ix_(fe.prov, pieces)] <= seen) & ~fe.dropped[:, None]

    def _next(self, fe: Fetcher) -> tuple[int, int] | None:
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

    def _endgame(self, fe: Fetcher) -> tuple[int, int] | None:
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

    def _fail(self, fe: Fetcher, pi: int) -> None:
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

    def _wake(self, fe: Fetcher) -> None:
        fe.wake_pending = False
        self._notify(fe)

    def _notify(self, fe: Fetcher) -> None:
        event, fe.changed = fe.changed, self.env.event()
        event.succeed()

    def _pull(self, fe: Fetcher, piece: int, pi: int, in_memory: bool) -> Any:
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
        f = Flow(src, fe.node, self.piece_size[piece], pi, path, self.env.event())
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

    def _worker(self, fe: Fetcher) -> Any:
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
        fe = Fetcher(node, np.array(prov, dtype=np.int64), order)
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
