"""A policy version's weights from SHARDCAST, whole or as a patch on the chain before it.

``VersionChain`` owns what happens between "this version is announced" and "this file loads":

- a patch (``ShardManifest.base``; docs/shardcast.md) needs its base: ``weights`` walks the
  manifests back to a version whose weights are held, or to a snapshot, which it asks ``base``
  for (the caller's own fetch, so its locks and checks apply; by default itself);
- every patch of that chain is fetched like any version's bytes (``ShardcastService.fetch``);
- ``finish_chain`` makes the newest loadable: a chain of patches that compose is applied in one
  pass and writes one file (``swarm.shardcast.delta.apply_patches``; catching up on ten versions
  of a 1.2 GB model one version at a time wrote ten files, 55 s on loopback, docs/BENCHMARKS.md),
  else each version in turn (``finish``); the result is checked tensor by tensor against the
  newest manifest, and one that reconstructs other bytes is refused, deleted and counted
  (``refused_versions``); a sharded version is split into its files (``swarm.shardcast.split``);
  the versions between stay patches (served to others), reconstructed only when asked for;
- ``transfers`` keeps, per version, the bytes that travelled against the version's full size
  (``view``: for ``status``, the dashboard and ``summary.json``).

The policy feed (every role) and the audit's gathering both use it.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from node.shardcast import ShardcastService
from swarm.errors import ConfigError, SwarmError, ValidationError
from swarm.messages import ShardManifest, Signed
from swarm.shardcast import FetchConfig, ShardStore
from swarm.shardcast.delta import PatchError, apply_patches, composable, hash_tensors
from swarm.shardcast.fetch import ProgressCallback
from swarm.shardcast.split import split_files

log = logging.getLogger(__name__)

KEEP_TRANSFERS = 64
"""Versions whose transfer figures are kept (the newest)."""


class VersionChain:
    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.transfers: dict[int, dict[str, int | bool]] = {}
        """Per version: ``bytes`` that travelled (fetched here, or published), ``full`` (the
        version's weights), ``patch`` (whether it travelled as a patch)."""
        self.refused_versions = 0
        self.totals: dict[str, float] = {
            "fetched_versions": 0,
            "fetched_bytes": 0,
            "fetch_seconds": 0.0,
            "published_versions": 0,
            "published_bytes": 0,
        }
        """Since the node started (the metrics' counters; ``transfers`` keeps the last few)."""

    async def weights(
        self,
        service: ShardcastService,
        version: int,
        *,
        manifest: Signed[ShardManifest] | None = None,
        config: FetchConfig | None = None,
        on_progress: ProgressCallback | None = None,
        base: Callable[[int, ProgressCallback | None], Awaitable[Path]] | None = None,
        only: Sequence[str] = (),
    ) -> Path:
        """What loads ``version`` (``ShardStore.weights_path``), fetched when not held
        (``only``: from these peers and no others, ``shardcast fetch --from``)."""
        held = self.store.weights_path(version)
        if held is not None:
            return held
        if manifest is None or manifest.message.version != version:
            manifest = await service.manifest(version, only)

        async def own_base(v: int, progress: ProgressCallback | None) -> Path:
            return await self.weights(service, v, config=config, on_progress=progress, only=only)

        fetch_base = base or own_base
        chain = [manifest]  # newest first: the patches back to held weights or a snapshot
        while chain[-1].message.is_patch:
            older = chain[-1].message.base
            assert older is not None
            if self.store.weights_bytes(older) is not None:
                break
            signed = await service.manifest(older, only)
            if not signed.message.is_patch:
                log.info("policy v%d: fetching the snapshot v%d it patches first", version, older)
                # Whole, through the caller's fetch (locks, v0 check); its progress is ours.
                await fetch_base(older, on_progress)
                break
            chain.append(signed)
        for signed in reversed(chain):
            fetched = await self._fetch_bytes(service, signed, config, on_progress, only)
            if fetched and not signed.message.is_patch:
                await trio.to_thread.run_sync(self.check_whole, signed.message)
        versions = [signed.message.version for signed in reversed(chain)]
        await trio.to_thread.run_sync(self.finish_chain, versions)
        local = self.store.weights_path(version)
        if local is None:
            raise ValidationError(f"policy v{version} is not complete after its fetch")
        return local

    async def _fetch_bytes(
        self,
        service: ShardcastService,
        manifest: Signed[ShardManifest],
        config: FetchConfig | None,
        on_progress: ProgressCallback | None,
        only: Sequence[str] = (),
    ) -> bool:
        """The version's own bytes (a patch's, or the whole version's), counted; False when
        they were complete here already."""
        version = manifest.message.version
        if self.store.is_complete(version):
            return False
        result = await service.fetch(
            version, config=config, on_progress=on_progress, manifest=manifest, only=only
        )
        moved = result.progress.fetched_bytes
        log.info(
            "policy v%d fetched: %d shards (%d resumed), %.2f MiB%s in %.2f s",
            version,
            result.fetched_shards,
            result.resumed_shards,
            moved / 2**20,
            " (a patch)" if manifest.message.is_patch else "",
            result.seconds,
        )
        self.count(self.store.manifest(version).message, moved)
        self.totals["fetched_versions"] += 1
        self.totals["fetched_bytes"] += moved
        self.totals["fetch_seconds"] += result.seconds
        return True

    def check_whole(self, manifest: ShardManifest) -> None:
        """A whole version (a snapshot) fetched here: its bytes matched the shard hashes, and
        its tensors must match the tensor hashes the same manifest signs, which every patch
        built on it is checked against. One that does not is refused, deleted and counted."""
        if not manifest.tensors:
            return  # a manifest from before tensor hashes
        directory = self.store.directory(manifest.version)
        spans = manifest.file_spans() if len(manifest.files) > 1 else None
        try:
            got = dict(hash_tensors(directory / "data", spans))
        except ConfigError as exc:
            got, why = {}, str(exc)
        else:
            why = ""
        for name, digest in manifest.tensors:
            if got.get(name) != digest:
                why = why or f"tensor {name[:80]!r} differs from the manifest's hash"
                break
        if why or set(got) != {name for name, _ in manifest.tensors}:
            self.refused_versions += 1
            shutil.rmtree(directory, ignore_errors=True)
            raise ValidationError(
                f"policy v{manifest.version} refused and deleted: its bytes match their shard"
                f" hashes but not the tensors its manifest signs ({why or 'other tensors'})"
            )

    def finish_chain(self, versions: list[int]) -> None:
        """Make the newest of ``versions`` (one whole version, or patches oldest first whose
        first base's weights are held) loadable. A chain that composes is applied in one pass
        (``swarm.shardcast.delta.apply_patches``: one file written, not one per version);
        otherwise each version is reconstructed in turn."""
        manifests = [self.store.manifest(v).message for v in versions]
        for m in manifests:
            if m.base is None:
                continue
            try:
                held_id = self.store.manifest(m.base).id
            except SwarmError as exc:
                raise ValidationError(f"the base v{m.base} of policy v{m.version} is gone") from exc
            if held_id != m.base_id:
                raise ValidationError(
                    f"policy v{m.version} patches a v{m.base} that is not the held one"
                )
        patches = [self.store.directory(m.version) / "data" for m in manifests]
        first = manifests[0].base
        if len(manifests) > 1 and first is not None and composable(patches):
            held = self.store.weights_bytes(first)
            if held is None:
                raise ValidationError(f"the base v{first} of the chain is gone")
            newest = manifests[-1]
            try:
                apply_patches(
                    held[0],
                    patches,
                    self.store.directory(newest.version) / "weights",
                    tensors=newest.tensors,
                    header_sha256=newest.header_sha256,
                    base_files=held[1],
                )
                return
            except PatchError as exc:
                # Some patch of the chain is not its manifest's: one version at a time finds
                # which (each checked against its own manifest) and refuses that one.
                log.warning("policy v%d from the chain in one pass: %s", newest.version, exc)
        for v in versions:
            self.finish(v)

    def finish(self, version: int) -> None:
        """Make one complete version loadable: reconstruct a patch on its held base (checked
        against the manifest's tensor hashes), split a sharded version into its files."""
        manifest = self.store.manifest(version).message
        directory = self.store.directory(version)
        if manifest.is_patch and not (directory / "weights").is_file():
            assert manifest.base is not None
            held = self.store.weights_bytes(manifest.base)
            if held is None:
                raise ValidationError(f"the base v{manifest.base} of policy v{version} is gone")
            self._reconstruct(manifest, held, [directory / "data"])
        elif len(manifest.files) > 1:
            split_files(directory, manifest)

    def _reconstruct(
        self,
        manifest: ShardManifest,
        held: tuple[Path, list[tuple[int, int]] | None],
        patches: list[Path],
    ) -> None:
        """``manifest``'s version from the ``held`` base bytes and ``patches``; refused,
        deleted and counted when it is not the signed bytes."""
        directory = self.store.directory(manifest.version)
        base, spans = held
        try:
            apply_patches(
                base,
                patches,
                directory / "weights",
                tensors=manifest.tensors,
                header_sha256=manifest.header_sha256,
                base_files=spans,
            )
        except PatchError as exc:
            self.refused_versions += 1
            shutil.rmtree(directory, ignore_errors=True)
            raise ValidationError(f"policy v{manifest.version} refused and deleted: {exc}") from exc

    def count(self, manifest: ShardManifest, moved: int) -> None:
        """Record that ``moved`` bytes of ``manifest``'s version travelled."""
        self.transfers[manifest.version] = {
            "bytes": moved,
            "full": manifest.full_size,
            "patch": manifest.is_patch,
        }
        for old in sorted(self.transfers)[:-KEEP_TRANSFERS]:
            del self.transfers[old]

    def view(self) -> dict[str, Any]:
        """Bytes per version (patch against full) and bytes saved, for status and summaries."""
        moved = sum(int(t["bytes"]) for t in self.transfers.values())
        full = sum(int(t["full"]) for t in self.transfers.values())
        return {
            "versions": {str(v): dict(t) for v, t in sorted(self.transfers.items())},
            "bytes": moved,
            "full_bytes": full,
            "saved_bytes": max(0, full - moved),
            "refused_versions": self.refused_versions,
            "totals": dict(self.totals),
        }
