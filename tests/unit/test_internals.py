"""Every private py-libp2p and hivemind name the project relies on is present in the installed
versions; one renamed is a warning naming the feature that is off: in the checker, in a live
bootstrap peer's status and in ``doctor``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.doctor import check_internals
from swarm import internals
from swarm.identity import NodeKey
from swarm.internals import Internal


def test_every_libp2p_internal_is_in_the_installed_version() -> None:
    assert internals.missing() == []


def test_every_hivemind_internal_is_in_the_installed_version() -> None:
    # hivemind and py-libp2p cannot share a process: checked where hivemind runs alone.
    code = "from swarm.internals import HIVEMIND, missing; print(missing(HIVEMIND))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_a_renamed_method_is_named_with_the_feature_that_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(GossipSub, "_get_peers_to_send")
    (line,) = internals.missing()
    assert "GossipSub._get_peers_to_send" in line
    assert "flood publishing to every subscribed peer is off" in line
    assert line.startswith("libp2p 0.")
    doctor = check_internals()
    assert doctor.status == "warn" and "flood publishing" in doctor.detail and doctor.hint


def test_an_instance_name_is_checked_on_the_live_object() -> None:
    item = Internal(
        "libp2p.relay.circuit_v2.dcutr:DCUtRProtocol", "_in_progress", "punching", "dcutr"
    )
    assert internals.missing((item,), live={"dcutr": object()}) != []
    assert internals.missing((item,)) == []  # its __init__ sets it
    gone = Internal("libp2p.relay.circuit_v2.dcutr:DCUtRProtocol", "_renamed", "punching", "dcutr")
    assert internals.missing((gone,)) != []
    assert internals.missing((Internal("libp2p.nowhere:X", "y", "z"),)) != []


async def test_a_running_bootstrap_peer_warns_in_its_status(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(DCUtRProtocol, "_auto_drive_loop")  # our subclass keeps its own
    config = BootstrapConfig(key=NodeKey.generate(), listen=("/ip4/127.0.0.1/tcp/0",))
    async with BootstrapPeer.start(config) as peer:
        (warning,) = peer.status()["warnings"]
    assert "DCUtRProtocol._auto_drive_loop" in warning and "hole-punch" in warning
    assert "swarm/internals.py" in caplog.text
