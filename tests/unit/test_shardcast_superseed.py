"""Super-seeding at the origin, waiting ``have`` answers (the push of new holdings), and the
manifest asked of peers before the origin: the server side and the scheduler, in memory."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from swarm.shardcast import FetchConfig, ShardStore, fetch_manifest, fetch_version
from swarm.shardcast.datachannel import DataChannelServer, DataChannelSource
from swarm.shardcast.local import DirectControl
from swarm.shardcast.serve import MAX_WAITING, ShardServer
from swarm.shardcast.source import ShardElsewhere
from tests.shardcast_util import TRAINER, MemoryPeer, MemorySource, published

FAST = FetchConfig(concurrency=4, stall_timeout=5.0, have_refresh=0.05, durable=False)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_origin_grants_each_shard_k_times_then_refers_askers_to_peers(
    tmp_path: Path,
) -> None:
    _, _, store = published(tmp_path)
    clock = Clock()
    server = ShardServer(store, origin=TRAINER.peer_id, seed_copies=2, seed_stale=10.0, clock=clock)
    server.grant(1, 0)
    server.grant(1, 0)
    with pytest.raises(ShardElsewhere, match="elsewhere: shard 0 of version 1 went to 2 peers"):
        server.grant(1, 0)
    server.grant(1, 1)  # another shard: nobody holds it yet, it is served
    server.grant(1, 0, offset=4096)  # the rest of a shard already being sent: never refused
    clock.now += 10.0  # nobody was given shard 0 for seed_stale: a stuck asker gets it
    server.grant(1, 0)
    with pytest.raises(ShardElsewhere):
        server.grant(1, 0)
    assert server.granted(1)[:2] == [3, 1]
    assert server.elsewhere_refusals == 2


def test_an_origin_with_idle_upload_slots_serves_any_shard(tmp_path: Path) -> None:
    _, _, store = published(tmp_path)
    server = ShardServer(store, max_uploads=4, origin=TRAINER.peer_id, seed_copies=1, seed_busy=3)
    for _ in range(3):  # one upload at a time: the uplink is idle, nothing is refused
        server.take_slot()
        server.grant(1, 0)
        server.release_slot()
    server.take_slot()
    server.take_slot()
    server.take_slot()  # three running: contended, a fourth copy of shard 0 goes elsewhere
    with pytest.raises(ShardElsewhere):
        server.grant(1, 0)
    server.grant(1, 1)  # a shard nobody was given yet is still served


def test_super_seeding_applies_only_to_versions_this_node_signed(tmp_path: Path) -> None:
    _, _, store = published(tmp_path)
    relay = ShardServer(store, origin="someone-else", seed_copies=1)
    unlimited = ShardServer(store, origin=TRAINER.peer_id, seed_copies=None)
    for _ in range(5):
        relay.grant(1, 0)
        unlimited.grant(1, 0)
    assert relay.elsewhere_refusals == unlimited.elsewhere_refusals == 0


async def test_a_have_answer_waits_for_a_new_shard_and_comes_at_once_when_it_does(
    tmp_path: Path,
) -> None:
    _, signed, origin = published(tmp_path)
    data = (origin.directory(1) / "data").read_bytes()
    store = ShardStore(tmp_path / "holder")
    server = ShardServer(store)
    with store.open(signed) as vf:
        vf.write_at(0, data)
        vf.mark_verified(0, durable=False)
        # Asked with nothing known: the answer comes at once.
        with trio.fail_after(1):
            assert (await server.wait_have(1, -1, 5.0) or b"")[:2] == b"\x01\x00"
        # Knowing our one shard, the asker's answer waits until a second one is verified.
        answer: list[bytes | None] = []

        async def ask() -> None:
            answer.append(await server.wait_have(1, 1, 8.0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.sleep(0.3)
            assert not answer
            vf.mark_verified(3, durable=False)
            server.changed()
            start = trio.current_time()
            with trio.fail_after(1):
                while not answer:
                    await trio.sleep(0.01)
            assert trio.current_time() - start < 0.5
        assert answer[0] is not None and sum(answer[0]) == 2 and answer[0][3] == 1
        # Nothing new: it answers after the wait with the same holdings.
        start = trio.current_time()
        assert sum(await server.wait_have(1, 2, 0.3) or b"") == 2
        assert trio.current_time() - start >= 0.29


async def test_a_refused_shard_comes_from_a_peer_and_costs_the_origin_nothing(
    tmp_path: Path,
) -> None:
    _, signed, store = published(tmp_path)
    data = (store.directory(1) / "data").read_bytes()
    n = len(signed.message.shard_hashes)
    origin = MemoryPeer(data, signed.raw, elsewhere=set(range(n // 2)))
    peer = MemoryPeer(data, signed.raw, held=set(range(n // 2)))
    source = MemorySource({TRAINER.peer_id: origin, "peer": peer}, signed.message)
    result = await fetch_version(
        ShardStore(tmp_path / "receiver"),
        signed,
        source,
        [TRAINER.peer_id, "peer"],
        config=FAST,
        rng=random.Random(0),
        origins=[TRAINER.peer_id],
    )
    assert result.path.read_bytes() == data
    assert result.progress.board is not None
    stats = result.progress.board.stats[TRAINER.peer_id]
    assert stats.failures == 0 and not stats.dropped
    assert set(range(n // 2)) <= set(peer.served)  # what the origin refused came from the peer
    assert not set(origin.served) & set(range(n // 2))


async def test_the_manifest_is_asked_of_peers_before_the_origin(tmp_path: Path) -> None:
    g, signed, store = published(tmp_path)
    data = (store.directory(1) / "data").read_bytes()
    origin = MemoryPeer(data, signed.raw)
    holder = MemoryPeer(data, signed.raw, held={0})
    empty = MemoryPeer(data, signed.raw, held=set())
    peers = {TRAINER.peer_id: origin, "holder": holder, "empty": empty}
    source = MemorySource(peers, signed.message)
    got = await fetch_manifest(source, list(peers), g, 1, origins=[TRAINER.peer_id])
    assert got.id == signed.id
    assert origin.manifest_asked == 0 and holder.manifest_asked == 1
    # Nobody but the origin holds it yet (right after the announcement): the origin answers.
    alone = {TRAINER.peer_id: origin, "empty": empty}
    source = MemorySource(alone, signed.message)
    got = await fetch_manifest(source, list(alone), g, 1, origins=[TRAINER.peer_id])
    assert got.id == signed.id and origin.manifest_asked == 1


async def test_every_shard_past_the_first_copies_comes_from_peers(tmp_path: Path) -> None:
    """Six receivers and an origin that super-seeds, all in memory over real ShardServers:
    the origin serves each shard at most ``seed_copies`` times; peers serve the rest."""

    _, signed, origin_store = published(tmp_path, size=300_000, shard_size=16_384)
    data = (origin_store.directory(1) / "data").read_bytes()
    names = [TRAINER.peer_id, *(f"r{i}" for i in range(6))]
    stores = {TRAINER.peer_id: origin_store}
    stores |= {n: ShardStore(tmp_path / n) for n in names[1:]}
    servers = {
        n: ShardServer(s, max_uploads=4, origin=TRAINER.peer_id, seed_copies=2, seed_stale=60)
        for n, s in stores.items()
    }
    async with trio.open_nursery() as nursery:
        ports = {}
        for name, server in servers.items():
            ports[name] = await nursery.start(DataChannelServer(server).run)
        control = DirectControl(servers, ports)

        async def receive(me: str) -> None:
            source = DataChannelSource(control.negotiate, control)
            try:
                await fetch_version(
                    stores[me],
                    signed,
                    source,
                    [p for p in names if p != me],
                    config=FAST,
                    on_progress=lambda _: servers[me].changed(),
                    rng=random.Random(me),
                    origins=[TRAINER.peer_id],
                )
            finally:
                source.close()

        with trio.fail_after(60):
            async with trio.open_nursery() as receivers:
                for name in names[1:]:
                    receivers.start_soon(receive, name)
        nursery.cancel_scope.cancel()
    for name in names[1:]:
        assert (stores[name].directory(1) / "data").read_bytes() == data
    n = len(signed.message.shard_hashes)
    assert max(servers[TRAINER.peer_id].granted(1)) <= 2
    served = {name: s.served_shards for name, s in servers.items()}
    assert served[TRAINER.peer_id] <= 2 * n < sum(served.values())


async def test_past_max_waiting_a_have_is_answered_at_once(tmp_path: Path) -> None:
    """Waiting answers hold stream slots of the shard protocol: past ``MAX_WAITING`` a holder
    answers at once (the asker then polls), so ``get`` and ``channel`` requests still fit."""
    _, signed, _ = published(tmp_path)
    store = ShardStore(tmp_path / "holder")
    server = ShardServer(store)
    with store.open(signed) as vf:
        vf.mark_verified(0, durable=False)
        server.waiting = MAX_WAITING
        with trio.fail_after(0.5):
            assert sum(await server.wait_have(1, 1, 5.0) or b"") == 1
        assert server.waiting == MAX_WAITING
