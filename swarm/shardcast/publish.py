"""Publishing a policy version: cut a safetensors checkpoint into shards and sign the manifest.

Only a genesis trainer may publish. The checkpoint (one file, or the files of a sharded
checkpoint, laid end to end) is read once, in 1 MiB blocks, hashing each shard and each tensor
on the way (never the whole file in memory), copied into the shard store at the same time, and
marked complete; the caller then serves it and announces it.

``publish_version`` decides how a version travels (docs/shardcast.md): whole every
``snapshot_every`` versions, as a patch against its parent (``swarm.shardcast.delta``) in
between, and whole again when the patch is dense (above ``patch_max_share`` of the full size)
or when the patches since the last snapshot would add up to more than a full version (so a
joiner never fetches more than twice a version's size to catch up).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path

from swarm.errors import ConfigError, NotAuthorizedError, SwarmError
from swarm.identity import NodeKey
from swarm.messages import RunGenesis, ShardFile, ShardManifest, Signed, run_id_of, sign
from swarm.shardcast.delta import Tensor, TensorHasher, encode_patch, header_sha256, tensor_layout
from swarm.shardcast.store import ShardStore, _os_error

DEFAULT_SHARD_SIZE = 32 * 1024 * 1024
_BLOCK = 1024 * 1024
_MAX_HEADER = 100 * 1024 * 1024


def check_safetensors(path: Path) -> int:
    """Check that ``path`` looks like a safetensors file; returns its size.

    Reads only the header (8-byte little-endian length, then JSON), so a wrong file is refused
    with a ``ConfigError`` before anything is cut or signed.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"{path} is not a safetensors file (only {size} bytes)")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise ConfigError(f"{path} is not a safetensors file (header length {length})")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise ConfigError(f"cannot read checkpoint {path}: {exc.strerror}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not a safetensors file (header is not JSON)") from exc
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a safetensors file (header is not a map)")
    return size


def cut(
    path: Path | Sequence[Path],
    *,
    run_id: str,
    version: int,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> ShardManifest:
    """The (unsigned) manifest of ``path`` (one file or several) as version ``version``."""
    if shard_size < 1:
        raise ConfigError("shard size must be positive")
    paths = _paths(path)
    sizes = [check_safetensors(p) for p in paths]
    hashes, tensors = _hash_shards(paths, sizes, shard_size, None)
    return _manifest(paths, sizes, run_id, version, shard_size, hashes, tensors)


def publish(
    path: Path | Sequence[Path],
    *,
    key: NodeKey,
    genesis: Signed[RunGenesis],
    version: int,
    store: ShardStore,
    shard_size: int | None = None,
) -> Signed[ShardManifest]:
    """Cut, sign and store ``path`` (one safetensors file, or the files of a sharded
    checkpoint in order) whole as policy ``version``; returns the signed manifest.

    Raises ``NotAuthorizedError`` for a key that is not a genesis trainer (before reading the
    file), ``ConfigError`` for a file that is not safetensors, ``StorageError`` when the store
    cannot hold it.
    """
    _check_trainer(key, genesis)
    shard_size = shard_size or genesis.message.params.shard_size or DEFAULT_SHARD_SIZE
    paths = _paths(path)
    sizes = [check_safetensors(p) for p in paths]
    # Hash and copy in one pass: the bytes hashed are exactly the bytes stored.
    staging = store.root / f".publish-{version}-{os.getpid()}"
    try:
        hashes, tensors = _hash_shards(paths, sizes, shard_size, staging)
        manifest = _manifest(paths, sizes, run_id_of(genesis), version, shard_size, hashes, tensors)
        signed = _store(store, sign(manifest, key), staging)
    except OSError as exc:
        raise _os_error("storing the published version", store.root, exc, sum(sizes)) from exc
    finally:
        staging.unlink(missing_ok=True)
    store.prune(keep_also=version)
    return signed


def publish_version(
    path: Path | Sequence[Path],
    *,
    key: NodeKey,
    genesis: Signed[RunGenesis],
    version: int,
    store: ShardStore,
) -> Signed[ShardManifest]:
    """Publish ``path`` as ``version``: a single safetensors file as a patch against the held
    ``version - 1`` where the run's rules say so and the patch is worth it, else whole (and
    several files, a sharded checkpoint, always whole)."""
    _check_trainer(key, genesis)
    params = genesis.message.params
    base = version - 1
    held = store.weights_bytes(base) if version % params.snapshot_every else None
    if held is None or not isinstance(path, Path):
        return publish(path, key=key, genesis=genesis, version=version, store=store)
    since = _patch_bytes_since_snapshot(store, base)
    full = check_safetensors(path)
    patch = store.root / f".patch-{version}-{os.getpid()}"
    try:
        base_path, spans = held
        stats = encode_patch(base_path, path, patch, base_files=spans)
        if stats.patch_bytes > params.patch_max_share * full or since + stats.patch_bytes > full:
            return publish(path, key=key, genesis=genesis, version=version, store=store)
        tensors = stats.tensors  # hashed as the patch read the file
        shard_size = params.shard_size or DEFAULT_SHARD_SIZE
        staging = store.root / f".publish-{version}-{os.getpid()}"
        try:
            size = patch.stat().st_size
            hashes, _ = _hash_shards([patch], [size], shard_size, staging, layout=False)
            manifest = ShardManifest(
                run_id=run_id_of(genesis),
                version=version,
                files=(ShardFile(path="patch", offset=0, size=size),),
                shard_size=shard_size,
                shard_hashes=tuple(hashes),
                total_size=size,
                created_at=int(time.time() * 1000),
                base=base,
                base_id=store.manifest(base).id,
                tensors=tensors,
                header_sha256=header_sha256(path),
                weights_size=full,
            )
            signed = sign(manifest, key)
            weights = store.root / f".weights-{version}-{os.getpid()}"
            _copy(path, weights)
            signed = _store(store, signed, staging, weights=weights)
        except OSError as exc:
            raise _os_error("storing the published patch", store.root, exc, full) from exc
        finally:
            staging.unlink(missing_ok=True)
    finally:
        patch.unlink(missing_ok=True)
    store.prune(keep_also=version)
    return signed


def _check_trainer(key: NodeKey, genesis: Signed[RunGenesis]) -> None:
    if key.peer_id not in genesis.message.trainers:
        raise NotAuthorizedError(
            f"this node ({key.peer_id}) is not a trainer of run {run_id_of(genesis)};"
            " only the genesis trainers may publish policy versions"
        )


def _paths(path: Path | Sequence[Path]) -> list[Path]:
    paths = [path] if isinstance(path, Path) else list(path)
    if not paths:
        raise ConfigError("nothing to publish: no weights file given")
    if len({p.name for p in paths}) != len(paths):
        raise ConfigError("the files of a version must have distinct names")
    return paths


def _store(
    store: ShardStore, signed: Signed[ShardManifest], staging: Path, weights: Path | None = None
) -> Signed[ShardManifest]:
    """Move the staged bytes (and a patch's reconstructed ``weights``) into the store and
    mark every shard verified and the version complete."""
    store.check_room(signed.message)
    with store.open(signed) as vf:
        os.replace(staging, vf.directory / "data")
        if weights is not None:
            os.replace(weights, vf.directory / "weights")
    with store.open(signed) as vf:
        for i in range(len(signed.message.shard_hashes)):
            vf.mark_verified(i, durable=False)
        vf.mark_complete()
    return signed


def _patch_bytes_since_snapshot(store: ShardStore, newest: int) -> int:
    """Bytes of the patches from the newest snapshot up to ``newest``."""
    total = 0
    for v in range(newest, -1, -1):
        try:
            manifest = store.manifest(v).message
        except SwarmError:
            return total
        if not manifest.is_patch:
            return total
        total += manifest.total_size
    return total


def _copy(source: Path, target: Path) -> None:
    """``target`` as a copy of ``source``, made in the kernel (``copy_file_range``)."""
    with open(source, "rb") as src, open(target, "wb") as dst:
        left = os.fstat(src.fileno()).st_size
        while left > 0:
            n = os.copy_file_range(src.fileno(), dst.fileno(), left)
            if n == 0:
                raise ConfigError(f"{source} shrank while it was being published")
            left -= n
        os.fsync(dst.fileno())


def _manifest(
    paths: list[Path],
    sizes: list[int],
    run_id: str,
    version: int,
    shard_size: int,
    hashes: list[bytes],
    tensors: tuple[tuple[str, bytes], ...],
) -> ShardManifest:
    files, offset = [], 0
    for p, size in zip(paths, sizes, strict=True):
        files.append(ShardFile(path=p.name, offset=offset, size=size))
        offset += size
    return ShardManifest(
        run_id=run_id,
        version=version,
        files=tuple(files),
        shard_size=shard_size,
        shard_hashes=tuple(hashes),
        total_size=offset,
        created_at=int(time.time() * 1000),
        tensors=tensors,
        weights_size=offset,
    )


def _hash_shards(
    paths: list[Path],
    sizes: list[int],
    shard_size: int,
    copy_to: Path | None,
    *,
    layout: bool = True,
) -> tuple[list[bytes], tuple[tuple[str, bytes], ...]]:
    """The sha256 of every shard of ``paths`` laid end to end and (``layout``) of every
    tensor, in one read; the bytes are copied to ``copy_to`` on the way."""
    tensors = []
    offset = 0
    for p, size in zip(paths, sizes, strict=True):
        if layout:
            tensors += [_shifted(t, offset) for t in tensor_layout(p)]
        offset += size
    hasher = TensorHasher(tensors)
    hashes: list[bytes] = []
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    out = None
    h = hashlib.sha256()
    in_shard = 0
    at = 0
    try:
        if copy_to is not None:
            out = os.open(copy_to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for path, size in zip(paths, sizes, strict=True):
            with open(path, "rb", buffering=0) as f:
                remaining = size
                while remaining > 0:
                    want = min(_BLOCK, remaining, shard_size - in_shard)
                    n = f.readinto(view[:want])
                    if not n:
                        raise ConfigError(f"{path} shrank while it was being published")
                    h.update(view[:n])
                    hasher.update(at, view[:n])
                    if out is not None:
                        written = 0
                        while written < n:
                            written += os.write(out, view[written:n])
                    remaining -= n
                    in_shard += n
                    at += n
                    if in_shard == shard_size:
                        hashes.append(h.digest())
                        h, in_shard = hashlib.sha256(), 0
        if in_shard:
            hashes.append(h.digest())
        if out is not None:
            os.fsync(out)
    finally:
        if out is not None:
            os.close(out)
    return hashes, hasher.digests() if layout else ()


def _shifted(t: Tensor, offset: int) -> Tensor:
    return Tensor(t.name, t.dtype, t.shape, t.start + offset, t.end + offset)
