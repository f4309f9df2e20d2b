"""A policy version's weights from SHARDCAST, whole or as a patch on the chain before it.

``VersionChain`` owns what happens between "this version is announced" and "this file loads":

- a patch (``ShardManifest.base``; docs/shardcast.md) needs its base held first: ``weights``
  asks ``base`` (the caller's own fetch, so its locks and checks apply; by default itself) for
  it, and so walks back to the newest snapshot when a node holds nothing;
- the version's shards are fetched like any version's (``ShardcastService.fetch``);
- ``finish`` makes a complete version loadable: a patch is reconstructed and checked tensor by
  tensor against its manifest (``swarm.shardcast.delta.apply_patch``); one that reconstructs
  other bytes is refused, deleted and counted (``refused_patches``); a sharded version is split
  into its files (``swarm.shardcast.split``);
- ``transfers`` keeps, per version, the bytes that travelled against the version's full size
  (``view``: for ``status``, the dashboard and ``summary.json``).

The policy feed (every role) and the audit's gathering both use it.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from node.shardcast import ShardcastService
from swarm.errors import ValidationError
from swarm.messages import ShardManifest, Signed
from swarm.shardcast import FetchConfig, ShardStore
from swarm.shardcast.delta import PatchError, apply_patch
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
        self.refused_patches = 0

    async def weights(
        self,
        service: ShardcastService,
        version: int,
        *,
        manifest: Signed[ShardManifest] | None = None,
        config: FetchConfig | None = None,
        on_progress: ProgressCallback | None = None,
        base: Callable[[int], Awaitable[Path]] | None = None,
    ) -> Path:
        """What loads ``version`` (``ShardStore.weights_path``), fetched when not held."""
        held = self.store.weights_path(version)
        if held is not None:
            return held
        if manifest is None or manifest.message.version != version:
            manifest = await service.manifest(version)

        async def own_base(v: int) -> Path:
            return await self.weights(service, v, config=config)

        fetch_base = base or own_base
        if manifest.message.is_patch:
            await self._hold_base(manifest.message, fetch_base)
        result = await service.fetch(
            version, config=config, on_progress=on_progress, manifest=manifest
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
        if manifest.message.is_patch:
            await self._hold_base(manifest.message, fetch_base)  # retention may have thinned it
        await trio.to_thread.run_sync(self.finish, version)
        local = self.store.weights_path(version)
        if local is None:
            raise ValidationError(f"policy v{version} is not complete after its fetch")
        return local

    async def _hold_base(
        self, manifest: ShardManifest, fetch: Callable[[int], Awaitable[Path]]
    ) -> None:
        """The weights of a patch's base, fetched (with the chain before it) when not held."""
        assert manifest.base is not None
        if self.store.weights_bytes(manifest.base) is None:
            log.info(
                "policy v%d is a patch against v%d, which is not held here: fetching it first",
                manifest.version,
                manifest.base,
            )
            await fetch(manifest.base)
        if self.store.manifest(manifest.base).id != manifest.base_id:
            raise ValidationError(
                f"policy v{manifest.version} patches a v{manifest.base} that is not the held one"
            )

    def finish(self, version: int) -> None:
        """Make a complete version loadable: reconstruct a patch (checked against the
        manifest's tensor hashes), split a sharded version into its files. A patch that does
        not reconstruct the signed bytes is refused and deleted."""
        manifest = self.store.manifest(version).message
        directory = self.store.directory(version)
        if manifest.is_patch and not (directory / "weights").is_file():
            assert manifest.base is not None
            held = self.store.weights_bytes(manifest.base)
            if held is None:
                raise ValidationError(f"the base v{manifest.base} of policy v{version} is gone")
            base, spans = held
            try:
                apply_patch(
                    base,
                    directory / "data",
                    directory / "weights",
                    tensors=manifest.tensors,
                    header_sha256=manifest.header_sha256,
                    base_files=spans,
                )
            except PatchError as exc:
                self.refused_patches += 1
                shutil.rmtree(directory, ignore_errors=True)
                raise ValidationError(f"policy v{version} refused and deleted: {exc}") from exc
        elif len(manifest.files) > 1:
            split_files(directory, manifest)

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
            "refused_patches": self.refused_patches,
        }
