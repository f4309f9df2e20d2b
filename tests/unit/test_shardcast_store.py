"""The shard store: journal survives reopening, retention, disk budget, disk full."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from swarm.errors import NotAuthorizedError, StorageError
from swarm.messages import ShardFile, ShardManifest, sign
from swarm.shardcast import ShardStore
from tests.shardcast_util import TRAINER


def manifest(version: int, total: int = 1000, shard: int = 100):
    m = ShardManifest(
        run_id="0" * 32,
        version=version,
        files=(ShardFile("model.safetensors", 0, total),),
        shard_size=shard,
        shard_hashes=tuple(bytes(32) for _ in range(-(-total // shard))),
        total_size=total,
        created_at=0,
    )
    return sign(m, TRAINER)


def test_verified_shards_survive_reopening(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    with store.open(manifest(1)) as vf:
        vf.preallocate()
        vf.write_at(200, b"x" * 100)
        vf.mark_verified(2)
        vf.mark_verified(5)
    with store.open(manifest(1)) as vf:
        assert vf.verified_indices() == [2, 5]
        assert os.fstat(vf.data_fd).st_size == 1000
        assert vf.read_at(200, 100) == b"x" * 100


def test_complete_is_refused_while_shards_are_missing(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    with store.open(manifest(1)) as vf:
        vf.mark_verified(0)
        with pytest.raises(StorageError, match="9 unverified shards"):
            vf.mark_complete()
    assert not store.is_complete(1)


def test_a_different_manifest_for_a_stored_version_is_refused(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    store.open(manifest(1)).close()
    with pytest.raises(StorageError, match="different manifest"):
        store.open(manifest(1, total=900))


def test_retention_keeps_newest_versions_and_pinned(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, keep=2)
    for v in (1, 2, 3):
        store.open(manifest(v)).close()
    store.pin(1)
    store.open(manifest(4)).close()
    removed = store.prune()
    assert removed == [2]
    assert store.versions() == [1, 3, 4]


def test_pinning_an_unknown_version_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="not in the shard store"):
        ShardStore(tmp_path).pin(7)


def test_disk_budget_refuses_with_the_amount_and_place(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, keep=3, max_disk=2500)
    store.open(manifest(1)).close()
    store.open(manifest(2)).close()
    with pytest.raises(StorageError) as info:
        store.check_room(manifest(3).message)
    text = str(info.value)
    assert "version 3 needs" in text and str(tmp_path) in text and "--max-disk" in text


def test_disk_budget_counts_versions_retention_will_drop_as_free(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, keep=2, max_disk=2500)
    store.open(manifest(1)).close()
    store.open(manifest(2)).close()
    store.check_room(manifest(3).message)  # version 1 goes, 2 and 3 fit


def test_disk_full_on_preallocation_is_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    store = ShardStore(tmp_path)
    with store.open(manifest(1)) as vf, pytest.raises(StorageError, match="disk full"):
        vf.preallocate()
    assert not store.is_complete(1)


def test_store_refuses_nonsense_settings(tmp_path: Path) -> None:
    from swarm.errors import ConfigError

    with pytest.raises(ConfigError):
        ShardStore(tmp_path, keep=0)
    with pytest.raises(ConfigError):
        ShardStore(tmp_path, max_disk=0)
    assert not issubclass(NotAuthorizedError, StorageError)
