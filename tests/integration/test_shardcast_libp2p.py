"""SHARDCAST between real nodes (libp2p on 127.0.0.1): control on streams, bytes on the data
channel when offered and on the shard stream when not; bad requests refused, server unharmed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from node.runtime import Node
from swarm.errors import PeerError
from swarm.messages import ShardManifest, Signed
from swarm.shardcast import (
    FetchConfig,
    FetchResult,
    ShardStore,
    fetch_manifest,
    fetch_version,
    publish,
)
from swarm.shardcast.datachannel import DataChannelServer
from swarm.shardcast.protocol import ShardRequest
from swarm.shardcast.serve import ShardServer
from swarm.shardcast.streams import SHARD, SHARD_LIMITS, StreamShardSource, serve_shardcast
from tests.netfactory import NetFactory, wait_until
from tests.shardcast_util import checkpoint


async def two_nodes(net: NetFactory) -> tuple[Node, Node]:
    await net.bootstrap()
    trainer = await net.node("trainer")
    receiver = await net.node("inference")
    await wait_until(lambda: receiver.peers_by_role().get("trainer"), 20)
    return trainer, receiver


def published(
    net: NetFactory, tmp_path: Path, size: int, store: ShardStore, version: int = 1
) -> Path:
    """A checkpoint of ``size`` bytes, published by the genesis trainer into ``store`` in
    64 KiB shards; returns the checkpoint (what every fetch must reproduce)."""
    ckpt = checkpoint(tmp_path / "policy.safetensors", size)
    publish(
        ckpt,
        key=net.trainer_keys[0],
        genesis=net.genesis,
        version=version,
        store=store,
        shard_size=65_536,
    )
    return ckpt


@pytest.mark.parametrize("offer_channel", [True, False])
async def test_a_node_fetches_a_published_version_from_the_trainer(
    tmp_path: Path, offer_channel: bool
) -> None:
    async with trio.open_nursery() as nursery, NetFactory() as net:
        trainer, receiver = await two_nodes(net)
        store = ShardStore(tmp_path / "trainer")
        ckpt = published(net, tmp_path, 300_000, store)
        server = ShardServer(store)
        channel = None
        if offer_channel:
            channel = DataChannelServer(server)
            await nursery.start(channel.run)
        serve_shardcast(trainer, server, channel)

        source = StreamShardSource(receiver)
        manifest = await fetch_manifest(source, [trainer.peer_id], net.genesis)
        assert manifest.message.version == 1
        result = await fetch_version(
            ShardStore(tmp_path / "rx"),
            manifest,
            source,
            [trainer.peer_id],
            config=FetchConfig(stall_timeout=10),
            rng=random.Random(0),
        )
        source.close()
        assert result.path.read_bytes() == ckpt.read_bytes()
        if offer_channel:
            assert source.channel_pulls > 0 and source.stream_pulls == 0
        else:
            assert source.stream_pulls > 0 and source.channel_pulls == 0
        nursery.cancel_scope.cancel()  # the data channel; the nodes stop with the factory


async def test_bad_stream_requests_are_refused_and_the_server_keeps_serving(
    tmp_path: Path,
) -> None:
    async with NetFactory() as net:
        trainer, receiver = await two_nodes(net)
        store = ShardStore(tmp_path / "trainer")
        ckpt = published(net, tmp_path, 100_000, store)
        server = ShardServer(store)
        serve_shardcast(trainer, server)
        source = StreamShardSource(receiver, data_channel=False)
        with pytest.raises(PeerError, match="not held"):
            await fetch_manifest(source, [trainer.peer_id], net.genesis, 7)
        bad = [
            ShardRequest("get", 1, 99, 0, 10),
            ShardRequest("get", 1, 0, 70_000, 10),
            ShardRequest("get", 1, 0, 0, 2**40),
            ShardRequest("channel", 1),
        ]
        for request in bad:
            with pytest.raises(PeerError, match="refused"):
                await receiver.request(trainer.peer_id, SHARD, request.to_bytes(), SHARD_LIMITS)
        with pytest.raises(PeerError, match="refused"):
            await receiver.request(trainer.peer_id, SHARD, b"\x93garbage", SHARD_LIMITS)
        piece = await receiver.request(
            trainer.peer_id, SHARD, ShardRequest("get", 1, 1, 5, 20).to_bytes(), SHARD_LIMITS
        )
        assert piece == ckpt.read_bytes()[65_536 + 5 : 65_536 + 25]
        # Once serving ends (``ShardcastService`` leaving its block), the handlers, still
        # registered, serve nothing: every version is refused as not held.
        server.close()
        with pytest.raises(PeerError, match="not served here any more"):
            await fetch_manifest(source, [trainer.peer_id], net.genesis, 1)
        with pytest.raises(PeerError, match="not served here any more"):
            await source.have(trainer.peer_id, 1)


async def test_fetched_versions_are_advertised_and_re_served(tmp_path: Path) -> None:
    from node.shardcast import ShardcastService
    from swarm.shardcast.datachannel import DataChannelConfig

    async with NetFactory() as net:
        await net.bootstrap()
        trainer = await net.node("trainer")
        first = await net.node("inference")
        second = await net.node("inference")
        await wait_until(lambda: first.peers_by_role().get("trainer"), 20)
        await wait_until(lambda: second.peers_by_role().get("trainer"), 20)
        stores = {n: ShardStore(tmp_path / n) for n in ("trainer", "first", "second")}
        ckpt = published(net, tmp_path, 300_000, stores["trainer"], version=2)
        channel = DataChannelConfig()
        async with (
            ShardcastService.start(
                trainer, net.genesis, stores["trainer"], data_channel=channel
            ) as origin,
            ShardcastService.start(first, net.genesis, stores["first"], data_channel=channel) as a,
            ShardcastService.start(second, net.genesis, stores["second"]) as b,
        ):
            await origin.advertise(2)
            got = await a.fetch()  # newest version, found through the trainer
            assert got.version == 2 and got.path.read_bytes() == ckpt.read_bytes()
            # the first receiver advertised itself as a provider of version 2
            await wait_until(lambda: _has(b, first.peer_id), 20)
            again = await b.fetch(2)
            assert again.path.read_bytes() == ckpt.read_bytes()
            assert a.status()["served_shards"] + origin.status()["served_shards"] > 0
            assert b.status()["versions"][0]["complete"]
            # status says which path the shards took: all over data channels on loopback
            shards = got.fetched_shards
            assert a.status()["last_fetch"]["data_channel_shards"] == shards
            # Pulls, not shards: an endgame pull of a slow shard from the other holder counts
            # too (a loaded CI run counted 6 pulls for 5 shards).
            paths = b.status()["paths"]
            assert paths["data_channel"] >= shards and paths["stream"] == 0, paths
            assert paths["refused_offers"] == 0, paths


async def _has(service: object, peer: str) -> bool:
    return peer in await service.providers(2)  # type: ignore[attr-defined]


async def fetch_v1(
    net: NetFactory, trainer: Node, source: StreamShardSource, root: Path
) -> tuple[Signed[ShardManifest], FetchResult]:
    """Fetch version 1 from ``trainer`` alone into a new store at ``root``: (manifest, result)."""
    manifest = await fetch_manifest(source, [trainer.peer_id], net.genesis, 1)
    result = await fetch_version(
        ShardStore(root),
        manifest,
        source,
        [trainer.peer_id],
        config=FetchConfig(stall_timeout=10),
        rng=random.Random(0),
    )
    return manifest, result


async def test_an_unreachable_data_channel_falls_back_to_the_shard_stream(tmp_path: Path) -> None:
    async with NetFactory() as net:
        trainer, receiver = await two_nodes(net)
        store = ShardStore(tmp_path / "trainer")
        ckpt = published(net, tmp_path, 200_000, store)
        server = ShardServer(store)
        channel = DataChannelServer(server)
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.run)
            nursery.cancel_scope.cancel()  # offered, but nobody listens there any more
        serve_shardcast(trainer, server, channel)
        source = StreamShardSource(receiver)
        manifest, result = await fetch_v1(net, trainer, source, tmp_path / "rx")
        assert result.path.read_bytes() == ckpt.read_bytes()
        assert source.stream_pulls == len(manifest.message.shard_hashes)
        assert source.channel_pulls == 0
        assert result.progress.board is not None
        assert result.progress.board.stats[trainer.peer_id].failures == 0


async def test_a_data_channel_offer_naming_another_host_is_refused_for_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that names a third host in its offer never gets us to connect there: the offer is
    refused (counted, logged) and every shard comes over the libp2p stream instead."""
    from swarm.shardcast import streams

    monkeypatch.setattr(streams, "offer_host", lambda *_: "192.0.2.7")  # TEST-NET-1
    async with trio.open_nursery() as nursery, NetFactory() as net:
        trainer, receiver = await two_nodes(net)
        store = ShardStore(tmp_path / "trainer")
        ckpt = published(net, tmp_path, 200_000, store)
        server = ShardServer(store)
        channel = DataChannelServer(server)
        await nursery.start(channel.run)
        serve_shardcast(trainer, server, channel)
        source = StreamShardSource(receiver)
        manifest, result = await fetch_v1(net, trainer, source, tmp_path / "rx")
        assert result.path.read_bytes() == ckpt.read_bytes()
        assert source.refused_offers >= 1  # pulls run in parallel: each may have asked
        assert source.channel_pulls == 0 and channel.connections == 0
        assert source.stream_pulls == len(manifest.message.shard_hashes)
        nursery.cancel_scope.cancel()


def test_the_channel_is_offered_only_where_the_asker_reached_us() -> None:
    from swarm.net import DirectPath
    from swarm.shardcast.streams import offer_host

    lan = DirectPath(local_ip="10.77.0.2", remote_ip="10.77.0.3")
    assert offer_host("0.0.0.0", lan) == "10.77.0.2"
    assert offer_host("10.77.0.2", lan) == "10.77.0.2"
    assert offer_host("127.0.0.1", lan) is None  # bound to loopback: not reachable from a LAN
    assert offer_host("0.0.0.0", None) is None  # relayed (or unknown): streams only
    natted = DirectPath(local_ip="192.168.1.5", remote_ip="93.184.216.34")
    assert offer_host("0.0.0.0", natted) == "192.168.1.5"
    assert offer_host("0.0.0.0", natted, advertised="203.0.113.5") == "203.0.113.5"
    assert offer_host("0.0.0.0", lan, advertised="203.0.113.5") == "10.77.0.2"


async def test_a_node_knows_both_ends_of_its_direct_connection(tmp_path: Path) -> None:
    async with NetFactory() as net:
        trainer, receiver = await two_nodes(net)
        path = await wait_until(lambda: receiver.direct_path(trainer.peer_id), 10)
        assert path.local_ip == "127.0.0.1" and path.remote_ip == "127.0.0.1"
        assert receiver.direct_path(net.owner.peer_id) is None  # never connected
