"""Providers in this process: a ``ShardSource`` control plane that calls ``ShardServer``s
directly, and the matching data channel negotiation.

This is what the libp2p stream protocols carry between nodes (``streams.py``), without the
network: benchmarks and tests use it to drive real data channel sockets on loopback while
the control questions (manifest, holdings, tokens) are answered in-process.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from swarm.shardcast.serve import ShardServer


class DirectControl:
    """Answers ``manifest``/``have`` and negotiates data channels from in-process servers."""

    def __init__(
        self, servers: Mapping[str, ShardServer], ports: Mapping[str, int], host: str = "127.0.0.1"
    ) -> None:
        self.servers = servers
        self.ports = ports
        self.host = host

    async def manifest(self, peer: str, version: int | None) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.servers[peer].manifest(version)

    async def have(
        self, peer: str, version: int, known: int = -1, wait: float = 0.0
    ) -> bytes | None:
        return await self.servers[peer].wait_have(version, known, wait)

    async def negotiate(self, peer: str) -> tuple[str, int, bytes]:
        await trio.lowlevel.checkpoint()
        return self.host, self.ports[peer], self.servers[peer].issue_token("local")
