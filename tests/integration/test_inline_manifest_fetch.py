"""A worker fetches a version whose announcement carries its manifest without asking anyone for
the manifest (at N = 100 loopback nodes the trainer's manifest answers timed out and 85 of 100
fetches failed, docs/BENCHMARKS.md, Scale); an announcement without one still works."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import trio

from node.policy_feed import PolicyFeed
from swarm.messages import sign
from swarm.shardcast import publish
from tests.netfactory import NetFactory
from tests.shardcast_util import checkpoint


async def test_the_carried_manifest_is_used_and_the_trainer_is_not_asked(tmp_path: Path) -> None:
    weights = checkpoint(tmp_path / "v.safetensors", size=200_000)
    async with NetFactory() as net:
        trainer = await net.node("trainer", bootstrap=[])
        worker = await net.node("inference", bootstrap=[], connect_found_peers=False)
        assert await worker.overlay.connect(trainer.peer_id, trainer.overlay.addrs()) is None
        source = PolicyFeed(trainer, tmp_path / "trainer", data_channel=False)
        sink = PolicyFeed(worker, tmp_path / "worker", data_channel=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(source.run)
            await nursery.start(sink.run)
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
            nursery.cancel_scope.cancel()


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
        assert await loser.overlay.connect(winner.peer_id, winner.overlay.addrs()) is None
        source = PolicyFeed(winner, tmp_path / "winner", data_channel=False)
        sink = PolicyFeed(loser, tmp_path / "loser", data_channel=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(source.run)
            await nursery.start(sink.run)
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
            nursery.cancel_scope.cancel()
