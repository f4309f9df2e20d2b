"""A receiver in its own process, for the kill -9 and disk-full tests.

Usage: python -m tests.integration.shardcast_receiver STORE MANIFEST PORT TOKENS [FSIZE]
TOKENS: comma-separated hex data channel tokens; FSIZE: RLIMIT_FSIZE in bytes (disk full).
Exit code 0 on a complete fetch, 3 with the error on stderr for a SwarmError.
"""

from __future__ import annotations

import random
import resource
import signal
import sys
from pathlib import Path

import trio

from swarm.errors import SwarmError
from swarm.messages import ShardManifest, decode
from swarm.shardcast import FetchConfig, ShardStore, fetch_version
from swarm.shardcast.datachannel import DataChannelSource


class Control:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def manifest(self, peer: str, version: int | None) -> bytes:
        return self.raw

    async def have(
        self, peer: str, version: int, known: int = -1, wait: float = 0.0
    ) -> bytes | None:
        return None


async def main(argv: list[str]) -> int:
    root, manifest_path, port = Path(argv[0]), Path(argv[1]), int(argv[2])
    tokens = [bytes.fromhex(t) for t in argv[3].split(",")]
    if len(argv) > 4:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
        limit = int(argv[4])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    raw = manifest_path.read_bytes()
    signed = decode(raw, ShardManifest)

    async def negotiate(peer: str) -> tuple[str, int, bytes]:
        return "127.0.0.1", port, tokens.pop()

    source = DataChannelSource(negotiate, Control(raw))
    try:
        await fetch_version(
            ShardStore(root),
            signed,
            source,
            ["seeder"],
            config=FetchConfig(concurrency=2, stall_timeout=5.0),
            rng=random.Random(),
        )
    except SwarmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1:]))
