"""The node's SHARDCAST service on a stand-in node: which peers a fetch lets its connection
trimmer close at its cap (``ShardcastService.expendable``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node.shardcast import ENOUGH_PROVIDERS, ShardcastService
from swarm.errors import PeerError
from swarm.shardcast import ShardStore
from swarm.shardcast.serve import ShardServer
from tests.shardcast_util import TRAINER, published


class _Records:
    def __init__(self, holders: list[str]) -> None:
        self.holders = holders
        self.node: _Node | None = None
        self.spare_while_asked: list[set[str]] = []

    async def find_providers(self, key: bytes, *, walk: bool = False) -> list[str]:
        # What the lookup's own dials (a DHT walk at our cap) may push out meanwhile.
        assert self.node is not None and self.node.service is not None
        self.spare_while_asked.append(set(self.node.service.expendable()))
        return list(self.holders)


class _Overlay:
    def __init__(self, connected: list[str], holders: list[str]) -> None:
        self.connected = connected
        self.records = _Records(holders)

    def connected_peers(self) -> list[str]:
        return list(self.connected)

    def unblock(self, peer: str) -> None:
        pass


class _Node:
    """Connected to ``connected`` (run workers that hold nothing of the version); the provider
    records name ``holders``, which answer the manifest request and note what the service
    would let go at that moment."""

    peer_id = "me"

    def __init__(self, connected: list[str], holders: list[str], manifest: bytes) -> None:
        self.overlay = _Overlay(connected, holders)
        self.overlay.records.node = self
        self.holders = set(holders)
        self.manifest = manifest
        self.service: ShardcastService | None = None
        self.asked: list[str] = []
        self.spare_when_holders_asked: set[str] = set()

    def peers_by_role(self) -> dict[str, list[str]]:
        # The trainer is known (not connected: the version's origin, not asked at once).
        return {"trainer": [TRAINER.peer_id], "inference": list(self.overlay.connected)}

    async def request(self, peer: str, name: str, body: bytes, limits: Any) -> bytes:
        self.asked.append(peer)
        if peer not in self.holders:
            raise PeerError(f"{peer}: version 1 not held")
        assert self.service is not None
        self.spare_when_holders_asked |= self.service.expendable()
        return self.manifest


async def test_the_peers_asked_for_the_manifest_in_vain_may_go_while_the_holders_are_asked(
    tmp_path: Path,
) -> None:
    """A newcomer whose connected peers all answer "not held" asks the version's provider
    records; while it asks them and dials their holders (at its cap), the peers that
    answered "not held" are expendable (each ask left them in use for ``in_use_s``, and a
    newcomer at its cap failed its dials to the holders: docs/RELIABILITY.md), the holders
    are not, and once the fetch ends nothing is."""
    g, signed, _ = published(tmp_path)
    empty = [f"empty-{i}" for i in range(ENOUGH_PROVIDERS)]  # enough: no records asked first
    holders = ["holder-a", "holder-b"]
    node = _Node(empty, holders, signed.raw)
    receiver = ShardStore(tmp_path / "receiver")
    service = ShardcastService(node, g, receiver, ShardServer(receiver), None)
    node.service = service

    got = await service.manifest(1)

    assert got.message == signed.message
    assert set(empty) <= set(node.asked) and set(node.asked) & set(holders)
    assert node.overlay.records.spare_while_asked == [set(empty)]
    assert node.spare_when_holders_asked == set(empty)
    assert service.expendable() == frozenset()


async def test_a_manifest_no_peer_holds_is_a_clear_error_and_leaves_nothing_spare(
    tmp_path: Path,
) -> None:
    g, _, _ = published(tmp_path)
    node = _Node(["empty-0", "empty-1"], [], b"")
    receiver = ShardStore(tmp_path / "receiver")
    service = ShardcastService(node, g, receiver, ShardServer(receiver), None)
    node.service = service
    with pytest.raises(PeerError, match="no provider gave a valid manifest of version 1"):
        await service.manifest(1)
    assert service.expendable() == frozenset()
