"""The fetch scheduler over an in-memory ShardSource: faults, resume, manifest checks."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from swarm.errors import NotAuthorizedError, PeerError, ValidationError
from swarm.messages import RunGenesis, ShardManifest, Signed, sign
from swarm.shardcast import (
    FetchConfig,
    FetchResult,
    ShardStore,
    fetch_manifest,
    fetch_version,
    verify_manifest,
)
from swarm.shardcast.fetch import RECRUIT_AFTER_S
from tests.shardcast_util import MALLORY, TRAINER, MemoryPeer, MemorySource, genesis, published

FAST = FetchConfig(concurrency=4, stall_timeout=5.0, have_refresh=0.05, durable=False)


@dataclass
class Case:
    g: Signed[RunGenesis]
    signed: Signed[ShardManifest]
    data: bytes
    source: MemorySource
    receiver: ShardStore

    async def fetch(self, config: FetchConfig = FAST, **kw: Any) -> FetchResult:
        return await fetch_version(
            self.receiver,
            self.signed,
            self.source,
            list(self.source.peers),
            config=config,
            rng=random.Random(0),
            **kw,
        )


def setup(tmp_path: Path, modes: dict[str, str]) -> Case:
    g, signed, store = published(tmp_path)
    data = (store.directory(1) / "data").read_bytes()
    peers = {name: MemoryPeer(data, signed.raw, mode) for name, mode in modes.items()}
    return Case(
        g, signed, data, MemorySource(peers, signed.message), ShardStore(tmp_path / "receiver")
    )


def stats(result: FetchResult, peer: str) -> Any:
    assert result.progress.board is not None
    return result.progress.board.stats[peer]


async def test_fetch_from_several_peers_gives_the_published_file(tmp_path: Path) -> None:
    c = setup(tmp_path, {"a": "ok", "b": "ok", "c": "ok"})
    result = await c.fetch()
    assert result.path.read_bytes() == c.data
    assert c.receiver.is_complete(1)
    assert len({peer for peer, _ in c.source.pulls}) == 3
    assert result.fetched_shards == len(c.signed.message.shard_hashes)


@pytest.mark.parametrize("mode", ["corrupt", "truncate"])
async def test_a_peer_serving_bad_shards_is_dropped_and_the_file_matches(
    tmp_path: Path, mode: str
) -> None:
    c = setup(tmp_path, {"honest": "ok", "bad": mode})
    result = await c.fetch()
    assert result.path.read_bytes() == c.data
    bad = stats(result, "bad")
    assert bad.dropped and bad.shards == 0
    # Pulls already running when the first bad shard was caught may finish; no new one starts.
    assert sum(1 for peer, _ in c.source.pulls if peer == "bad") <= FAST.concurrency


async def test_a_stalling_peer_times_out_and_the_shard_comes_from_elsewhere(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    c = setup(tmp_path, {"honest": "ok", "stuck": "stall"})
    result = await c.fetch(dataclasses.replace(FAST, endgame=False))
    assert result.path.read_bytes() == c.data
    assert "stalled" in stats(result, "stuck").last_error


async def test_endgame_pulls_a_stuck_last_shard_again_from_an_idle_peer(tmp_path: Path) -> None:
    c = setup(tmp_path, {"honest": "ok", "stuck": "stall"})
    with trio.fail_after(10):  # far below the stall timeout: the endgame copy wins
        result = await c.fetch(dataclasses.replace(FAST, stall_timeout=3600))
    assert result.path.read_bytes() == c.data
    assert result.fetched_shards == len(c.signed.message.shard_hashes)
    assert stats(result, "stuck").failures == 0  # superseded, not blamed


async def test_a_peer_dying_mid_transfer_costs_only_its_shard(tmp_path: Path) -> None:
    c = setup(tmp_path, {"honest": "ok", "dies": "die"})
    result = await c.fetch()
    assert result.path.read_bytes() == c.data
    assert stats(result, "dies").dropped


async def test_when_every_peer_fails_nothing_is_marked_complete(tmp_path: Path) -> None:
    c = setup(tmp_path, {"x": "corrupt", "y": "refuse"})
    with pytest.raises(PeerError, match="every provider failed"):
        await c.fetch()
    assert not c.receiver.is_complete(1)


async def test_a_restarted_fetch_never_pulls_a_verified_shard_again(tmp_path: Path) -> None:
    c = setup(tmp_path, {"a": "ok"})
    with c.receiver.open(c.signed) as vf:  # a previous run verified shards 0..4
        vf.preallocate()
        for i in range(5):
            start, length = c.signed.message.shard_span(i)
            vf.write_at(start, c.data[start : start + length])
            vf.mark_verified(i)
    result = await c.fetch()
    assert result.path.read_bytes() == c.data
    assert not {i for _, i in c.source.pulls} & set(range(5))
    assert result.resumed_shards == 5


async def test_partial_holders_serve_only_what_they_hold(tmp_path: Path) -> None:
    c = setup(tmp_path, {"origin": "ok", "half": "ok"})
    n = len(c.signed.message.shard_hashes)
    c.source.peers["half"].held = set(range(0, n, 2))
    result = await c.fetch()
    assert result.path.read_bytes() == c.data
    assert all(i % 2 == 0 for peer, i in c.source.pulls if peer == "half")


async def test_progress_reports_bytes_and_peers(tmp_path: Path) -> None:
    c = setup(tmp_path, {"a": "ok", "b": "ok"})
    seen: list[int] = []
    result = await c.fetch(on_progress=lambda p: seen.append(p.done_bytes))
    assert seen[-1] == len(c.data) and seen == sorted(seen)
    assert {p["peer"] for p in result.progress.peers()} == {"a", "b"}


async def test_a_manifest_signed_by_a_non_trainer_is_rejected_before_any_shard(
    tmp_path: Path,
) -> None:
    c = setup(tmp_path, {"a": "ok"})
    forged = sign(c.signed.message, MALLORY)
    c.source.peers["a"].manifest_raw = forged.raw
    with pytest.raises(PeerError, match="not a trainer"):
        await fetch_manifest(c.source, ["a"], c.g, 1)
    with pytest.raises(NotAuthorizedError):
        verify_manifest(forged.raw, c.g)
    assert c.source.pulls == []


async def test_a_manifest_of_another_run_or_version_is_rejected(tmp_path: Path) -> None:
    c = setup(tmp_path, {"a": "ok"})
    with pytest.raises(ValidationError, match="not this run"):
        verify_manifest(c.signed.raw, genesis(name="another-run"))
    with pytest.raises(ValidationError, match="asked for version 2"):
        verify_manifest(c.signed.raw, c.g, 2)


async def test_fetch_manifest_picks_the_newest_valid_version(tmp_path: Path) -> None:
    c = setup(tmp_path, {"a": "ok", "b": "ok"})
    newer = sign(dataclasses.replace(c.signed.message, version=5), TRAINER)
    c.source.peers["b"].manifest_raw = newer.raw
    got = await fetch_manifest(c.source, ["a", "b"], c.g)
    assert got.message.version == 5


async def test_a_peer_that_claims_a_version_but_lacks_its_shards_spends_its_budget(
    tmp_path: Path,
) -> None:
    c = setup(tmp_path, {"origin": "ok", "liar": "ok"})
    c.source.peers["liar"].held = set()  # pulls are refused as not held...

    async def claims_all(peer: str, version: int, *_: object) -> bytes | None:
        return None  # ...while it claims to hold the whole version

    c.source.have = claims_all  # type: ignore[method-assign]
    with trio.fail_after(10):
        result = await c.fetch()
    assert result.path.read_bytes() == c.data
    liar = stats(result, "liar")
    asked = sum(1 for peer, _ in c.source.pulls if peer == "liar")
    assert liar.failures == asked and liar.shards == 0
    assert asked <= FAST.failure_budget + FAST.concurrency  # then it is dropped


async def test_a_busy_peer_rests_without_losing_its_budget_and_still_serves(
    tmp_path: Path,
) -> None:
    c = setup(tmp_path, {"only": "ok"})
    c.source.peers["only"].busy = 5  # more refusals than the failure budget (3)
    result = await c.fetch()
    assert result.path.read_bytes() == c.data
    only = stats(result, "only")
    assert only.busy == 5 and only.failures == 0 and not only.dropped


async def test_shards_that_a_peer_holds_come_from_the_peer_not_the_origin(
    tmp_path: Path,
) -> None:
    c = setup(tmp_path, {"origin": "ok", "a": "ok", "b": "ok", "c": "ok"})
    result = await c.fetch(config=dataclasses.replace(FAST, explore=0.0), origins=["origin"])
    assert result.path.read_bytes() == c.data
    total = len(c.signed.message.shard_hashes)
    # peers had free slots for the rest; with the origin weighed as any peer it serves ~1/4
    assert stats(result, "origin").shards <= total // 6


async def test_a_fetch_with_one_holder_among_its_peers_asks_for_more_and_uses_them(
    tmp_path: Path,
) -> None:
    """Bounded connections: of the receiver's peers only one holds the version (the others
    hold none of it); the fetch asks ``more_peers`` once and pulls from the holders it names
    as well."""
    c = setup(
        tmp_path, {"holder": "ok", "empty1": "ok", "empty2": "ok", "far1": "ok", "far2": "ok"}
    )
    for name in ("empty1", "empty2"):
        c.source.peers[name].held = set()
    asked: list[int] = []

    async def more_peers() -> list[str]:
        asked.append(1)
        return ["holder", "far1", "far2"]

    result = await fetch_version(
        c.receiver,
        c.signed,
        c.source,
        ["holder", "empty1", "empty2"],
        config=FAST,
        rng=random.Random(0),
        more_peers=more_peers,
    )
    assert result.path.read_bytes() == c.data
    assert asked == [1]
    assert {"far1", "far2"} & {peer for peer, _ in c.source.pulls}


async def test_a_long_fetch_with_one_holder_asks_again_for_holders_that_came_later(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The other holders' provider records are not placed yet when the receiver first asks
    (they had just finished their own copies): a slow fetch from the one holder it has asks
    again, less and less often, and takes shards from the holder named later."""
    c = setup(tmp_path, {"origin": "ok", "empty": "ok", "late": "ok"})
    c.source.peers["origin"].pace = 1.0  # about a minute a shard: the fetch outlasts the asks
    c.source.peers["empty"].held = set()
    asked: list[float] = []

    async def more_peers() -> list[str]:
        asked.append(trio.current_time())
        return ["origin"] if len(asked) < 3 else ["origin", "late"]

    result = await fetch_version(
        c.receiver,
        c.signed,
        c.source,
        ["origin", "empty"],
        config=FAST,
        rng=random.Random(0),
        more_peers=more_peers,
    )
    assert result.path.read_bytes() == c.data
    assert len(asked) == 3  # then two holders: asked no more
    first, second, third = asked
    assert third - second == pytest.approx(2 * (second - first))  # backing off
    assert stats(result, "late").shards > 0


async def test_a_peer_slow_to_answer_does_not_hold_back_the_ask_for_more_holders(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """One holder among the receiver's peers, and one peer whose first answer takes 30 s: the
    fetch asks for more holders ``RECRUIT_AFTER_S`` in, not once that answer comes (it waited
    ``have_wait``, 5 s, and a 30-node run's newcomer took the whole version from one holder)."""
    c = setup(tmp_path, {"holder": "ok", "slow": "ok", "far": "ok"})
    c.source.peers["holder"].pace = 0.1  # seconds a chunk: about 4 s alone
    c.source.peers["slow"].answer_after = 30.0
    start = trio.current_time()
    asked: list[float] = []

    async def more_peers() -> list[str]:
        asked.append(trio.current_time() - start)
        return ["holder", "far"]

    result = await fetch_version(
        c.receiver,
        c.signed,
        c.source,
        ["holder", "slow"],
        config=FetchConfig(have_wait=5.0),
        rng=random.Random(0),
        more_peers=more_peers,
    )
    assert result.path.read_bytes() == c.data
    assert asked and asked[0] == pytest.approx(RECRUIT_AFTER_S, abs=0.1)
    assert stats(result, "far").shards > 0


async def test_a_holder_that_refuses_connections_for_a_while_is_tried_again_not_dropped(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A holder at its connection cap refuses a newcomer for a few seconds (five refusals
    here, past the failure budget of 3): the fetch rests it and takes shards from it once it
    answers, where it used to drop it after three refusals in as many seconds."""
    c = setup(tmp_path, {"origin": "ok", "holder": "ok"})
    c.source.peers["origin"].pace = 1.0  # a slow trainer: the fetch outlasts the refusals
    c.source.peers["holder"].unreachable = 5
    result = await c.fetch()
    assert result.path.read_bytes() == c.data
    holder = stats(result, "holder")
    assert not holder.dropped and holder.shards > 0 and holder.failures == 5


async def test_a_peer_that_held_nothing_and_then_cannot_be_reached_is_dropped_as_before(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Resting is for holders: a peer whose last answer held nothing (our trimmer lets those go
    first at our cap) is dropped after the usual budget, not dialed again and again."""
    c = setup(tmp_path, {"origin": "ok", "empty": "ok"})
    c.source.peers["origin"].pace = 1.0
    c.source.peers["empty"].held = set()
    c.source.peers["empty"].reachable_first = 1  # it answers once: nothing
    c.source.peers["empty"].unreachable = 100
    result = await c.fetch()
    assert result.path.read_bytes() == c.data
    empty = stats(result, "empty")
    assert empty.dropped and empty.failures == 3


async def test_the_peers_that_hold_none_of_it_are_named_while_the_fetch_runs(
    tmp_path: Path,
) -> None:
    """``FetchProgress.empty``: the peers whose last answer held none of the version, for the
    connection trimmer (``ConnectionTrimmer.expendable``); empty once the fetch is over."""
    c = setup(tmp_path, {"holder": "ok", "none": "ok"})
    c.source.peers["none"].held = set()
    c.source.peers["holder"].pace = 0.01
    seen: list[set[str]] = []
    result = await c.fetch(on_progress=lambda p: seen.append(set(p.empty)))
    assert {"none"} in seen and not any("holder" in s for s in seen)
    assert result.progress.empty == set()


async def test_a_fetch_whose_peers_hold_the_version_asks_for_no_more(tmp_path: Path) -> None:
    c = setup(tmp_path, {"a": "ok", "b": "ok"})

    async def more_peers() -> list[str]:
        raise AssertionError("asked for more peers with two holders")

    result = await c.fetch(more_peers=more_peers)
    assert result.path.read_bytes() == c.data
