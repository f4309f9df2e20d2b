"""A worker fetches a version whose announcement carries its manifest without asking anyone for
the manifest (at N = 100 loopback nodes the trainer's manifest answers timed out and 85 of 100
fetches failed, docs/BENCHMARKS.md, Scale); an announcement without one still works."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from node.policy_feed import PolicyFeed
from node.runtime import Node
from swarm.messages import sign
from swarm.shardcast import publish
from tests.netfactory import NetFactory
from tests.shardcast_util import checkpoint


@asynccontextmanager
async def feeds(
    tmp_path: Path, source: Node, sink: Node
) -> AsyncIterator[tuple[PolicyFeed, PolicyFeed]]:
    """``sink`` connected to ``source``, each with a running ``PolicyFeed`` (streams only)."""
    assert await sink.overlay.connect(source.peer_id, source.overlay.addrs()) is None
    a = PolicyFeed(source, tmp_path / "source", data_channel=False)
    b = PolicyFeed(sink, tmp_path / "sink", data_channel=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await nursery.start(b.run)
        yield a, b
        nursery.cancel_scope.cancel()


async def test_the_carried_manifest_is_used_and_the_trainer_is_not_asked(tmp_path: Path) -> None:
    weights = checkpoint(tmp_path / "v.safetensors", size=200_000)
    async with NetFactory() as net:
        trainer = await net.node("trainer", bootstrap=[])
        worker = await net.node("inference", bootstrap=[], connect_found_peers=False)
        async with feeds(tmp_path, trainer, worker) as (source, sink):
            manifest = await source.publish(2, weights)
            announced = trainer.policy.newest
            assert announced is not None and announced.message.manifest == manifest.raw
            server = source._service().server
            with trio.fail_after(60):
                path = await sink.fetch(announced)
            assert server.manifests_served == 0
            assert path.read_bytes() == (source.store.directory(2) / "data").read_bytes()

            # The same version announced without it (an older trainer, or a manifest past
            # INLINE_MANIFEST_MAX): the worker asks for the manifest, as before.
            await source.publish(3, weights)
            assert trainer.policy.newest is not None
            bare = sign(
                dataclasses.replace(trainer.policy.newest.message, manifest=b""), trainer.key
            )
            with trio.fail_after(60):
                await sink.fetch(bare)
            assert server.manifests_served >= 1


async def test_a_trainers_own_cut_that_lost_is_replaced_by_the_announced_one(
    tmp_path: Path,
) -> None:
    """Two trainers cut the same version; one is announced. The other (killed between its cut
    and its announcement, in the trainer-group test) drops its own cut and fetches the
    announced one, so every node holds one manifest per version."""
    weights = checkpoint(tmp_path / "v.safetensors", size=200_000)
    async with NetFactory(trainers=2) as net:
        winner = await net.node("trainer", net.trainer_keys[0], bootstrap=[])
        loser = await net.node("trainer", net.trainer_keys[1], bootstrap=[])
        async with feeds(tmp_path, winner, loser) as (source, sink):
            mine = publish(
                weights,
                key=loser.key,
                genesis=loser.config.genesis,
                version=2,
                store=sink.store,
            )  # cut, never announced
            theirs = await source.publish(2, weights)
            assert mine.id != theirs.id and winner.policy.newest is not None
            with trio.fail_after(60):
                await sink.fetch(winner.policy.newest)
            assert sink.store.manifest(2).id == theirs.id
