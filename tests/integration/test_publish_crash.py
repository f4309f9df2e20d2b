"""A trainer killed in the middle of publishing a version restarts and publishes it again
(found by the network-namespace fault test: the restarted trainer exited with "holds a
different manifest")."""

from __future__ import annotations

from pathlib import Path

import trio

from node.policy_feed import PolicyFeed
from swarm.messages import ShardManifest, sign
from tests.netfactory import NetFactory
from tests.shardcast_util import checkpoint


async def test_a_publish_cut_short_by_a_crash_is_redone_on_restart(tmp_path: Path) -> None:
    weights = checkpoint(tmp_path / "v2.safetensors", size=60_000)
    async with NetFactory() as net:
        trainer = await net.node("trainer", bootstrap=[])
        feed = PolicyFeed(trainer, tmp_path / "shards", data_channel=False)
        # What kill -9 during the cut leaves: the trainer's own manifest for v2, data unfinished.
        crashed = ShardManifest(
            trainer.run_id, 2, (), 1024, (), 0, 1
        )  # a manifest of an earlier cut (another created_at, other hashes)
        with feed.store.open(sign(crashed, trainer.key)) as partial:
            assert not partial.verified_indices()
        assert not feed.store.is_complete(2)
        async with trio.open_nursery() as nursery:
            await nursery.start(feed.run)
            manifest = await feed.publish(2, weights)
            nursery.cancel_scope.cancel()
    assert manifest.message.version == 2 and manifest.id != sign(crashed, trainer.key).id
    assert feed.store.is_complete(2)


async def test_a_restarted_trainer_whose_version_the_swarm_knows_serves_it(tmp_path: Path) -> None:
    """The restarted trainer's catch-up may learn its own last announcement from a peer before
    it re-publishes that version; re-announcing it would be refused as stale (the trainer exited
    with "stale: version 41 is not newer than 41" in the netns test)."""
    weights = checkpoint(tmp_path / "v2.safetensors", size=60_000)
    async with NetFactory() as net:
        trainer = await net.node("trainer", bootstrap=[])
        feed = PolicyFeed(trainer, tmp_path / "shards", data_channel=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(feed.run)
            first = await feed.publish(2, weights)
            assert trainer.policy.version == 2  # as a peer's answer would have told it
            again = await feed.publish(2, weights)
            nursery.cancel_scope.cancel()
    assert again.id == first.id
