"""The shard store: one directory per policy version, durable across crashes.

Layout under the store root::

    <root>/v<version:012d>/manifest   the signed ShardManifest envelope, as received
    <root>/v<version:012d>/data       the version's bytes, preallocated to total_size; every
                                      shard is written at its own offset (no reassembly copy)
    <root>/v<version:012d>/verified   one byte per shard, 1 once that shard's bytes matched
                                      the manifest's sha256 and were fsynced
    <root>/v<version:012d>/complete   written atomically (tmp + rename) after a final fsync
    <root>/v<version:012d>/pinned     present: retention never removes this version
    <root>/v<version:012d>/weights    a patch (``ShardManifest.base``): the reconstructed
                                      safetensors file, checked tensor by tensor against the
                                      manifest (``swarm.shardcast.delta``); ``data`` is the patch
    <root>/v<version:012d>/files/     a version of several files (a sharded checkpoint): each
                                      file by its name, split out of ``data`` to be loaded

Retention keeps the newest ``keep`` versions, the pinned ones, and the chain a joiner needs to
reconstruct them: every version from the newest snapshot (a version that is not a patch) at or
before the oldest kept one. A version kept only for that chain keeps its patch, not its
reconstructed weights (``prune``); they are rebuilt from the chain when asked for.

Crash safety: a shard's ``verified`` byte is written only after its data is fsynced, and the
byte itself is fsynced before the shard counts as held, so after SIGKILL a restarted fetch trusts
exactly the shards that were fully on disk and never fetches them again.

Every OS error becomes a ``StorageError`` that says what failed, where, and how much room is
needed; no version is marked complete unless all of its shards are verified and synced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from swarm.errors import ConfigError, StorageError, SwarmError
from swarm.messages import ShardManifest, Signed, decode

MIB = 1024 * 1024


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def _os_error(what: str, path: Path, exc: OSError, need: int | None = None) -> StorageError:
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        free = _free_bytes(path)
        hint = f"; {_mib(need)} needed" if need is not None else ""
        return StorageError(
            f"disk full while {what} at {path}{hint}, {_mib(free)} free there;"
            " free some space or lower the number of kept versions"
        )
    return StorageError(f"{what} at {path} failed: {exc.strerror or exc}")


def _free_bytes(path: Path) -> int:
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """What the store holds of one version."""

    version: int
    total_size: int
    shards: int
    verified: int
    complete: bool
    pinned: bool
    path: Path


class VersionFile:
    """An open version being filled or served: the data file and its verified journal.

    ``write_at`` puts bytes at an absolute offset; ``mark_verified`` makes a shard durable.
    Close it (or use it as a context manager) to release the file descriptors.
    """

    def __init__(self, directory: Path, manifest: Signed[ShardManifest]) -> None:
        self.directory = directory
        self.signed = manifest
        self.manifest = manifest.message
        n = len(self.manifest.shard_hashes)
        data_path = directory / "data"
        journal_path = directory / "verified"
        try:
            self._data = os.open(data_path, os.O_RDWR | os.O_CREAT, 0o644)
            self._journal = os.open(journal_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _os_error("opening the version's files", directory, exc) from exc
        try:
            bits = os.pread(self._journal, n, 0)
        except OSError as exc:
            self.close()
            raise _os_error("reading the verified journal", journal_path, exc) from exc
        self._verified = bytearray(bits.ljust(n, b"\0")[:n])
        self.complete = (directory / "complete").exists()

    # --- state -----------------------------------------------------------------------------
    @property
    def data_fd(self) -> int:
        return self._data

    def is_verified(self, index: int) -> bool:
        return self._verified[index] == 1

    def verified_indices(self) -> list[int]:
        return [i for i, b in enumerate(self._verified) if b == 1]

    def missing_indices(self) -> list[int]:
        return [i for i, b in enumerate(self._verified) if b != 1]

    def bitmap(self) -> bytes:
        """One byte per shard, 1 where the shard is verified (what ``have`` answers)."""
        return bytes(self._verified)

    def verified_bytes(self) -> int:
        return sum(self.manifest.shard_span(i)[1] for i in self.verified_indices())

    def refresh(self) -> None:
        """Re-read the journal and the complete marker (another process or a fetch in this
        process may have verified shards since this file was opened)."""
        if self.complete:
            return
        n = len(self._verified)
        try:
            bits = os.pread(self._journal, n, 0)
        except OSError as exc:
            raise _os_error("reading the verified journal", self.directory, exc) from exc
        self._verified = bytearray(bits.ljust(n, b"\0")[:n])
        self.complete = (self.directory / "complete").exists()

    # --- writing ---------------------------------------------------------------------------
    def preallocate(self) -> None:
        """Reserve the whole file now, so a full disk shows up before any shard is fetched."""
        total = self.manifest.total_size
        try:
            if total and os.fstat(self._data).st_size < total:
                os.posix_fallocate(self._data, 0, total)
        except OSError as exc:
            raise _os_error(
                "preallocating the version", self.directory / "data", exc, total
            ) from exc

    def write_at(self, offset: int, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.pwrite(self._data, view, offset)
                view = view[n:]
                offset += n
        except OSError as exc:
            raise _os_error("writing a shard", self.directory / "data", exc, len(view)) from exc

    def mark_verified(self, index: int, *, durable: bool = True) -> None:
        """Record shard ``index`` as verified; with ``durable``, data and journal are fsynced
        first, so a crash never leaves a verified byte over unsynced data."""
        try:
            if durable:
                os.fdatasync(self._data)
            os.pwrite(self._journal, b"\x01", index)
            if durable:
                os.fdatasync(self._journal)
        except OSError as exc:
            raise _os_error("recording a verified shard", self.directory, exc) from exc
        self._verified[index] = 1

    def mark_complete(self) -> None:
        """Atomically mark the version complete; refuses while any shard is unverified."""
        missing = self.missing_indices()
        if missing:
            raise StorageError(
                f"version {self.manifest.version} has {len(missing)} unverified shards;"
                " it cannot be marked complete"
            )
        tmp = self.directory / ".complete.tmp"
        try:
            os.fsync(self._data)
            os.fsync(self._journal)
            with open(tmp, "wb") as f:
                f.write(b"%d\n" % self.manifest.total_size)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.directory / "complete")
            _fsync_dir(self.directory)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise _os_error("marking the version complete", self.directory, exc) from exc
        self.complete = True

    def read_at(self, offset: int, length: int) -> bytes:
        try:
            return os.pread(self._data, length, offset)
        except OSError as exc:
            raise _os_error("reading a shard", self.directory / "data", exc) from exc

    def close(self) -> None:
        for name in ("_data", "_journal"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)

    def __enter__(self) -> VersionFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardStore:
    """Policy versions on disk, with retention (newest ``keep`` plus pinned) and a disk budget.

    ``keep`` is the run's ``async_level + 1``; ``max_disk`` (bytes, ``None`` = no budget) caps
    what the kept versions may occupy together.
    """

    def __init__(self, root: Path, *, keep: int = 3, max_disk: int | None = None) -> None:
        if keep < 1:
            raise ConfigError("the shard store keeps at least one version")
        if max_disk is not None and max_disk <= 0:
            raise ConfigError("--max-disk must be positive")
        self.root = root
        self.keep = keep
        self.max_disk = max_disk
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _os_error("creating the shard store", root, exc) from exc

    def directory(self, version: int) -> Path:
        return self.root / f"v{version:012d}"

    def versions(self) -> list[int]:
        """Every version with a stored manifest, oldest first."""
        out = []
        for entry in self.root.iterdir() if self.root.exists() else []:
            name = entry.name
            if name.startswith("v") and name[1:].isdigit() and (entry / "manifest").exists():
                out.append(int(name[1:]))
        return sorted(out)

    def manifest(self, version: int) -> Signed[ShardManifest]:
        path = self.directory(version) / "manifest"
        try:
            raw = path.read_bytes()
        except FileNotFoundError as exc:
            raise StorageError(f"version {version} is not in the shard store {self.root}") from exc
        except OSError as exc:
            raise _os_error("reading a manifest", path, exc) from exc
        try:
            return decode(raw, ShardManifest)
        except SwarmError as exc:
            raise StorageError(
                f"stored manifest {path} is damaged ({exc}); delete {path.parent}"
            ) from exc

    def is_complete(self, version: int) -> bool:
        return (self.directory(version) / "complete").exists()

    def latest_complete(self) -> int | None:
        done = [v for v in self.versions() if self.is_complete(v)]
        return done[-1] if done else None

    def info(self, version: int) -> VersionInfo:
        directory = self.directory(version)
        manifest = self.manifest(version).message
        try:
            bits = (directory / "verified").read_bytes()
        except FileNotFoundError:
            bits = b""
        return VersionInfo(
            version=version,
            total_size=manifest.total_size,
            shards=len(manifest.shard_hashes),
            verified=bits.count(1),
            complete=self.is_complete(version),
            pinned=(directory / "pinned").exists(),
            path=directory / "data",
        )

    def open(self, manifest: Signed[ShardManifest]) -> VersionFile:
        """Open (creating if new) the version of ``manifest``; an existing version must hold
        the same manifest, byte for byte."""
        version = manifest.message.version
        directory = self.directory(version)
        path = directory / "manifest"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if path.exists():
                if path.read_bytes() != manifest.raw:
                    raise StorageError(
                        f"version {version} in {directory} holds a different manifest;"
                        f" delete {directory} to fetch the new one"
                    )
            else:
                tmp = directory / ".manifest.tmp"
                tmp.write_bytes(manifest.raw)
                tmp.replace(path)
        except OSError as exc:
            raise _os_error("storing the manifest", directory, exc) from exc
        return VersionFile(directory, manifest)

    def open_existing(self, version: int) -> VersionFile:
        return VersionFile(self.directory(version), self.manifest(version))

    def pin(self, version: int, pinned: bool = True) -> None:
        marker = self.directory(version) / "pinned"
        self.manifest(version)  # raises for an unknown version
        if pinned:
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    def usage(self, versions: list[int] | None = None) -> int:
        """Bytes the files of ``versions`` (default all) take, at their full size (a patch's
        reconstructed weights and a sharded version's split files included)."""
        total = 0
        for v in self.versions() if versions is None else versions:
            with contextlib.suppress(StorageError):
                manifest = self.manifest(v).message
                total += manifest.total_size
                directory = self.directory(v)
                if (manifest.is_patch and (directory / "weights").is_file()) or (
                    len(manifest.files) > 1 and (directory / "files").is_dir()
                ):
                    total += manifest.full_size
        return total

    def weights_path(self, version: int) -> Path | None:
        """What loads version ``version``: its safetensors file (``data``, or a patch's
        reconstructed ``weights``), or the ``files/`` directory of a sharded version; ``None``
        while it is not complete, reconstructed and split."""
        directory = self.directory(version)
        manifest = self._complete(version)
        if manifest is None:
            return None
        if manifest.is_patch:
            weights = directory / "weights"
            return weights if weights.is_file() else None
        if len(manifest.files) > 1:
            files = directory / "files"
            return files if (files / ".complete").exists() else None
        return directory / "data"

    def weights_bytes(self, version: int) -> tuple[Path, list[tuple[int, int]] | None] | None:
        """Version ``version``'s weights as bytes (what a patch against it applies to): the
        file and, for several files concatenated, each file's ``(offset, size)``."""
        directory = self.directory(version)
        manifest = self._complete(version)
        if manifest is None:
            return None
        if manifest.is_patch:
            weights = directory / "weights"
            return (weights, None) if weights.is_file() else None
        spans = manifest.file_spans() if len(manifest.files) > 1 else None
        return directory / "data", spans

    def _complete(self, version: int) -> ShardManifest | None:
        """The manifest of a complete version (None: not complete, or unreadable)."""
        if not self.is_complete(version):
            return None
        try:
            return self.manifest(version).message
        except StorageError:
            return None

    def _chain_start(self, versions: list[int], oldest_kept: int) -> int:
        """The newest snapshot at or before ``oldest_kept`` (the chain's first version)."""
        for v in reversed([v for v in versions if v <= oldest_kept]):
            try:
                if not self.manifest(v).message.is_patch:
                    return v
            except StorageError:
                continue
        return oldest_kept

    def retained_after(self, version: int) -> list[int]:
        """Versions retention keeps once ``version`` is added: the newest ``keep``, the
        pinned, and the chain from the newest snapshot at or before the oldest of those."""
        all_versions = sorted({*self.versions(), version})
        newest = all_versions[-self.keep :]
        pinned = [v for v in all_versions if (self.directory(v) / "pinned").exists()]
        start = self._chain_start(all_versions, newest[0])
        chain = [v for v in all_versions if start <= v < newest[0]]
        return sorted({*newest, *pinned, *chain})

    def check_room(self, manifest: ShardManifest) -> None:
        """Refuse a fetch that cannot fit: over the disk budget, or more than the free space.

        The message says how much is needed and where. Versions that retention would drop to
        make room count as free.
        """
        version = manifest.version
        kept = [v for v in self.retained_after(version) if v != version]
        if version not in self.retained_after(version):
            raise StorageError(
                f"version {version} is older than the {self.keep} newest versions in"
                f" {self.root}; it would be dropped at once"
            )
        held = self.usage(kept)
        # A patch is reconstructed next to its bytes; a sharded version is split into files.
        need = manifest.total_size + (
            manifest.full_size if manifest.is_patch or len(manifest.files) > 1 else 0
        )
        if self.max_disk is not None and held + need > self.max_disk:
            raise StorageError(
                f"version {version} needs {_mib(need)} in {self.root}, and the kept versions"
                f" {kept} already hold {_mib(held)}: {_mib(held + need)} in all is over the disk"
                f" budget of {_mib(self.max_disk)}; raise --max-disk or unpin versions"
            )
        already = 0
        data = self.directory(version) / "data"
        with contextlib.suppress(OSError):
            already = os.stat(data).st_blocks * 512
        droppable = self.usage([v for v in self.versions() if v not in kept and v != version])
        free = _free_bytes(self.root)
        if need - already > free + droppable:
            raise StorageError(
                f"version {version} needs {_mib(need - already)} more at {self.root}, but only"
                f" {_mib(free)} is free there; free some space or pass another --home"
            )

    def prune(self, keep_also: int | None = None) -> list[int]:
        """Delete versions retention does not keep; returns the versions removed."""
        anchor = keep_also if keep_also is not None else (self.versions() or [0])[-1]
        kept = set(self.retained_after(anchor))
        all_versions = sorted({*self.versions(), anchor})
        loaded = set(all_versions[-self.keep :]) | {
            v for v in all_versions if (self.directory(v) / "pinned").exists()
        }
        removed = []
        for v in self.versions():
            if v not in kept:
                shutil.rmtree(self.directory(v), ignore_errors=True)
                removed.append(v)
            elif v not in loaded:
                # Kept for a joiner's chain only: the patch stays, its reconstruction goes.
                (self.directory(v) / "weights").unlink(missing_ok=True)
        return removed

    def iter_info(self) -> Iterator[VersionInfo]:
        for v in self.versions():
            with contextlib.suppress(StorageError):
                yield self.info(v)
