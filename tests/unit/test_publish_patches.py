"""How a version travels (``publish_version``): whole every ``snapshot_every`` versions, as a
patch in between, whole when the patch is dense or the patches since the snapshot would outgrow
a full version; retention keeps the chain a joiner needs and drops what only it needs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from node.run import create_genesis
from swarm.messages import RunGenesis, RunParams, Signed
from swarm.shardcast import ShardStore, publish_version
from tests.shardcast_util import OWNER, TRAINER, key


def run(**params: object) -> Signed[RunGenesis]:
    return create_genesis(
        OWNER,
        name="patches",
        trainers=[TRAINER.peer_id],
        validators=[key("validator").peer_id],
        params=RunParams(**params),  # type: ignore[arg-type]
        created_at=1,
    )


def checkpoints(tmp: Path, n: int, *, every: int = 50) -> list[Path]:
    """``n`` versions of one bf16-like tensor, each changing one weight in ``every``."""
    w = np.random.default_rng(0).integers(0, 2**16, 20_000, dtype=np.uint16)
    out = []
    for v in range(n):
        w = w.copy()
        w[v % every :: every] += 1
        path = tmp / f"v{v}.safetensors"
        save_file({"w": w}, str(path))
        out.append(path)
    return out


def kinds(store: ShardStore) -> dict[int, str]:
    return {v: "patch" if store.manifest(v).message.is_patch else "full" for v in store.versions()}


def test_snapshots_every_k_versions_and_patches_between(tmp_path: Path) -> None:
    g = run(snapshot_every=3)
    store = ShardStore(tmp_path / "store", keep=100)
    for v, path in enumerate(checkpoints(tmp_path, 7)):
        publish_version(path, key=TRAINER, genesis=g, version=v, store=store)
        assert store.weights_path(v) is not None
        assert store.weights_path(v).read_bytes() == path.read_bytes()  # type: ignore[union-attr]
    assert kinds(store) == {
        0: "full",
        1: "patch",
        2: "patch",
        3: "full",
        4: "patch",
        5: "patch",
        6: "full",
    }
    patch = store.manifest(4).message
    assert patch.base == 3 and patch.base_id == store.manifest(3).id
    assert patch.total_size < patch.full_size / 5


def test_a_dense_update_travels_whole(tmp_path: Path) -> None:
    g = run(snapshot_every=10, patch_max_share=0.5)
    store = ShardStore(tmp_path / "store", keep=10)
    rng = np.random.default_rng(0)
    for v in range(2):
        path = tmp_path / f"v{v}.safetensors"
        save_file({"w": rng.integers(0, 2**16, 20_000, dtype=np.uint16)}, str(path))
        publish_version(path, key=TRAINER, genesis=g, version=v, store=store)
    assert kinds(store) == {0: "full", 1: "full"}


def test_a_snapshot_comes_early_when_the_patches_would_outgrow_a_version(tmp_path: Path) -> None:
    """Each patch is under ``patch_max_share`` but together they pass a full version: then the
    next version is a snapshot, so a joiner never fetches more than about two versions."""
    g = run(snapshot_every=100, patch_max_share=0.9)
    store = ShardStore(tmp_path / "store", keep=100)
    for v, path in enumerate(checkpoints(tmp_path, 12, every=2)):
        publish_version(path, key=TRAINER, genesis=g, version=v, store=store)
    got = kinds(store)
    assert "full" in [got[v] for v in range(1, 12)]
    since = 0
    for v in range(12):
        m = store.manifest(v).message
        since = since + m.total_size if m.is_patch else 0
        assert since <= m.full_size


def test_retention_keeps_the_chain_from_the_snapshot_and_drops_its_reconstructions(
    tmp_path: Path,
) -> None:
    g = run(snapshot_every=5)
    store = ShardStore(tmp_path / "store", keep=2)
    for v, path in enumerate(checkpoints(tmp_path, 9)):
        publish_version(path, key=TRAINER, genesis=g, version=v, store=store)
    # Newest two are 7 and 8; the chain a joiner needs starts at the snapshot v5.
    assert store.versions() == [5, 6, 7, 8]
    assert store.weights_path(6) is None  # kept for the chain: the patch, not its weights
    assert (store.directory(6) / "data").exists()
    assert store.weights_path(5) is not None  # a snapshot's bytes are its weights
    assert store.weights_path(8) is not None
