"""hivemind's sockets left by killed trainers are removed; a live one is never touched."""

from __future__ import annotations

import socket
from pathlib import Path

from node.compute.groups import remove_stale_sockets


def test_only_sockets_nobody_listens_on_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / "hivemind-p2pclient-old.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(stale))  # bound, never listening, then closed: what a kill -9 leaves
    live_path = tmp_path / "hivemind-p2pclient-live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(live_path))
        live.listen(1)
        assert remove_stale_sockets(folder=tmp_path) == 1
        assert live_path.exists() and not stale.exists()
