"""A group trainer's decisions that need no network: prompts travel as text to the training
child (the node process has no tokenizer), and a version lost with its publisher (killed before
anyone fetched it) is gone on from, recorded, and its samples given back on the publisher's
restart."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from node.compute.groups import Group
from node.compute.train_child import tokenize_prompts
from node.roles import trainer_group
from node.roles.sample_queue import SampleQueue
from node.roles.trainer_group import GroupRounds
from node.roles.trainer_stats import TrainerStats
from swarm.errors import NetworkError, PeerError
from swarm.shardcast import FetchConfig, ShardStore, fetch_version
from tests.shardcast_util import MemoryPeer, MemorySource, published


def test_a_prompt_queued_as_text_is_tokenized_in_the_child(tmp_path: Path) -> None:
    queued = Group([], [[5, 6], [7]], [1.0, 0.0], 3, text="2+2=")
    q = SampleQueue(tmp_path / "q.db")
    q.put(b"s", 3, [queued])
    [(_, [back])] = q.take(step=3, max_submissions=1, min_version=0)
    assert back == queued  # the text survives the queue (and the pipe: the same wire form)
    assert Group.from_wire(queued.to_wire()) == queued
    assert Group.from_wire([[1], [[2]], [0.5], 0]) == Group([1], [[2]], [0.5], 0)  # old rows

    class Text:
        calls = 0

        def encode_prompt(self, text: str) -> list[int]:
            Text.calls += 1
            return [ord(c) for c in text]

    tokens = Group([9], [[1]], [1.0], 3)
    out = tokenize_prompts([queued, tokens, queued], Text())
    assert out[0].prompt == [ord(c) for c in "2+2="] and out[0].completions == [[5, 6], [7]]
    assert out[1] is tokens  # already tokenized: left alone
    assert out[2] == out[0] and Text.calls == 1


@dataclass
class FakeChild:
    live_peers: dict[str, int]
    lost_versions: set[int] = field(default_factory=set)
    relabelled: list[int] = field(default_factory=list)

    def live(self) -> dict[str, int]:
        return self.live_peers

    def mark_lost(self, version: int) -> None:
        self.lost_versions.add(version)

    def lost(self, version: int) -> bool:
        return version in self.lost_versions

    def relabel(self, version: int) -> None:
        self.relabelled.append(version)


@dataclass
class Announced:
    signer: str


class FakePolicy:
    def __init__(self, accepted: dict[int, str]) -> None:
        self.accepted = {v: Announced(s) for v, s in accepted.items()}


class FakeTrainer:
    """What ``GroupRounds`` uses of ``Trainer``: a version it holds, adopt (which fails for the
    versions in ``unfetchable``), the policy tracker and the queue."""

    def __init__(self, child: FakeChild, version: int, accepted: dict[int, str], q: Any) -> None:
        self.child = child
        self.version = version
        self.window_floor = 0
        self.unfetchable: set[int] = set()
        self.node = type("N", (), {"policy": FakePolicy(accepted), "peer_id": "me"})()
        self.queue = q
        self.stats = TrainerStats()

    def child_or_fail(self) -> FakeChild:
        return self.child

    async def adopt(self, version: int, announced: Any = None) -> None:
        await self.fetch_version(version)
        self.version = version

    async def fetch_version(self, version: int, on_progress: Any = None) -> None:
        if version in self.unfetchable:
            raise NetworkError(f"version {version}: every provider failed")

    @property
    def feed(self) -> FakeTrainer:
        return self


async def test_a_version_lost_with_its_publisher_is_gone_on_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr(trainer_group.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(trainer_group.trio, "sleep", _no_sleep)
    child = FakeChild(live_peers={"me": 3})
    t = FakeTrainer(child, 3, {4: "dead", 5: "dead"}, SampleQueue(tmp_path / "q.db"))
    t.unfetchable = {5}
    rounds = GroupRounds(t)  # type: ignore[arg-type]

    await rounds.catch_up(5)  # the first failure: maybe only slow
    assert t.version == 3 and not child.lost_versions
    clock[0] += trainer_group.LOST_AFTER_S - 1
    await rounds.catch_up(5)
    assert not child.lost_versions

    clock[0] += 2  # unfetchable for LOST_AFTER_S and its publisher is not live: lost
    await rounds.catch_up(5)
    assert child.lost_versions == {5}
    assert t.version == 5 and child.relabelled == [5]  # v4 (fetchable) was adopted first
    assert t.window_floor == 0  # v4 is held: its samples still train
    assert rounds.status.lost_versions == 1


async def test_a_version_whose_publisher_lives_is_never_called_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [0.0]
    monkeypatch.setattr(trainer_group.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(trainer_group.trio, "sleep", _no_sleep)
    child = FakeChild(live_peers={"me": 3, "slow": 5})
    t = FakeTrainer(child, 3, {5: "slow"}, SampleQueue(tmp_path / "q.db"))
    t.unfetchable = {5}
    rounds = GroupRounds(t)  # type: ignore[arg-type]
    for _ in range(3):
        await rounds.catch_up(5)
        clock[0] += trainer_group.LOST_AFTER_S
    assert not child.lost_versions and t.version == 3


async def test_a_slow_fetch_is_cut_only_once_its_publisher_left_the_group(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A fetch with nothing arrived for 30 s (a patch's base: its manifest, its provider
    lookups, on a busy box) goes on while the version's publisher lives, and is cut about
    ``ADOPT_WAIT_S`` after that once it has left (a cut fetch begins again from scratch)."""

    class SlowTrainer(FakeTrainer):
        async def fetch_version(self, version: int, on_progress: Any = None) -> None:
            await trio.sleep(30.0)  # no progress all along

    for live, adopted in (({"me": 3, "slow": 3}, 5), ({"me": 3}, 3)):
        child = FakeChild(live_peers=live)
        t = SlowTrainer(child, 3, {5: "slow"}, SampleQueue(tmp_path / f"q{len(live)}.db"))
        rounds = GroupRounds(t)  # type: ignore[arg-type]

        async def inline(fn: Any, *args: Any) -> Any:  # a thread would let the clock jump
            return fn(*args)

        rounds._sync = inline  # type: ignore[method-assign]
        start = trio.current_time()
        await rounds.catch_up(5)
        took = trio.current_time() - start
        assert t.version == adopted, (live, took)
        if adopted == 3:  # cut: the deadline, the liveness read, then catch_up's 1 s pause
            assert took < trainer_group.ADOPT_WAIT_S + 2, took
        else:  # adopt fetched again (the fake is slow there too): both ran whole
            assert took >= 60.0, took


async def test_the_publisher_of_a_lost_version_gives_its_samples_back(tmp_path: Path) -> None:
    """On restart, the samples a trainer trained into a version recorded lost go back to its
    queue (they train once, in the lineage that went on)."""
    q = SampleQueue(tmp_path / "q.db")
    for i in range(3):
        q.put(bytes([i]), 4, [Group([1], [[2]], [1.0], 4)])
    q.take(step=4, max_submissions=2, min_version=0)
    q.settle(4)  # published v5 alone, then killed before anyone fetched it
    assert q.reserved_steps() == [4] and q.pending() == 1
    rounds = GroupRounds(FakeTrainer(FakeChild({"me": 5}, {5}), 5, {}, q))  # type: ignore[arg-type]
    assert await rounds.give_back_lost() == 2 and q.pending() == 3
    assert await rounds.give_back_lost() == 0


async def test_a_fetch_that_gains_nothing_is_cut_though_a_partial_holder_keeps_answering(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The publisher died holding the only copy of a shard: a peer holding the others answers
    ``have`` again and again, which is no progress. The fetch is cut ``ADOPT_WAIT_S`` after its
    last shard arrived, and only arrivals count for ``catch_up`` (CI: with every ``have``
    answer counted, the fetch ran to its own 30 s give-up, and the group's failover after
    kill -9 of the publisher took over 30 s)."""
    _, signed, store = published(tmp_path)
    data = (store.directory(1) / "data").read_bytes()
    n = len(signed.message.shard_hashes)
    holder = MemoryPeer(data, signed.raw, held=set(range(n - 1)))
    source = MemorySource({"holder": holder}, signed.message)
    config = FetchConfig(have_refresh=0.5, give_up_after=30.0, durable=False)
    receiver = ShardStore(tmp_path / "receiver")
    for gains in (True, False):  # then again, resumed: the shards on disk are no arrival
        arrived: list[object] = []
        scope, progressed = trainer_group._cut_when_idle(trainer_group.ADOPT_WAIT_S, arrived.append)
        start = trio.current_time()
        with scope:
            await fetch_version(
                receiver, signed, source, ["holder"], config=config, on_progress=progressed
            )
        assert scope.cancelled_caught
        assert trio.current_time() - start <= trainer_group.ADOPT_WAIT_S + 1
        assert bool(arrived) == gains
    with pytest.raises(PeerError, match="1 shards missing"):  # uncut: the fetch's own give-up
        await fetch_version(receiver, signed, source, ["holder"], config=config)


async def _no_sleep(_seconds: float) -> None:
    return None


def test_the_publisher_is_the_member_that_joined_first() -> None:
    """A restarted or new trainer (fresh Adam moments) does not publish while a member that was
    there before it is in the round; every member computes the same from the gathered infos."""
    from node.compute.groups import publisher_of  # no hivemind: libp2p shares this process

    infos = [
        {"peer": "A", "joined": 50.0},  # restarted: smallest id, but joined last
        {"peer": "B", "joined": 10.0},
        {"peer": "C", "joined": 20.0},
    ]
    assert publisher_of(infos) == "B" == publisher_of(list(reversed(infos)))
    assert publisher_of([{"peer": "B", "joined": 1.0}, {"peer": "A", "joined": 1.0}]) == "A"
    assert publisher_of([{"peer": "B"}, {"peer": "C", "joined": 5.0}]) == "C"  # older software


class Advert:
    def __init__(self, addrs: list[str]) -> None:
        self.message = type("M", (), {"capabilities": {"hivemind": addrs}})()


class MeetingChild(FakeChild):
    """Records each connect: the addresses and whether those reached before were tried too."""

    def __init__(self, live: dict[str, int]) -> None:
        super().__init__(live_peers=live)
        self.connects: list[tuple[list[str], bool]] = []

    def connect(self, addrs: list[str], again: bool = False) -> list[str]:
        self.connects.append((addrs, again))
        return []


class Membership:
    def __init__(self, adverts: dict[str, list[str]]) -> None:
        self.adverts = adverts
        self.reread: list[str] = []

    def peers_by_role(self) -> dict[str, list[str]]:
        return {"trainer": sorted(self.adverts)}

    def advert_of(self, peer: str) -> Advert:
        return Advert(self.adverts[peer])

    async def refresh_advert(self, peer: str) -> Advert:
        self.reread.append(peer)
        return Advert(self.adverts[peer])


async def test_a_trainer_missing_from_the_group_is_met_again_at_doubling_gaps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two trainers whose DHTs lost each other would each train alone: a trainer the swarm
    lists but the live set lacks has its advert read again and its addresses dialled even if
    reached before, after MEET_EVERY_S and then at doubling gaps while it stays missing."""
    clock = [0.0]
    monkeypatch.setattr(trainer_group.time, "monotonic", lambda: clock[0])
    child = MeetingChild({"me": 3})
    t = FakeTrainer(child, 3, {}, SampleQueue(tmp_path / "q.db"))
    members = Membership({"me": ["/me"], "other": ["/other"]})
    t.node.membership = members
    t.node.peers_by_role = members.peers_by_role
    rounds = GroupRounds(t)  # type: ignore[arg-type]

    met_at = []
    for _ in range(400):  # 40 s of rounds, one per 0.1 s
        await rounds._meet_missing(child.live())
        if child.connects and child.connects[-1][1]:
            met_at.append(clock[0])
            child.connects.clear()
        clock[0] = round(clock[0] + 0.1, 1)
    gaps = [round(b - a) for a, b in itertools.pairwise(met_at)]
    assert met_at[0] == trainer_group.MEET_EVERY_S and gaps == [10, 20]
    assert "other" in members.reread and "me" not in members.reread

    child.live_peers["other"] = 3  # met: back to the first gap if it goes missing again
    await rounds._meet_missing(child.live())
    del child.live_peers["other"]
    start, child.connects = clock[0], []
    while not child.connects:
        await rounds._meet_missing(child.live())
        clock[0] = round(clock[0] + 0.1, 1)
    assert round(clock[0] - 0.1 - start) == trainer_group.MEET_EVERY_S
    assert child.connects == [(["/me"], False), (["/other"], True)]  # our own: skipped there
