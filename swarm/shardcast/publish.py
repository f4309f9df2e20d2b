"""Publishing a policy version: cut a safetensors checkpoint into shards and sign the manifest.

Only a genesis trainer may publish. The checkpoint is read once, in 1 MiB blocks, hashing each
shard on the way (never the whole file in memory), copied into the shard store at the same
time, and marked complete; the caller then serves it and announces it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path

from swarm.errors import ConfigError, NotAuthorizedError
from swarm.identity import NodeKey
from swarm.messages import RunGenesis, ShardFile, ShardManifest, Signed, run_id_of, sign
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
    path: Path, *, run_id: str, version: int, shard_size: int = DEFAULT_SHARD_SIZE
) -> ShardManifest:
    """The (unsigned) manifest of ``path`` as version ``version`` of run ``run_id``."""
    if shard_size < 1:
        raise ConfigError("shard size must be positive")
    size = check_safetensors(path)
    hashes = _hash_shards(path, size, shard_size, None)
    return _manifest(path, run_id, version, shard_size, size, hashes)


def publish(
    path: Path,
    *,
    key: NodeKey,
    genesis: Signed[RunGenesis],
    version: int,
    store: ShardStore,
    shard_size: int | None = None,
) -> Signed[ShardManifest]:
    """Cut, sign and store ``path`` as policy ``version``; returns the signed manifest.

    Raises ``NotAuthorizedError`` for a key that is not a genesis trainer (before reading the
    file), ``ConfigError`` for a file that is not safetensors, ``StorageError`` when the store
    cannot hold it.
    """
    if key.peer_id not in genesis.message.trainers:
        raise NotAuthorizedError(
            f"this node ({key.peer_id}) is not a trainer of run {run_id_of(genesis)};"
            " only the genesis trainers may publish policy versions"
        )
    shard_size = shard_size or genesis.message.params.shard_size or DEFAULT_SHARD_SIZE
    size = check_safetensors(path)
    # Hash and copy in one pass: the bytes hashed are exactly the bytes stored.
    staging = store.root / f".publish-{version}-{os.getpid()}"
    try:
        hashes = _hash_shards(path, size, shard_size, staging)
        manifest = _manifest(path, run_id_of(genesis), version, shard_size, size, hashes)
        signed = sign(manifest, key)
        store.check_room(manifest)
        with store.open(signed) as vf:
            os.replace(staging, vf.directory / "data")
        with store.open(signed) as vf:
            for i in range(len(hashes)):
                vf.mark_verified(i, durable=False)
            vf.mark_complete()
    except OSError as exc:
        raise _os_error("storing the published version", store.root, exc, size) from exc
    finally:
        staging.unlink(missing_ok=True)
    store.prune(keep_also=version)
    return signed


def _manifest(
    path: Path, run_id: str, version: int, shard_size: int, size: int, hashes: list[bytes]
) -> ShardManifest:
    return ShardManifest(
        run_id=run_id,
        version=version,
        files=(ShardFile(path=path.name, offset=0, size=size),),
        shard_size=shard_size,
        shard_hashes=tuple(hashes),
        total_size=size,
        created_at=int(time.time() * 1000),
    )


def _hash_shards(path: Path, size: int, shard_size: int, copy_to: Path | None) -> list[bytes]:
    hashes: list[bytes] = []
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    out = None
    try:
        if copy_to is not None:
            out = os.open(copy_to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with open(path, "rb", buffering=0) as f:
            remaining = size
            while remaining > 0:
                h = hashlib.sha256()
                left = min(shard_size, remaining)
                while left > 0:
                    n = f.readinto(view[: min(_BLOCK, left)])
                    if not n:
                        raise ConfigError(f"{path} shrank while it was being published")
                    h.update(view[:n])
                    if out is not None:
                        written = 0
                        while written < n:
                            written += os.write(out, view[written:n])
                    left -= n
                    remaining -= n
                hashes.append(h.digest())
        if out is not None:
            os.fsync(out)
    finally:
        if out is not None:
            os.close(out)
    return hashes
