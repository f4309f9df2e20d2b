"""Getting and checking a version's manifest, before any shard is asked for.

A manifest counts only if its envelope verifies, its signer is one of the genesis trainers, it is
for this run, and (when one was asked for) it is the requested version. ``fetch_manifest`` asks
providers in turn and keeps the newest valid one.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm.errors import NotAuthorizedError, PeerError, SwarmError, ValidationError
from swarm.messages import RunGenesis, ShardManifest, Signed, decode, run_id_of
from swarm.shardcast.source import ShardSource


def verify_manifest(
    raw: bytes, genesis: Signed[RunGenesis], version: int | None = None
) -> Signed[ShardManifest]:
    """Decode and check a manifest: signature, signer is a genesis trainer, run, version."""
    signed = decode(raw, ShardManifest)
    run_id = run_id_of(genesis)
    if signed.signer not in genesis.message.trainers:
        raise NotAuthorizedError(
            f"manifest of version {signed.message.version} is signed by {signed.signer},"
            f" who is not a trainer of run {run_id}"
        )
    if signed.message.run_id != run_id:
        raise ValidationError(
            f"manifest is for run {signed.message.run_id[:40]!r}, not this run {run_id}"
        )
    if version is not None and signed.message.version != version:
        raise ValidationError(
            f"asked for version {version}, the peer sent version {signed.message.version}"
        )
    return signed


async def fetch_manifest(
    source: ShardSource,
    peers: Sequence[str],
    genesis: Signed[RunGenesis],
    version: int | None = None,
) -> Signed[ShardManifest]:
    """The newest (or the given) version's manifest from the first peer with a valid one.

    With ``version=None`` every peer is asked and the highest valid version wins.
    """
    errors: list[str] = []
    best: Signed[ShardManifest] | None = None
    for peer in peers:
        try:
            signed = verify_manifest(await source.manifest(peer, version), genesis, version)
        except SwarmError as exc:
            errors.append(f"{peer}: {exc}")
            continue
        if best is None or signed.message.version > best.message.version:
            best = signed
        if version is not None:
            break
    if best is None:
        what = f"version {version}" if version is not None else "any version"
        raise PeerError(
            f"no provider gave a valid manifest of {what}: " + ("; ".join(errors) or "no peers")
        )
    return best
