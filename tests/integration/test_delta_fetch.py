"""Versions travel as patches (docs/shardcast.md): a node holding v-1 fetches only v's patch, a
node that joins late catches up from the newest snapshot and the patches after it, and a patch
that does not reconstruct the signed tensors is refused and deleted. Real libp2p hosts on
127.0.0.1, streams only."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from safetensors.torch import save_file

from node.policy_feed import PolicyFeed
from node.run import create_genesis
from node.runtime import Node
from swarm.errors import ValidationError
from swarm.messages import RunParams, sign
from swarm.shardcast.delta import encode_patch
from swarm.shardcast.publish import _hash_shards, _store
from tests.netfactory import NetFactory

SNAPSHOT_EVERY = 5


def versions(tmp: Path, n: int, *, share: float = 0.02) -> list[Path]:
    """``n`` bf16 checkpoints, each changing about ``share`` of the previous one's weights by
    an ulp (what an RL step at a small learning rate does), with NaN, inf and -0.0 in them."""
    rng = np.random.default_rng(0)
    weights = {
        "embed": torch.randn(256, 64, dtype=torch.float32).to(torch.bfloat16),
        "layer.w": torch.randn(64, 64, dtype=torch.float32).to(torch.bfloat16),
        "odd": torch.tensor([float("nan"), float("inf"), -0.0, 1.0], dtype=torch.bfloat16),
    }
    out = []
    for v in range(n):
        if v:
            for name in ("embed", "layer.w"):
                bits = weights[name].view(torch.int16).clone()
                hit = torch.from_numpy(rng.random(bits.shape) < share)
                weights[name] = (bits + hit.to(torch.int16)).view(torch.bfloat16)
        path = tmp / f"v{v}.safetensors"
        save_file(weights, str(path))
        out.append(path)
    return out


def net_with_patches() -> NetFactory:
    net = NetFactory()
    net.genesis = create_genesis(
        net.owner,
        name="test-run",
        trainers=[k.peer_id for k in net.trainer_keys],
        validators=[k.peer_id for k in net.validator_keys],
        params=RunParams(snapshot_every=SNAPSHOT_EVERY),
        created_at=1,
    )
    return net


@asynccontextmanager
async def feed(node: Node, root: Path) -> AsyncIterator[PolicyFeed]:
    f = PolicyFeed(node, root, data_channel=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(f.run)
        yield f
        nursery.cancel_scope.cancel()


async def connect(a: Node, b: Node) -> None:
    assert await a.overlay.connect(b.peer_id, b.overlay.addrs()) is None


async def test_a_late_joiner_catches_up_from_the_snapshot_and_the_patches(tmp_path: Path) -> None:
    files = versions(tmp_path, 8)
    async with net_with_patches() as net:
        trainer = await net.node("trainer", bootstrap=[])
        holder = await net.node("inference", bootstrap=[], connect_found_peers=False)
        joiner = await net.node("inference", bootstrap=[], connect_found_peers=False)
        async with feed(trainer, tmp_path / "trainer") as source:
            # Version 0 is the run's model (the card's weights); the run's own versions follow.
            for v in range(1, 7):
                await source.publish(v, files[v])
            kinds = {v: source.store.manifest(v).message.is_patch for v in range(1, 7)}
            assert kinds == {1: False, 2: True, 3: True, 4: True, 5: False, 6: True}
            await connect(holder, trainer)
            async with feed(holder, tmp_path / "holder") as held:
                with trio.fail_after(60):
                    got = await held.fetch_version(6)
                assert got.read_bytes() == files[6].read_bytes()
                # It fetched the snapshot v5 and v6's patch, not v0..v4.
                assert sorted(held.transfers) == [5, 6]

                # v7, a patch against v6, which the holder holds: only the patch travels.
                await source.publish(7, files[7])
                patch = source.store.manifest(7).message
                assert patch.is_patch and patch.total_size < patch.full_size / 10
                with trio.fail_after(60):
                    got = await held.fetch_version(7)
                assert got.read_bytes() == files[7].read_bytes()
                assert held.transfers[7] == {
                    "bytes": patch.total_size,
                    "full": patch.full_size,
                    "patch": True,
                }

                # A node that joins after 7 versions, connected to the holder only: the
                # holder re-serves the snapshot and the patches.
                await connect(joiner, holder)
                async with feed(joiner, tmp_path / "joiner") as late:
                    with trio.fail_after(60):
                        got = await late.fetch_version(7)
                    assert got.read_bytes() == files[7].read_bytes()
                    view = late.transfer_view()
                    assert sorted(late.transfers) == [5, 6, 7]
                    assert view["bytes"] < 1.5 * files[7].stat().st_size
                    assert view["saved_bytes"] > 0


async def test_a_patch_that_does_not_reconstruct_the_signed_tensors_is_refused(
    tmp_path: Path,
) -> None:
    """The trainer's key signs a patch whose tensor hashes are another version's: its shards
    verify, its reconstruction does not; the node refuses it, deletes it, and counts it."""
    files = versions(tmp_path, 3)
    async with net_with_patches() as net:
        trainer = await net.node("trainer", bootstrap=[])
        worker = await net.node("inference", bootstrap=[], connect_found_peers=False)
        async with feed(trainer, tmp_path / "trainer") as source:
            await source.publish(1, files[0])
            await source.publish(2, files[1])
            good = source.store.manifest(2)
            assert good.message.is_patch
            # A v3 whose patch is v2 -> v3 but whose manifest signs v2's tensors.
            encode_patch(files[1], files[2], tmp_path / "patch")
            size = (tmp_path / "patch").stat().st_size
            staging = source.store.root / ".staging-bad"
            hashes, _ = _hash_shards(
                [tmp_path / "patch"], [size], good.message.shard_size, staging, layout=False
            )
            wrong = dataclasses.replace(
                good.message,
                version=3,
                base=2,
                base_id=good.id,
                files=(dataclasses.replace(good.message.files[0], size=size),),
                shard_hashes=tuple(hashes),
                total_size=size,
            )
            _store(source.store, sign(wrong, trainer.key), staging)
            await connect(worker, trainer)
            async with feed(worker, tmp_path / "worker") as sink:
                with pytest.raises(ValidationError, match="reconstructs to other bytes"):
                    with trio.fail_after(60):
                        await sink.fetch_version(3)
                assert sink.refused_versions == 1
                assert 3 not in sink.store.versions()
                # The chain v1 -> v2 was fetched first; v2 is good and kept (one pass over the
                # chain failed, then one version at a time found the culprit, v3).
                assert sink.path_of(2) is not None


async def test_a_snapshot_whose_tensors_are_not_the_signed_ones_is_refused(
    tmp_path: Path,
) -> None:
    """A whole version whose bytes match their shard hashes but whose manifest signs other
    tensors (patches built on it would be checked against those) is refused and deleted."""
    files = versions(tmp_path, 2)
    async with net_with_patches() as net:
        trainer = await net.node("trainer", bootstrap=[])
        worker = await net.node("inference", bootstrap=[], connect_found_peers=False)
        async with feed(trainer, tmp_path / "trainer") as source:
            good = (await source.publish(1, files[0])).message
            size = files[1].stat().st_size
            staging = source.store.root / ".staging-bad"
            hashes, _ = _hash_shards([files[1]], [size], good.shard_size, staging, layout=False)
            wrong = dataclasses.replace(
                good,
                version=5,
                files=(dataclasses.replace(good.files[0], size=size),),
                shard_hashes=tuple(hashes),
                total_size=size,
                weights_size=size,
            )
            _store(source.store, sign(wrong, trainer.key), staging)
            await connect(worker, trainer)
            async with feed(worker, tmp_path / "worker") as sink:
                with pytest.raises(ValidationError, match="not the tensors its manifest signs"):
                    with trio.fail_after(60):
                        await sink.fetch_version(5)
                assert sink.refused_versions == 1
                assert 5 not in sink.store.versions()
