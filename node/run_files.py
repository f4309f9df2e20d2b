"""The files a genesis binds by sha256 (the model card's small files, a JSONL data set), served
and fetched over ``/swarm-node/<run>/run-files/1``.

Decisions this module owns:

- Serving (``RunFileServer``): a node answers only for files the genesis binds that it holds,
  after checking them, looked up by sha256: a request cannot name a path. The request is
  msgpack ``{"sha256": bin32, "offset": int}``; the answer is up to ``CHUNK`` (4 MiB) bytes of
  the file from ``offset`` (a requester walks the offsets, so any file size fits the limit).
- Fetching (``fetch_file``): the whole file from one peer at a time, trainers first, then other
  run peers; the bytes land in ``<dest>.part`` and become ``dest`` only after their sha256 and
  size match the genesis. A peer that sends wrong bytes or refuses is skipped; while no peer
  has the file the fetch waits for peers (discovery is still running) up to ``give_up_after``
  seconds without progress, then ``PeerError`` says what to do.
- Cancellation leaves at most a ``.part`` file, which the next fetch overwrites.

The policy weights are not served here: version 0 travels by SHARDCAST like every version
(``node.model_fetch``).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack
import trio

from node.model.card import sha256_file
from swarm.errors import MalformedError, PeerError, SwarmError
from swarm.messages import FileRef
from swarm.net import StreamLimits
from swarm.net.names import RUN_FILES

log = logging.getLogger(__name__)

CHUNK = 4 * 1024 * 1024
"""Bytes per answer: the size of a SHARDCAST stream piece (fewer streams, bounded memory)."""
PROGRESS_EVERY_S = 5.0
RUN_FILES_LIMITS = StreamLimits(max_request=128, max_response=CHUNK, timeout=30.0, concurrency=8)


class RunFileServer:
    """Serves the bound files this node holds (``add`` each after checking it)."""

    def __init__(self) -> None:
        self._paths: dict[bytes, tuple[FileRef, Path]] = {}
        self.served_bytes = 0

    def add(self, ref: FileRef, path: Path) -> None:
        self._paths[ref.sha256] = (ref, path)

    def add_dir(self, refs: Iterable[FileRef], directory: Path) -> None:
        for ref in refs:
            self.add(ref, directory / ref.name)

    def holds(self, sha256: bytes) -> bool:
        return sha256 in self._paths

    async def handle(self, peer: str, body: bytes) -> bytes:
        sha256, offset = _parse_request(body)
        held = self._paths.get(sha256)
        if held is None:
            raise PeerError(f"file {sha256.hex()[:16]} is not held here")
        ref, path = held
        if offset >= ref.size and ref.size:
            raise MalformedError(f"offset {offset} past the end of {ref.name} ({ref.size} bytes)")
        data = await trio.to_thread.run_sync(_read_chunk, path, offset)
        self.served_bytes += len(data)
        return data


def _read_chunk(path: Path, offset: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(CHUNK)


def _parse_request(body: bytes) -> tuple[bytes, int]:
    try:
        req = msgpack.unpackb(body, raw=False, max_bin_len=64, max_str_len=64, max_map_len=4)
        sha256, offset = req["sha256"], req["offset"]
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise MalformedError(f"run-files request is not {{sha256, offset}}: {exc}") from exc
    if not isinstance(sha256, bytes) or len(sha256) != 32:
        raise MalformedError("run-files request: sha256 must be 32 bytes")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise MalformedError("run-files request: offset must be a non-negative integer")
    return sha256, offset


def file_request(sha256: bytes, offset: int) -> bytes:
    packed: bytes = msgpack.packb({"sha256": sha256, "offset": offset}, use_bin_type=True)
    return packed


def run_peers(node: Any) -> list[str]:
    """Peers to ask for run files: trainers first, then the run's other peers (shuffled)."""
    by_role = node.peers_by_role()
    trainers = list(by_role.get("trainer", []))
    others = [p for role, ps in by_role.items() if role not in ("trainer", "bootstrap") for p in ps]
    random.shuffle(trainers)
    random.shuffle(others)
    return [p for p in dict.fromkeys([*trainers, *others]) if p != node.peer_id]


async def _fetch_from(node: Any, peer: str, ref: FileRef, part: Path) -> None:
    """The whole file from ``peer`` into ``part``; ``PeerError`` for wrong or short bytes."""
    offset = 0
    said = trio.current_time()
    with part.open("wb") as out:
        while offset < ref.size:
            data = await node.request(
                peer, RUN_FILES, file_request(ref.sha256, offset), RUN_FILES_LIMITS
            )
            if not data or offset + len(data) > ref.size:
                raise PeerError(f"{peer} sent {len(data)} bytes of {ref.name} at {offset}")
            out.write(data)
            offset += len(data)
            if trio.current_time() - said >= PROGRESS_EVERY_S:
                said = trio.current_time()
                log.info(
                    "fetching %s from %s: %.1f of %.1f MiB",
                    ref.name,
                    peer[-8:],
                    offset / 2**20,
                    ref.size / 2**20,
                )
    if await trio.to_thread.run_sync(sha256_file, part) != ref.sha256:
        raise PeerError(f"{peer} sent {ref.name} with the wrong sha256")


async def fetch_file(
    node: Any, ref: FileRef, dest: Path, *, give_up_after: float = 120.0, what: str = "run file"
) -> Path:
    """Fetch ``ref`` from the run's peers into ``dest`` (checked); ``PeerError`` when no peer
    served it within ``give_up_after`` seconds."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    tried: dict[str, str] = {}
    deadline = trio.current_time() + give_up_after
    while True:
        for peer in run_peers(node):
            try:
                await _fetch_from(node, peer, ref, part)
            except SwarmError as exc:
                tried[peer] = str(exc)
                log.debug("%s %s from %s failed: %s", what, ref.name, peer[-8:], exc)
                continue
            os.replace(part, dest)
            log.info("%s %s (%d bytes) fetched from %s", what, ref.name, ref.size, peer[-8:])
            return dest
        if trio.current_time() >= deadline:
            part.unlink(missing_ok=True)
            why = "; ".join(f"{p[-8:]}: {w}" for p, w in list(tried.items())[:3]) or "no peers"
            raise PeerError(
                f"no peer served {what} {ref.name} (sha256 {ref.sha256.hex()[:16]}) within"
                f" {give_up_after:g} s ({why}); check --bootstrap, or pass a local copy"
            )
        await trio.sleep(1.0)
