"""Shared pieces of the SHARDCAST tests: a run, a checkpoint, and an in-memory ShardSource
whose peers can be told to misbehave."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio
from safetensors.numpy import save_file

from node.run import create_genesis
from swarm.errors import PeerError, PeerUnreachable
from swarm.identity import NodeKey
from swarm.messages import RunGenesis, RunParams, ShardManifest, Signed
from swarm.shardcast import ShardNotHeld, ShardSink, ShardStore, publish
from swarm.shardcast.source import PeerBusy, ShardElsewhere


def key(name: str) -> NodeKey:
    return NodeKey.from_seed(hashlib.sha256(name.encode()).digest())


TRAINER = key("trainer")
OWNER = key("owner")
MALLORY = key("mallory")


def genesis(name: str = "test-run", async_level: int = 2) -> Signed[RunGenesis]:
    return create_genesis(
        OWNER,
        name=name,
        trainers=[TRAINER.peer_id],
        validators=[key("validator").peer_id],
        params=RunParams(async_level=async_level),
        created_at=1,
    )


def checkpoint(path: Path, size: int = 300_000, seed: int = 0) -> Path:
    """A safetensors file of about ``size`` bytes of random float32 tensors."""
    rng = np.random.default_rng(seed)
    n = max(1, size // 4 // 3)
    save_file({f"w{i}": rng.standard_normal(n).astype(np.float32) for i in range(3)}, str(path))
    return path


def published(
    tmp: Path, *, version: int = 1, size: int = 300_000, shard_size: int = 16_384, seed: int = 0
) -> tuple[Signed[RunGenesis], Signed[ShardManifest], ShardStore]:
    """A trainer's store holding ``version`` of a fresh checkpoint."""
    g = genesis()
    ckpt = checkpoint(tmp / f"ckpt-{version}-{seed}.safetensors", size, seed)
    store = ShardStore(tmp / "trainer-store")
    signed = publish(
        ckpt, key=TRAINER, genesis=g, version=version, store=store, shard_size=shard_size
    )
    return g, signed, store


@dataclass
class MemoryPeer:
    """A provider in memory. ``mode``: ok, corrupt, truncate, stall, die, refuse, busy (its
    first ``busy`` pulls are refused with ``PeerBusy``); ``elsewhere``: shards it refuses to
    super-seed (``ShardElsewhere``); ``pace``: seconds it takes per chunk (a slow link);
    ``unreachable``: that many of its requests fail to connect (``PeerUnreachable``: a holder
    at its connection cap), after its first ``reachable_first``."""

    data: bytes
    manifest_raw: bytes
    mode: str = "ok"
    held: set[int] | None = None  # None: every shard
    chunk: int = 4096
    served: list[int] = field(default_factory=list)
    busy: int = 0
    elsewhere: set[int] = field(default_factory=set)
    manifest_asked: int = 0
    pace: float = 0.0
    unreachable: int = 0
    reachable_first: int = 0
    answer_after: float = 0.0
    """Seconds its first ``have`` answer takes (a dial at its cap, a slow link)."""

    def connect(self, peer: str) -> None:
        if self.reachable_first > 0:
            self.reachable_first -= 1
        elif self.unreachable > 0:
            self.unreachable -= 1
            raise PeerUnreachable(f"cannot open a stream to {peer}: connections limit reached")


class MemorySource:
    """A ShardSource over ``MemoryPeer``s, with no sockets."""

    def __init__(self, peers: dict[str, MemoryPeer], manifest: ShardManifest) -> None:
        self.peers = peers
        self.m = manifest
        self.pulls: list[tuple[str, int]] = []

    async def manifest(self, peer: str, version: int | None) -> bytes:
        await trio.lowlevel.checkpoint()
        p = self.peers[peer]
        p.manifest_asked += 1
        if p.held is not None and not p.held:
            raise ShardNotHeld(f"{peer} holds no shard of version {version}")
        return p.manifest_raw

    async def have(
        self, peer: str, version: int, known: int = -1, wait: float = 0.0
    ) -> bytes | None:
        await trio.lowlevel.checkpoint()
        p = self.peers[peer]
        if p.answer_after:
            await trio.sleep(p.answer_after)
            p.answer_after = 0.0
        p.connect(peer)
        if p.held is None:
            return None
        return bytes(1 if i in p.held else 0 for i in range(len(self.m.shard_hashes)))

    async def pull(self, peer: str, version: int, index: int, sink: ShardSink) -> None:
        p = self.peers[peer]
        self.pulls.append((peer, index))
        p.connect(peer)
        if p.held is not None and index not in p.held:
            raise ShardNotHeld(f"{peer} lacks shard {index}")
        if p.mode == "refuse":
            raise PeerError(f"{peer} refused")
        if p.busy > 0:
            p.busy -= 1
            raise PeerBusy(f"busy: {peer} has no free upload slot")
        if index in p.elsewhere:
            raise ShardElsewhere(f"elsewhere: {peer} gave shard {index} to enough peers")
        start, length = self.m.shard_span(index)
        body = bytearray(p.data[start : start + length])
        if p.mode == "corrupt":
            body[len(body) // 2] ^= 0xFF
        if p.mode == "truncate":
            body = body[: len(body) // 2]
        for pos in range(0, len(body), p.chunk):
            if p.mode == "stall" and pos >= len(body) // 2:
                await trio.sleep_forever()
            if p.mode == "die" and pos >= len(body) // 2:
                raise PeerError(f"{peer}: connection reset")
            sink.write(body[pos : pos + p.chunk])
            await (trio.sleep(p.pace) if p.pace else trio.lowlevel.checkpoint())
        p.served.append(index)


def seeder_store(
    root: Path, signed: Signed[ShardManifest], data: bytes, *, fault: str = "ok"
) -> ShardStore:
    """A provider's store holding ``signed`` complete; ``fault`` damages its data file on disk:
    ``corrupt`` flips a byte of every shard, ``truncate`` cuts the file in half."""
    store = ShardStore(root)
    body = bytearray(data)
    if fault == "corrupt":
        for i in range(len(signed.message.shard_hashes)):
            start, length = signed.message.shard_span(i)
            body[start + length // 2] ^= 0xFF
    with store.open(signed) as vf:
        vf.write_at(0, bytes(body))
        for i in range(len(signed.message.shard_hashes)):
            vf.mark_verified(i, durable=False)
        vf.mark_complete()
        if fault == "truncate":
            os.ftruncate(vf.data_fd, len(data) // 2)
    return store
