"""Getting and checking a version's manifest, before any shard is asked for.

A manifest counts only if its envelope verifies, its signer is one of the genesis trainers, it is
for this run, and (when one was asked for) it is the requested version. ``fetch_manifest`` asks
providers in turn and keeps the newest valid one.

The manifest is signed, so any holder can serve it: for a given version the peers that are not
its origins (trainers) are asked first, all at once (a peer that is fetching the version holds
its manifest from the start), and the origins only when none of them has a valid one within
``hedge`` seconds. At an announcement every node wants the manifest at once; asking the trainer
first made it answer N requests next to its serving, and at N >= 50 loopback nodes many timed
out (docs/BENCHMARKS.md, Scale). Better still, a small manifest rides in the announcement itself
(``inline_manifest``, ``announced_manifest``), and then nobody asks for it at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from swarm.errors import NotAuthorizedError, PeerError, SwarmError, ValidationError
from swarm.messages import (
    PolicyAnnouncement,
    RunGenesis,
    ShardManifest,
    Signed,
    decode,
    run_id_of,
)
from swarm.messages.membership import INLINE_MANIFEST_MAX
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


def inline_manifest(manifest: Signed[ShardManifest]) -> bytes:
    """What an announcement of ``manifest``'s version carries: the signed manifest when it is
    at most ``INLINE_MANIFEST_MAX`` bytes, else nothing (receivers ask peers for it)."""
    return manifest.raw if len(manifest.raw) <= INLINE_MANIFEST_MAX else b""


def announced_manifest(
    announcement: Signed[PolicyAnnouncement], genesis: Signed[RunGenesis]
) -> Signed[ShardManifest] | None:
    """The manifest an announcement carries, checked as one fetched from a peer would be
    (``verify_manifest``; its id is the announced one by construction); ``None`` when it
    carries none. ``SwarmError`` for one that does not verify."""
    raw = announcement.message.manifest
    if not raw:
        return None
    return verify_manifest(raw, genesis, announcement.message.version)


async def fetch_manifest(
    source: ShardSource,
    peers: Sequence[str],
    genesis: Signed[RunGenesis],
    version: int | None = None,
    *,
    origins: Sequence[str] = (),
    hedge: float = 2.0,
) -> Signed[ShardManifest]:
    """The newest (or the given) version's manifest from the first peer with a valid one.

    With ``version=None`` every peer is asked and the highest valid version wins. With a
    version, the ``peers`` that are not ``origins`` are asked first, at once; the origins
    among ``peers`` after ``hedge`` seconds, or as soon as all the others failed.
    """
    errors: list[str] = []
    if version is not None:
        others = [p for p in peers if p not in origins]
        if others:
            found = await _first_valid(source, others, genesis, version, hedge, errors)
            if found is not None:
                return found
        peers = [p for p in peers if p in origins]
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


async def _first_valid(
    source: ShardSource,
    peers: Sequence[str],
    genesis: Signed[RunGenesis],
    version: int,
    within: float,
    errors: list[str],
) -> Signed[ShardManifest] | None:
    """Ask every one of ``peers`` at once; the first valid manifest, or ``None`` when all
    failed (their errors appended to ``errors``) or ``within`` seconds passed."""
    found: list[Signed[ShardManifest]] = []

    async def ask(peer: str, scope: trio.CancelScope) -> None:
        try:
            found.append(verify_manifest(await source.manifest(peer, version), genesis, version))
            scope.cancel()
        except SwarmError as exc:
            errors.append(f"{peer}: {exc}")

    with trio.move_on_after(within):
        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(ask, peer, nursery.cancel_scope)
    return found[0] if found else None
