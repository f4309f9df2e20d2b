"""The weights an audit replays on are the versions the trainer signed, tensor for tensor.

A replay on the wrong weights could clear a cheater or condemn an honest worker, so before any
replay uses a version's file, ``checked_source`` compares the sha256 of every tensor in it with
the ``tensors`` of the version's signed manifest (``ShardManifest.tensors``, which every version
published since issue 25 carries; a patch's reconstruction was checked against the same list
when it was fetched). A file that differs raises ``ValidationError`` naming the first tensor:
the replay row fails instead of agreeing. A version with no manifest known, or a manifest from
before tensor hashes, is used as before and said so in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from swarm.errors import SwarmError, ValidationError
from swarm.messages import ShardManifest
from swarm.shardcast import ShardStore
from swarm.shardcast.delta import hash_tensors

log = logging.getLogger(__name__)

PolicySource = Callable[[int], Path | None]
ManifestLookup = Callable[[int], ShardManifest | None]


def store_manifests(root: Path) -> ManifestLookup:
    """Manifests from the shard store at ``root`` (a trainer's, or an audit's gathered one)."""
    store = ShardStore(root, keep=1 << 30) if root.is_dir() else None

    def find(version: int) -> ShardManifest | None:
        if store is None:
            return None
        try:
            return store.manifest(version).message
        except SwarmError:
            return None

    return find


def tensor_mismatch(path: Path, manifest: ShardManifest) -> str | None:
    """Why the weights at ``path`` (a file, or a directory of a sharded version's files) are
    not ``manifest``'s version (None when every tensor matches)."""
    if path.is_dir():
        got: dict[str, bytes] = {}
        for f in manifest.files:
            got.update(hash_tensors(path / f.path))
    else:
        got = dict(hash_tensors(path))
    want = dict(manifest.tensors)
    for name, digest in want.items():
        if name not in got:
            return f"has no tensor {name[:80]!r}"
        if got[name] != digest:
            return f"tensor {name[:80]!r} differs from the signed manifest (sha256)"
    extra = sorted(set(got) - set(want))
    return f"holds tensor {extra[0][:80]!r}, which the manifest does not sign" if extra else None


def checked_source(source: PolicySource, manifests: ManifestLookup) -> PolicySource:
    """``source``, each version's file checked once against its manifest's tensor hashes."""
    checked: dict[int, Path] = {}

    def find(version: int) -> Path | None:
        if version in checked:
            return checked[version]
        path = source(version)
        if path is None:
            return None
        manifest = manifests(version)
        if manifest is None or not manifest.tensors:
            log.info("policy v%d: no tensor hashes known; replaying on %s unchecked", version, path)
        else:
            why = tensor_mismatch(path, manifest)
            if why is not None:
                raise ValidationError(
                    f"the weights of policy v{version} at {path} are not the version the trainer"
                    f" signed: {why}"
                )
        checked[version] = path
        return path

    return find
