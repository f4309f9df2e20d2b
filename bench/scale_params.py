"""Parameters of the scale simulation (``bench/scale_model.py``): the contributors' links
(``HomeLinks``, an assumption stated in its docstring) and everything else the model takes
(``SimParams``: rates, limits and clocks of our implementation), with the constants it copies
from the code."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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
    origin_links: int | None = None
    """Nodes the origin sends its announcement to directly: with flood publishing
    (``swarm.net.gossipsub.SwarmGossipSub``) every subscriber it is connected to, up to
    ``HostLimits.max_connections`` (256); ``None``: its mesh only (``gossip_degree``; the code
    before flood publishing)."""
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
