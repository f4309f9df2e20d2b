"""Publishing: per-shard hashes, trainer-only, safetensors only, stored complete."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from swarm.errors import ConfigError, NotAuthorizedError
from swarm.messages import ShardManifest, decode, run_id_of
from swarm.shardcast import ShardStore, cut, publish
from tests.shardcast_util import MALLORY, TRAINER, checkpoint, genesis


def test_manifest_hashes_every_shard(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "c.safetensors", 100_000)
    data = path.read_bytes()
    m = cut(path, run_id="a" * 32, version=3, shard_size=8192)
    assert m.total_size == len(data)
    assert len(m.shard_hashes) == -(-len(data) // 8192)
    for i, h in enumerate(m.shard_hashes):
        assert h == hashlib.sha256(data[i * 8192 : (i + 1) * 8192]).digest()
    assert m.files[0].path == "c.safetensors"


def test_publish_stores_a_complete_signed_version(tmp_path: Path) -> None:
    g = genesis()
    path = checkpoint(tmp_path / "c.safetensors", 50_000)
    store = ShardStore(tmp_path / "store")
    signed = publish(path, key=TRAINER, genesis=g, version=1, store=store, shard_size=4096)
    assert store.is_complete(1)
    assert (store.directory(1) / "data").read_bytes() == path.read_bytes()
    again = decode(store.manifest(1).raw, ShardManifest)
    assert again.signer == TRAINER.peer_id and again.message.run_id == run_id_of(g)
    assert signed.message.shard_size == 4096


def test_publish_refuses_a_key_that_is_not_a_trainer(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "c.safetensors", 10_000)
    store = ShardStore(tmp_path / "store")
    with pytest.raises(NotAuthorizedError, match="not a trainer"):
        publish(path, key=MALLORY, genesis=genesis(), version=1, store=store)
    assert store.versions() == []


@pytest.mark.parametrize("content", [b"", b"short", b"\xff" * 8 + b"{}", b"\x02\0\0\0\0\0\0\0[]"])
def test_publish_refuses_a_file_that_is_not_safetensors(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="not a safetensors file"):
        publish(path, key=TRAINER, genesis=genesis(), version=1, store=ShardStore(tmp_path / "s"))


def test_publish_keeps_only_the_newest_versions(tmp_path: Path) -> None:
    g = genesis(async_level=1)
    store = ShardStore(tmp_path / "store", keep=g.message.params.async_level + 1)
    for v in range(1, 5):
        path = checkpoint(tmp_path / f"c{v}.safetensors", 5_000, seed=v)
        publish(path, key=TRAINER, genesis=g, version=v, store=store, shard_size=1024)
    assert store.versions() == [3, 4]
