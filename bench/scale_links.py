"""Links and serving limits of the scale simulation (``bench/scale_model.py``).

``Links`` is the half of ``Simulation`` that moves bytes: a flow's rate (its source's upload
split over its flows, its receiver's download water-filled max-min over its flows, and on one
machine the host's capacity split over every flow), re-rated when a flow starts or ends at
either end; and the serving limits a pull meets (upload slots, data channel connections,
libp2p stream slots). The fetch scheduler (``scale_model.Simulation``) decides what to pull
from whom; the state of one node's fetch is ``Fetcher``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy
from scale_params import RATE_TOLERANCE, WAKE_PER_SLOT, SimParams


class Flow:
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
class Fetcher:
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
    running: dict[int, list[Flow]] = field(default_factory=dict)
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


class Links:
    """Bandwidth sharing and serving limits; the state is set up by ``Simulation``."""

    p: SimParams
    env: simpy.Environment
    first: int
    up: np.ndarray
    down: np.ndarray
    up_flows: list[dict[Flow, None]]
    down_flows: list[dict[Flow, None]]
    active: dict[Flow, None]
    share: np.ndarray
    level: np.ndarray
    busy_waiters: list[list[int]]
    chan: list[dict[int, list[float]]]
    chan_total: np.ndarray
    slots: np.ndarray
    origin_slots: int | None
    stream_active: np.ndarray
    served: np.ndarray
    fetchers: dict[int, Fetcher]
    counts: dict[str, int]

    def _notify(self, fe: Fetcher) -> None:
        raise NotImplementedError

    # --- bandwidth --------------------------------------------------------------------------
    def _advance(self, f: Flow) -> None:
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

    def _arrived(self, f: Flow, gen: int) -> None:
        if f.gen != gen or f.cancelled:
            return
        self._advance(f)
        f.left = 0.0
        self._stop(f)
        f.done.succeed(True)

    def _start(self, f: Flow) -> None:
        f.at = self.env.now
        self.up_flows[f.src][f] = None
        self.down_flows[f.dst][f] = None
        self.active[f] = None
        self._reflow(f.src, f.dst)

    def _stop(self, f: Flow) -> None:
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

    def _cancel(self, f: Flow) -> None:
        if f.done.triggered:
            return
        f.cancelled = True
        self._stop(f)
        f.done.succeed(False)

    # --- serving limits ---------------------------------------------------------------------
    def _admit(self, fe: Fetcher, pi: int) -> str | None:
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

    def _release(self, fe: Fetcher, src: int, path: str) -> None:
        if path == "stream":
            self.stream_active[src] -= 1
            return
        entry = self.chan[src].get(fe.node)
        if entry is not None:  # None: closed with the fetch (a cancelled endgame copy)
            entry[1], entry[2] = self.env.now, entry[2] - 1

    def _close_all(self, fe: Fetcher) -> None:
        """The fetch ended: its source closes every idle data channel connection."""
        for src in fe.prov:
            entry = self.chan[int(src)].pop(fe.node, None)
            if entry is not None:
                self.chan_total[int(src)] -= int(entry[0])
