"""Several trainers, one policy: gradient averaging through hivemind, inside the training child.

Imported only by ``node.compute.train_child`` (hivemind and py-libp2p cannot share a process).
Decisions this module owns:

- **Transport**: a hivemind DHT per trainer child (its own p2pd, listening on the node's IP) and a
  ``DecentralizedAverager`` over gradient-shaped tensors, prefix ``swarm-node/<run>/grads``. The
  DHTs find each other through the multiaddrs that trainers put in their signed RoleAdverts
  (``connect``), not through hivemind's own bootstrap list.
- **Liveness** (``live``): each child stores a heartbeat under ``<prefix>/live`` (subkey: its
  swarm peer id, value: its policy version) every ``HEARTBEAT_S``, expiring after ``LIVE_S``; a
  trainer killed with -9 drops out of the live set within ``LIVE_S``.
- **Rounds** (``average``): one round per policy version, in groups of at least two; a lone
  live trainer steps without the averager, and a round whose peer died fails after
  ``AVERAGING_TIMEOUT_S`` and is retried once the dead peer has left the live set. A trainer
  with samples stores a want record under ``<prefix>/want/<version>`` and calls the averager;
  an idle trainer that sees a want for its version joins with weight 0 (``wanted``). Gradients
  are averaged weighted by sample count, so the group's step equals one trainer's step on the
  union of the samples. Every member gathers ``{peer, version, samples}``, so all members agree
  on who was in the round.
- **Publisher** (``RoundResult.publisher``): the round's member whose child joined the group
  first (``joined``, gathered with the round; ties and older members without it: the smallest
  swarm peer id). A trainer that just joined or restarted holds fresh Adam moments, and its
  own update differs from the group's (``bench/adam_moments.py``): it publishes only when no
  longer-standing member is in the round, and otherwise takes the publisher's copy. The
  publisher checks that every trainer that wanted this version is in its round; if
  not (two groups formed for one version), it stores a void record and nobody in the round
  publishes: their samples go back to the queue. Of two split groups, at most one sees no
  outsider, so at most one manifest is cut per version. A member whose round failed voids it
  too (the others may have finished it). A void names the attempts it voids (each member
  gathers a fresh attempt id with its round), never a time: a member's failed attempt voids
  only the rounds it was in, not a later round of the same version.
- **Lost versions** (``mark_lost``/``lost``): a record, kept a day, of an announced version
  whose weights died with its publisher before anyone fetched them; the trainer that goes on
  without it writes it, the publisher reads it when it restarts.
- **Cancellation/death**: a failed or timed-out round raises ``RoundFailed``; the caller releases
  the samples. Forked helpers die with the child (``PR_SET_PDEATHSIG`` via
  ``os.register_at_fork``), and the parent kills the child's process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.utils import get_dht_time

from node.compute.groups import RoundFailed, publisher_of

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
LIVE_S = 6.0
WANT_S = 20.0
DONE_S = 24 * 3600.0
AVERAGING_TIMEOUT_S = 10.0
ALLREDUCE_TIMEOUT_S = 30.0
"""The longest an all-reduce may take once its group formed."""
CHUNK_TIMEOUT_S = 10.0
"""A peer that sends no next part for this long is left out of the all-reduce (hivemind's
``next_chunk_timeout``; its reducers get twice this)."""
ROUND_LIMIT_S = 2 * (AVERAGING_TIMEOUT_S + ALLREDUCE_TIMEOUT_S)
"""The longest a round may take, group search and all-reduce together (hivemind retries
once within its timeout), before it fails: a last guard should hivemind's own not fire."""
MATCHMAKING_S = 5.0
"""hivemind's defaults for the group search (``min_matchmaking_time``, and ``REQUEST_S`` for
``request_timeout``). With 1 s and 0.5 s (fine on a quiet machine, background/hivemind.md) two
trainers on this busy 2-core box missed each other's deadlines: one saw a round with both, the
other "could not find a group", 6-7 times on end (2 of 5 runs of the group training audit
alone, 126-130 s against 74-76 s). With these: 4 runs of 75-86 s, one such failure in all. A
full group (``target_group_size``) starts at once, so the longer window costs a healthy round
nothing."""
REQUEST_S = 3.0
DHT_TIMEOUT_S = 5.0


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: this process gets SIGKILL when the one that forked it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


@dataclass
class RoundResult:
    members: list[str]
    group_samples: int
    publisher: str
    void: bool = False
    seconds: float = 0.0
    bytes_averaged: int = 0
    commitments: dict[str, bytes] = field(default_factory=dict)
    """Each member's signed gradient commitment, by peer id (members that sent none: absent)."""


@dataclass
class GroupStats:
    rounds_averaged: int = 0
    rounds_failed: int = 0
    rounds_void: int = 0
    samples_contributed: int = 0
    averaging_seconds: float = 0.0
    bytes_averaged: int = 0
    last_members: list[str] = field(default_factory=list)
    last_publisher: str | None = None


class TrainerGroup:
    """This trainer's membership in the hivemind group of a run's trainers."""

    def __init__(
        self, peer: str, run_id: str, host: str, params: list[torch.Tensor], trainers: int
    ) -> None:
        os.register_at_fork(after_in_child=die_with_parent)
        self.peer = peer
        self.prefix = f"swarm-node/{run_id}"
        self.dht = hivemind.DHT(host_maddrs=[f"/ip4/{host}/tcp/0"], start=True)
        self.averager = WholeRoundsAverager(
            [torch.zeros_like(p, device="cpu") for p in params],
            self.dht,
            prefix=f"{self.prefix}/grads",
            start=True,
            target_group_size=trainers,
            min_group_size=2,
            min_matchmaking_time=MATCHMAKING_S,
            request_timeout=REQUEST_S,
            part_size_bytes=4 << 20,
            # hivemind waits for a stuck (not dead) peer's parts forever by default, holding
            # the averaged tensors' lock: the trainer went silent for good (a CI run of
            # test_group_training_audit, bench/trainer_kills.py once). A late sender or
            # reducer is left out instead (a partial round: voided, see ``average``).
            allreduce_timeout=ALLREDUCE_TIMEOUT_S,
            next_chunk_timeout=CHUNK_TIMEOUT_S,
        )
        self.tensor_bytes = sum(p.numel() * 4 for p in params)
        self.version = 0
        self.joined = get_dht_time()
        self.stats = GroupStats()
        self._connected: set[str] = set()
        self._attempts: dict[int, set[str]] = {}
        """The attempt ids of the members of our last round at a version (``void``)."""
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def addrs(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def connect(self, addrs: list[str], again: bool = False) -> list[str]:
        """Add other trainers' DHT addresses (from their adverts); returns those not reached
        (a stale advert: its trainer restarted with a new DHT; the caller reads it again).
        An address reached before is skipped unless ``again`` (a trainer missing from the live
        set: our routing table may have dropped it)."""
        failed = []
        for addr in addrs:
            if (addr in self._connected and not again) or addr in self.addrs():
                continue
            try:
                self.dht.run_coroutine(_Connect(addr), return_future=True).result(DHT_TIMEOUT_S)
                self._connected.add(addr)
                log.info("hivemind peer %s reached", addr)
            except Exception as exc:
                log.warning("hivemind peer %s not reached: %s", addr, exc)
                failed.append(addr)
        return failed

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            try:
                self._store(f"{self.prefix}/live", self.version, LIVE_S, subkey=self.peer)
            except Exception as exc:  # the DHT is shutting down or busy: try again
                log.debug("heartbeat failed: %s", exc)
            self._stop.wait(HEARTBEAT_S)

    def _records(self, key: str) -> dict[str, Any]:
        found = self._get(key)
        if found is None or not isinstance(found.value, dict):
            return {}
        now = get_dht_time()
        return {str(k): v.value for k, v in found.value.items() if v.expiration_time > now}

    def _get(self, key: str) -> Any:
        """A DHT lookup that gives up after ``DHT_TIMEOUT_S`` (a lookup was seen to hang for
        minutes under load, which froze the trainer): None, as if nothing were stored."""
        try:
            return self.dht.get(key, latest=True, return_future=True).result(DHT_TIMEOUT_S)
        except Exception as exc:
            log.warning("DHT lookup of %s failed: %s", key, exc)
            return None

    def _store(self, key: str, value: Any, ttl: float, subkey: str | None = None) -> bool:
        try:
            future = self.dht.store(
                key, value, get_dht_time() + ttl, subkey=subkey, return_future=True
            )
            return bool(future.result(DHT_TIMEOUT_S))
        except Exception as exc:
            log.warning("DHT store of %s failed: %s", key, exc)
            return False

    def live(self) -> dict[str, int]:
        """Live trainers (swarm peer id -> policy version), this one included."""
        return {**self._records(f"{self.prefix}/live"), self.peer: self.version}

    def wanted(self, version: int) -> list[str]:
        """Trainers that want a round at ``version``."""
        return sorted(self._records(f"{self.prefix}/want/{version}"))

    def void(self, version: int) -> bool:
        """Whether a member voided our last round at ``version``: a void record naming one of
        its members' attempts (the publisher saw an outsider, or a member's round failed on
        its side). Named by attempt, not by time: a member's earlier failed attempt never
        voids a later round that another member had started before it failed."""
        mine = self._attempts.get(version, set())
        voids = self._records(f"{self.prefix}/void/{version}")
        return any(mine & {str(a) for a in named} for named in voids.values())

    def _void(self, version: int, attempts: set[str]) -> None:
        key = f"{self.prefix}/void/{version}"
        self._store(key, sorted(attempts), WANT_S, subkey=f"{self.peer}/{min(attempts)}")

    def record_round(self, version: int, members: list[str]) -> None:
        """Say (for a day) whose samples went into the published version ``version + 1``: a
        trainer that died after the round asks this on restart, so its samples train once."""
        self._store(f"{self.prefix}/done/{version}", members, DONE_S)

    def round_members(self, version: int) -> list[str] | None:
        found = self._get(f"{self.prefix}/done/{version}")
        return None if found is None else [str(p) for p in found.value]

    def mark_lost(self, version: int) -> None:
        """Say (for a day) that the announced ``version`` is lost: its publisher died before
        anyone fetched it, and the others went on without it. Its publisher, restarted, gives
        back the samples it trained into it."""
        self._store(f"{self.prefix}/lost/{version}", True, DONE_S)

    def lost(self, version: int) -> bool:
        return self._get(f"{self.prefix}/lost/{version}") is not None

    def average(
        self, grads: list[torch.Tensor], samples: int, version: int, commitment: bytes = b""
    ) -> RoundResult:
        """Replace ``grads`` by the group's sample-weighted mean (``RoundFailed`` on failure).
        ``commitment`` (this member's signed ``GradientCommitment``) is gathered with the round:
        every member ends with every member's (``RoundResult.commitments``)."""
        self.version = version
        started = time.perf_counter()
        attempt = secrets.token_hex(8)
        self._attempts = {version: {attempt}}
        want = f"{self.prefix}/want/{version}"
        self._store(want, True, WANT_S, subkey=self.peer)
        if set(self.live()) == {self.peer}:
            # Alone: nothing to average with (a peer that died has left the live set).
            result = RoundResult([self.peer], samples, self.peer)
            result.commitments = {self.peer: commitment} if commitment else {}
            self.stats.samples_contributed += samples
            self.stats.last_members, self.stats.last_publisher = [self.peer], self.peer
            return result
        with self.averager.get_tensors() as tensors:
            for t, g in zip(tensors, grads, strict=True):
                t.copy_(g)
        try:
            control = self.averager.step(
                gather={
                    "peer": self.peer,
                    "version": version,
                    "samples": samples,
                    "joined": self.joined,
                    "commitment": commitment,
                    "attempt": attempt,
                },
                weight=float(samples),
                timeout=AVERAGING_TIMEOUT_S,
                wait=False,
            )
            # ``timeout`` bounds the search for a group only; a round that never ends (a peer
            # that stopped answering mid all-reduce) would hold the trainer forever.
            try:
                gathered = control.result(ROUND_LIMIT_S)
            except TimeoutError:
                if control.done():  # hivemind's own limit on the all-reduce
                    raise TimeoutError(f"all-reduce over {ALLREDUCE_TIMEOUT_S:g} s") from None
                control.cancel()
                raise TimeoutError(f"no result within {ROUND_LIMIT_S:g} s") from None
        except Exception as exc:
            # Others of this round may have finished it: void it for them too, so that no one
            # publishes a round whose samples some member is about to release.
            self.stats.rounds_failed += 1
            self._void(version, {attempt})
            raise RoundFailed(f"averaging round for v{version} failed: {exc}") from exc
        if not gathered:
            self.stats.rounds_failed += 1
            self._void(version, {attempt})
            raise RoundFailed(f"averaging round for v{version} found no group")
        infos = list(gathered.values())
        total = sum(int(i["samples"]) for i in infos)
        partial = sorted({str(i[PARTIAL]) for i in infos if i.get(PARTIAL)})
        finite = True
        if total > 0:  # with no samples in the round, its average (0/0) is never used
            with self.averager.get_tensors() as tensors:
                finite = all(bool(torch.isfinite(t).all()) for t in tensors)
        if partial or not finite:
            # hivemind finished the round without a peer (or with 0/0 in it): a step on
            # neither our samples nor the group's. Void it, so no member publishes it.
            self.stats.rounds_failed += 1
            self._void(version, {str(i.get("attempt", "")) for i in infos} - {""} | {attempt})
            why = "; ".join(partial) or "the average holds inf or NaN"
            raise RoundFailed(f"averaging round for v{version} was partial: {why}")
        if any(int(i["version"]) != version for i in infos):
            self.stats.rounds_failed += 1
            raise RoundFailed(
                f"a round for v{version} mixed versions {sorted({i['version'] for i in infos})}"
            )
        members = sorted(str(i["peer"]) for i in infos)
        self._attempts[version] = {str(i.get("attempt", "")) for i in infos} - {""}
        if total > 0:
            with self.averager.get_tensors() as tensors:
                for t, g in zip(tensors, grads, strict=True):
                    g.copy_(t)
        result = RoundResult(
            members, total, publisher_of(infos), seconds=time.perf_counter() - started
        )
        result.bytes_averaged = self.tensor_bytes * (len(members) > 1)
        result.commitments = {
            str(i["peer"]): bytes(i["commitment"]) for i in infos if i.get("commitment")
        }
        if result.publisher == self.peer:
            outsiders = set(self.wanted(version)) - set(members)
            if outsiders:
                log.warning(
                    "v%d: %s wanted this round but averaged elsewhere; the round is void",
                    version,
                    sorted(outsiders),
                )
                self._void(version, self._attempts[version])
                result.void = True
        s = self.stats
        s.averaging_seconds += result.seconds
        s.bytes_averaged += result.bytes_averaged
        s.last_members, s.last_publisher = members, result.publisher
        if result.void:
            s.rounds_void += 1
        else:
            s.rounds_averaged += len(members) > 1
            s.samples_contributed += samples
        return result

    def shutdown(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.averager.shutdown()
        with contextlib.suppress(Exception):
            self.dht.shutdown()


PARTIAL = "partial"
"""The key a member adds to its own gathered entry when its all-reduce lost a peer mid-way."""


def partial_of(runner: Any) -> str | None:
    """Why hivemind's all-reduce ``runner`` finished short of its group, or None when every
    part came back reduced over every sender. hivemind keeps going when a peer fails mid-way:
    the parts that peer reduced for us keep our own values (``register_failed_reducer``), and
    the parts we reduce leave its contribution out from where it failed (``on_sender_failed``;
    0/0 when the senders left all have weight 0). Read from private fields
    (``swarm/internals.py``): a round is only known partial while they exist."""
    container = getattr(runner, "tensor_part_container", None)
    reducer = getattr(runner, "tensor_part_reducer", None)
    why = []
    missing = int(getattr(container, "failed_size", 0) or 0)
    if missing:
        why.append(f"{missing} values came back unreduced")
    parts = getattr(reducer, "num_parts", math.inf)
    after = getattr(reducer, "sender_failed_after", [])
    failed = [i for i, n in enumerate(after) if n < parts]  # it left before sending its all
    if failed:
        why.append(f"{len(failed)} sender(s) left the parts we reduced")
    return ", ".join(why) or None


class WholeRoundsAverager(DecentralizedAverager):  # type: ignore[misc]
    """A ``DecentralizedAverager`` whose gathered data says when its all-reduce was partial
    (``partial_of``): our own entry gains ``PARTIAL``. Raising instead would make hivemind
    retry the round on tensors already half averaged."""

    async def _aggregate_with_group(
        self, group_info: Any, min_vector_size: int, **kwargs: Any
    ) -> Any:
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        running = self._running_groups.get(group_info.group_id)
        why = partial_of(running.result()) if running is not None and running.done() else None
        mine = gathered.get(self.peer_id) if isinstance(gathered, dict) else None
        if why and isinstance(mine, dict):
            log.warning("a round's all-reduce was partial: %s", why)
            gathered = {**gathered, self.peer_id: {**mine, PARTIAL: why}}
        return gathered


class _Connect:
    """Runs inside hivemind's DHT process: connect p2pd to ``addr`` and ping it into the routing
    table (hivemind has no public call to add a peer after start)."""

    def __init__(self, addr: str) -> None:
        self.addr = addr

    async def __call__(self, dht: Any, node: Any) -> None:
        from hivemind.p2p import PeerID
        from multiaddr import Multiaddr

        maddr = Multiaddr(self.addr)
        peer_id = PeerID.from_base58(maddr["p2p"])
        await node.p2p._client.connect(peer_id, [maddr.decapsulate(f"/p2p/{maddr['p2p']}")])
        # call_ping answers None (never raises) when the peer did not respond: a connection
        # that cannot carry the DHT's RPCs, which must be tried again, not taken as met.
        if await node.protocol.call_ping(peer_id, validate=False, strict=False) is None:
            raise ConnectionError(f"{peer_id} did not answer the DHT's ping")
