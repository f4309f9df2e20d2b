"""Several trainers, one policy: the rounds of a trainer in a group (``Trainer`` drives it when
the genesis names more than one trainer; the averaging itself runs in the training child,
``node.compute.averaging``).

Decisions this module owns:

- **Joining** (``join``): a trainer advertises its hivemind address in its signed RoleAdvert,
  connects its child to the addresses in the other trainers' adverts, loads the swarm's newest
  policy, settles the rounds a previous life left open (it keeps the reservations of rounds
  recorded with it as a member, releases the rest, and gives back the samples of versions
  recorded lost), and publishes v0 when nobody has (the first genesis trainer first).
- **Share** (``step``): validators hand each submission to one trainer, so each takes
  ``ceil(submissions_per_step / live trainers)`` per round; an idle trainer joins a round a peer
  wants with weight 0.
- **Publishing** (``_publish_round``): the round's publisher (the member that joined the group
  first, ``node.compute.groups.publisher_of``) cuts and announces the version; the others
  load its copy through SHARDCAST. A publisher that falls out of the live set before announcing
  is replaced by the next member (smallest peer id), which publishes its own (averaged, so equal
  up to float noise) copy; one that announced and died before anyone held the copy is replaced
  by a member's copy under the next number (``_republish``). Each round's members are recorded
  in the group's DHT before the announcement.
- **Lost versions** (``catch_up``): a version of which no shard arrives for ``LOST_AFTER_S``
  (tries cut at ``ADOPT_WAIT_S``), announced by a trainer that left the live set, was lost with
  it (it trained alone and was killed before anyone fetched it). The others continue from the
  newest version they can get, call it by the lost number locally (never announced again: one
  manifest per version) and publish the next; the lost version is recorded so that its
  publisher, restarted, releases the samples it trained into it, and they train once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol

import trio

from node.compute.groups import Group, StepStats
from node.compute.train_child import TrainerChild
from node.roles.trainer_stats import GroupStatus
from swarm.errors import SwarmError
from swarm.messages import GradientCommitment, decode, train_seed

if TYPE_CHECKING:
    from node.policy_feed import PolicyFeed
    from node.roles.cheats import TrainerCheat
    from node.roles.sample_queue import SampleQueue
    from node.roles.trainer_records import TrainingLog
    from node.roles.trainer_stats import TrainerStats
    from node.runtime import Node
    from swarm.messages import PolicyAnnouncement, RunParams, Signed
    from swarm.shardcast.fetch import FetchProgress, ProgressCallback


class Trainer(Protocol):
    """What a group's rounds need of their trainer (``node.roles.trainer.Trainer``, which
    imports this module: the rounds depend on this shape, not on that class)."""

    version: int
    window_floor: int

    @property
    def node(self) -> Node: ...
    @property
    def params(self) -> RunParams: ...
    @property
    def feed(self) -> PolicyFeed: ...
    @property
    def queue(self) -> SampleQueue: ...
    @property
    def log(self) -> TrainingLog: ...
    @property
    def stats(self) -> TrainerStats: ...
    @property
    def cheat(self) -> TrainerCheat | None: ...
    @property
    def trainers(self) -> list[str]: ...

    def child_or_fail(self) -> TrainerChild: ...
    async def arrived(self) -> None: ...
    async def publish(self, version: int) -> None: ...
    async def adopt(
        self,
        version: int,
        announced: Signed[PolicyAnnouncement] | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> None: ...
    def record(self, stats: StepStats) -> StepStats: ...
    def retain(self) -> None: ...


log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
"""How often an idle group trainer asks whether a peer wants a round."""
TAKEOVER_AFTER_S = 60.0
"""A live publisher that announces nothing for this long is taken over anyway."""
ADOPT_WAIT_S = 8.0
"""How long a member tries to fetch the publisher's copy before asking whether it is alive."""
MEET_EVERY_S = 5.0
"""How long a trainer the swarm lists may be missing from the group's live set before we read
its advert again and connect to it (``_meet_missing``); the gap doubles while it stays away."""
MEET_MAX_S = 60.0
HOLD_MARGIN_S = 1.0
"""How long before an idle cut the publisher's liveness is read (``_hold_while_alive``)."""
LOST_AFTER_S = 10.0
"""How long a version announced by a trainer that left the group must stay unfetchable before
the others call it lost and go on without it."""


class GroupRounds:
    """A trainer's part in its group: joining, one round per version, publishing or adopting."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.status = GroupStatus()
        self._unfetched_since: dict[int, float] = {}
        self._state: dict[str, Any] = {}
        """The training child's commitments of the round being published."""
        self._commitments: list[bytes] = []
        """The members' signed gradient commitments of that round, in member order."""
        self._meet_at: dict[str, float] = {}
        self._meet_gap: dict[str, float] = {}
        """Trainers missing from the live set: when to meet each next, and the gap after."""

    @property
    def child(self) -> TrainerChild:
        return self.t.child_or_fail()

    async def _sync(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args)

    # -- meeting the group ---------------------------------------------------------------------

    async def _trainer_addrs(self) -> dict[str, list[str]]:
        """The hivemind addresses in the other trainers' adverts, by trainer (an advert read
        before its trainer's child started is read again)."""
        node = self.t.node
        out: dict[str, list[str]] = {}
        for peer in node.peers_by_role().get("trainer", []):
            advert = node.membership.advert_of(peer)
            if advert is not None and "hivemind" not in advert.message.capabilities:
                advert = await node.membership.refresh(peer)
            if advert is not None and advert.message.capabilities.get("hivemind"):
                out[peer] = [str(a) for a in advert.message.capabilities["hivemind"]]
        return out

    async def connect_new_trainers(self, reread: Collection[str] = ()) -> None:
        """Connect our child's DHT to the other trainers' advertised ones. A trainer in
        ``reread`` (missing from the live set) has its advert read again and its addresses
        tried even when reached before; one whose every address failed (it restarted since
        we read its advert: a new DHT) has its advert read again and is tried once more."""
        node, child = self.t.node, self.child
        for peer in reread:
            await node.membership.refresh_advert(peer)
        by_peer = await self._trainer_addrs()
        known = [a for p, addrs in by_peer.items() if p not in reread for a in addrs]
        failed = set(await self._sync(child.connect, known))
        again = [a for p, addrs in by_peer.items() if p in reread for a in addrs]
        if again:
            log.info("meeting trainers missing from the group: %s", [p[-8:] for p in reread])
            failed |= set(await self._sync(child.connect, again, True))
        for peer, addrs in by_peer.items():
            if not set(addrs) <= failed:
                continue
            advert = await node.membership.refresh_advert(peer)
            fresh = [] if advert is None else advert.message.capabilities.get("hivemind", [])
            if fresh and set(fresh) != set(addrs):
                await self._sync(child.connect, [str(a) for a in fresh])

    async def _meet_missing(self, live: Collection[str]) -> None:
        """Trainers the swarm lists (a live advert) that are not in the group's live set are
        read again and connected, even while rounds go on: two trainers whose DHTs lost each
        other would each train alone and publish competing versions. Each is tried after
        ``MEET_EVERY_S``, then at doubling gaps up to ``MEET_MAX_S`` while it stays missing
        (a killed trainer's advert outlives it, and a dial to its stale addresses can take
        the whole DHT timeout off the round loop)."""
        missing = set(self.t.node.peers_by_role().get("trainer", [])) - set(live)
        for peer in set(self._meet_gap) - missing:  # met, or gone from the swarm's list
            del self._meet_gap[peer], self._meet_at[peer]
        now = time.monotonic()
        due = sorted(p for p in missing if self._meet_at.get(p, now + MEET_EVERY_S) <= now)
        for peer in missing - set(self._meet_at):
            self._meet_at[peer], self._meet_gap[peer] = now + MEET_EVERY_S, MEET_EVERY_S
        if not due:
            return
        await self.connect_new_trainers(reread=due)
        for peer in due:
            self._meet_gap[peer] = gap = min(2 * self._meet_gap[peer], MEET_MAX_S)
            self._meet_at[peer] = time.monotonic() + gap

    async def join(self) -> None:
        t, node, child = self.t, self.t.node, self.child
        caps = dict(node.membership.config.capabilities)
        caps["hivemind"] = child.hivemind_addrs
        node.membership.config.capabilities = caps
        await node.membership.publish()
        with trio.move_on_after(15):
            while not await self._trainer_addrs():
                await node.membership.discover()
                await trio.sleep(0.5)
        await self.connect_new_trainers()
        first = t.trainers[0]
        with trio.move_on_after(3 if node.peer_id == first else 10):
            await node.policy.wait_for(0)  # a running swarm answers the catch-up at once
        known = node.policy.version
        if known is not None and known >= t.version and known > 0:
            await self.catch_up(known)  # the loop tries again (or a peer republishes)
        for step in t.queue.unsettled_steps():
            members = await self._sync(child.round_members, step)
            if members is not None and node.peer_id in members:
                t.queue.settle(step)
            else:
                n = t.queue.release(step)
                log.info("round of v%d never published with us: %d samples back", step, n)
        await self.give_back_lost()
        if node.policy.version is None:
            if node.peer_id != first:
                with trio.move_on_after(30):  # the first genesis trainer announces v0
                    await node.policy.wait_for(0)
            if node.policy.version is None:
                await t.publish(t.version)
        self.status.peers = sorted(await self._sync(child.live))

    async def give_back_lost(self) -> int:
        """Release the samples this trainer trained into versions the group recorded lost (it
        published them alone and was killed before anyone fetched them); returns how many."""
        t, back = self.t, 0
        for step in t.queue.reserved_steps():
            if await self._sync(self.child.lost, step + 1):
                n = t.queue.release(step)
                log.warning("v%d was lost with us (killed first): %d samples back", step + 1, n)
                back += n
        return back

    # -- catching up -----------------------------------------------------------------------------

    async def catch_up(self, known: int) -> None:
        """Continue from the swarm's newest version ``known`` (a round we were not in), or
        without it when it was lost with its publisher: its publisher left the live set and
        nothing of it arrived for ``LOST_AFTER_S``. A try is cut after ``ADOPT_WAIT_S``
        without progress only once the publisher has left (``_hold_while_alive``); a slow
        fetch that makes progress is never cut nor called lost."""
        t = self.t
        since = self._unfetched_since.setdefault(known, time.monotonic())
        arrived: list[object] = []
        why = f"nothing arrived within {ADOPT_WAIT_S:g} s"
        announced = t.node.policy.accepted.get(known)
        publisher = None if announced is None else announced.signer
        try:
            attempt, progressed = _cut_when_idle(ADOPT_WAIT_S, arrived.append)
            await self._watched(
                attempt, publisher, lambda: t.feed.fetch_version(known, on_progress=progressed)
            )
            if not attempt.cancelled_caught:
                await t.adopt(known)  # the file is here: check its manifest, load it
                self._unfetched_since.clear()
                return
        except SwarmError as exc:
            why = str(exc)
        if arrived:
            self._unfetched_since[known] = since = time.monotonic()
        live = await self._sync(self.child.live)
        if publisher in live or time.monotonic() - since < LOST_AFTER_S:
            log.warning("policy v%d not fetched yet (%s); retrying", known, why)
            await trio.sleep(1.0)
            return
        await self._go_on_without(known, str(publisher), why)

    async def _adopt_while_arriving(self, version: int, publisher: str) -> bool:
        """Adopt ``version``; True once adopted, False when nothing of it arrived for
        ``ADOPT_WAIT_S`` and ``publisher`` left the group. A fetch that makes progress is
        never cut: cut and begun again, a copy slower than the wait (a first patch needs its
        whole base fetched first) would never arrive."""
        scope, progressed = _cut_when_idle(ADOPT_WAIT_S)
        await self._watched(scope, publisher, lambda: self.t.adopt(version, on_progress=progressed))
        return not scope.cancelled_caught

    async def _watched(
        self, scope: trio.CancelScope, publisher: str | None, fetch: Callable[[], Awaitable[object]]
    ) -> None:
        """``fetch()`` inside ``scope``, its idle cut put off while ``publisher`` lives
        (``_hold_while_alive``); the fetch's ``SwarmError`` is raised as it is, not in a group."""
        failed: list[SwarmError] = []
        with scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._hold_while_alive, scope, publisher)
                try:
                    await fetch()
                except SwarmError as exc:
                    failed.append(exc)
                nursery.cancel_scope.cancel()
        if failed:
            raise failed[0]

    async def _hold_while_alive(self, scope: trio.CancelScope, publisher: str | None) -> None:
        """Put the idle cut of ``scope`` (``_cut_when_idle``) off while ``publisher`` is in
        the group's live set: a cut fetch begins again, and its lookups with it. A member
        catching up on a patch fetches the patch's base first, and on a busy box the base's
        manifest alone took 7 s: every 8 s try was cut before a shard arrived, and the member
        sat out the group for 5 minutes (tests/integration/test_group_training_audit.py beside
        two busy loops). The fetch's own stall timeouts still end a fetch that hangs."""
        while publisher is not None:
            await trio.sleep_until(scope.deadline - HOLD_MARGIN_S)
            if scope.deadline - trio.current_time() > HOLD_MARGIN_S:
                continue  # it made progress meanwhile
            # Put off first: reading the live set (the group's DHT) may take seconds.
            scope.deadline = trio.current_time() + ADOPT_WAIT_S
            if publisher not in await self._sync(self.child.live):
                scope.cancel()  # gone: cut now
                return

    async def _go_on_without(self, lost: int, publisher: str, why: str) -> None:
        t, child = self.t, self.child
        for v in sorted((v for v in t.node.policy.accepted if t.version < v < lost), reverse=True):
            try:
                with trio.move_on_after(ADOPT_WAIT_S):
                    await t.adopt(v, announced=t.node.policy.accepted[v])
                    break
            except SwarmError:
                continue
        log.error(
            "policy v%d is lost: its publisher %s left the group before anyone fetched it (%s);"
            " continuing from v%d, the next round publishes v%d",
            lost,
            publisher[-8:],
            why,
            t.version,
            lost + 1,
        )
        await self._sync(child.mark_lost, lost)
        await self._sync(child.relabel, lost)  # never announced: one manifest per version
        if lost > t.version + 1:  # the versions between are not held: nor are their samples
            t.window_floor = lost
        t.version = lost
        self.status.lost_versions += 1
        self._unfetched_since.clear()

    # -- a round -------------------------------------------------------------------------------

    async def _round_wanted(self, min_version: int, share: int) -> bool:
        """Wait (at most ``IDLE_POLL_S``) until we have our share, or a peer wants a round."""
        t = self.t
        if t.queue.pending(min_version) >= share:
            return True
        with trio.move_on_after(IDLE_POLL_S):
            await t.arrived()
        if t.queue.pending(min_version) >= share:
            return True
        wanted = await self._sync(self.child.wanted, t.version)
        return any(p != t.node.peer_id for p in wanted)

    async def step(self, min_version: int) -> None:
        t, child = self.t, self.child
        known = t.node.policy.version
        if known is not None and known > t.version:
            await self.catch_up(known)
            return
        live = await self._sync(child.live)
        self.status.peers = sorted(live)
        await self._meet_missing(live)
        share = max(1, math.ceil(t.params.submissions_per_step / max(1, len(live))))
        idle_from = time.perf_counter()
        wanted = await self._round_wanted(min_version, share)
        t.stats.idle_seconds += time.perf_counter() - idle_from
        if not wanted:
            await self.connect_new_trainers()
            return
        busy_from = time.perf_counter()
        step = t.version
        batch = t.queue.take(step, share, min_version)
        groups = [g for _, gs in batch for g in gs]
        cheat = t.cheat.pick(step, sum(g.signal for g in groups)) if t.cheat is not None else None
        seed = train_seed(t.node.run_id, step + 1)
        cited = t.queue.cited_by(step)
        out = await trio.to_thread.run_sync(
            lambda: child.step(groups, step, seed, cheat, cited=cited)
        )
        try:
            await self._finish_round(step, groups, out)
        finally:
            t.stats.busy_seconds += time.perf_counter() - busy_from

    async def _undo(self, step: int) -> None:
        await self._sync(self.child.discard, step)
        self.t.queue.release(step)

    async def _finish_round(self, step: int, groups: list[Group], out: dict[str, Any]) -> None:
        t, gs = self.t, self.status
        if "failed" in out:
            gs.rounds_failed += 1
            t.queue.release(step)
            log.warning("%s; its samples are back in the queue", out["failed"])
            return
        rnd = out["round"]
        stats = t.record(StepStats(**out["stats"]))
        members = list(rnd["members"])
        if rnd["group_samples"] == 0 and not groups:
            await self._undo(step)  # nobody had signal: the weights did not move
            return
        if rnd["void"] or await self._sync(self.child.void, step):
            gs.rounds_void += 1
            log.warning("round v%d was void (two groups formed); samples back", step)
            await self._undo(step)
            return
        self._state = out.get("state") or {}
        self._commitments = [rnd["commitments"][m] for m in members if m in rnd["commitments"]]
        published = await self._publish_round(step, members, rnd["publisher"])
        if not published:
            await self._undo(step)
            return
        t.queue.settle(step)
        t.retain()
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
        t, child = self.t, self.child
        me, new = t.node.peer_id, step + 1
        deadline = trio.current_time() + TAKEOVER_AFTER_S
        while publisher != me:
            known = t.node.policy.version
            if known is not None and known >= new:
                why = f"nothing arrived within {ADOPT_WAIT_S:g} s"
                try:
                    if await self._adopt_while_arriving(new, publisher):
                        return publisher
                except SwarmError as exc:
                    why = str(exc)
                if publisher in await self._sync(child.live):
                    log.warning("v%d not fetched yet (%s); retrying", new, why)
                    await trio.sleep(1.0)
                    continue
                return await self._republish(step, members, known + 1)
            if await self._sync(child.void, step):
                return None
            live = await self._sync(child.live)
            alive = [m for m in members if m in live]
            if publisher not in live or trio.current_time() > deadline:
                log.warning("v%d: publisher %s silent; the next member publishes", new, publisher)
                publisher = min(m for m in [*alive, me] if m != publisher)
                if publisher == me:
                    log.warning("v%d: the round's publisher is gone; publishing our copy", new)
                    self.status.takeovers += 1
            else:
                await trio.sleep(0.5)
        known = t.node.policy.version
        if known is not None and known >= new:
            log.warning("v%d was published by another round first; ours is undone", new)
            return None
        await self._sync(child.record_round, step, members)
        await self._record(step, new, members)
        try:
            await t.publish(new)
        except SwarmError as exc:
            log.warning("v%d could not be announced (%s); the round is undone", new, exc)
            t.feed.discard_own(new)
            return None
        t.version = new
        self.status.published_here += 1
        return me

    async def _record(self, step: int, version: int, members: list[str]) -> None:
        """The round's training record, signed by its publisher: it carries every member's
        signed gradient commitment (gathered with the round) and cites their samples, member
        after member; its states are the publisher's own. A version republished under another
        number (``_republish``) is recorded without them: the commitments name the round's
        version, so an audit reports it not replayed."""
        t = self.t
        min_version = max(0, step - t.params.async_level, t.window_floor)
        if version != step + 1:
            await t.log.publish_record(
                t.params,
                parent=version - 1,
                min_version=min(min_version, version - 1),
                cited=t.queue.cited_by(step),
                state=self._state,
                republished_from=step + 1,
            )
            return
        if len(self._commitments) < len(members):
            # A member committed nothing (a sharded trainer keeps no state here, or one from
            # before commitments): the averaging cannot be replayed without its gradient.
            await t.log.publish_record(
                t.params,
                parent=step,
                min_version=min(min_version, step),
                cited=t.queue.cited_by(step),
                state=self._state,
                members_uncommitted=len(members) - len(self._commitments),
            )
            return
        cited: list[tuple[bytes, int]] = []
        for raw in self._commitments:
            c = decode(raw, GradientCommitment).message
            cited += zip(c.verdicts, c.sample_versions, strict=True)
        await t.log.publish_record(
            t.params,
            parent=step,
            min_version=min(min_version, step),
            cited=cited,
            state=self._state,
            members=self._commitments,
        )

    async def _republish(self, step: int, members: list[str], version: int) -> str:
        """The publisher announced the round's version and died before anyone held its copy:
        publish our own copy of the round's result as ``version`` (versions only move forward),
        so the run goes on and the round's samples still count once."""
        t, child = self.t, self.child
        log.warning(
            "the publisher died before serving v%d; publishing our copy as v%d", step + 1, version
        )
        self.status.takeovers += 1
        await self._sync(child.relabel, version)
        await self._sync(child.record_round, step, members)
        await self._record(step, version, members)
        await t.publish(version)
        t.version = version
        self.status.published_here += 1
        return t.node.peer_id


def _cut_when_idle(
    wait_s: float, also: Callable[[FetchProgress], object] | None = None
) -> tuple[trio.CancelScope, Callable[[FetchProgress], None]]:
    """A cancel scope that ends ``wait_s`` after the fetch last gained, for its callback (a
    fetch's ``on_progress``): a fetch that makes progress is never cut. A gain is a shard
    fetched (which also calls ``also``) or a pull running (one that stalls is cut by the
    fetch's own stall timeout). A ``have`` answer is none: when a publisher died holding the
    only copy of a shard, the peers holding the others answered one every second, the fetch
    ran to its own 30 s give-up, and the group's failover took over 30 s (CI,
    tests/system/test_trainer_group.py)."""
    scope = trio.CancelScope(deadline=trio.current_time() + wait_s)
    fetched = [0]  # bytes this fetch pulled (shards resumed from disk are no arrival)

    def progressed(p: FetchProgress) -> None:
        gained = p.fetched_bytes > fetched[0]
        pulling = p.board is not None and any(s.in_flight for s in p.board.stats.values())
        if gained or pulling:
            scope.deadline = trio.current_time() + wait_s
        if gained:
            fetched[0] = p.fetched_bytes
            if also is not None:
                also(p)

    return scope, progressed
