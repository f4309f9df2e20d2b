"""Catching up on the policy (``PolicyFeed.pull``) while a peer does not answer."""

from __future__ import annotations

from pathlib import Path

import trio

from node.policy_feed import POLICY_LIMITS, PolicyFeed
from swarm.messages import PolicyAnnouncement, sign
from swarm.net.names import POLICY
from tests.netfactory import NetFactory


async def test_a_peer_that_does_not_answer_does_not_hold_the_catch_up(tmp_path: Path) -> None:
    """The first peer asked (the trainer, busy serving a new version, in the case that found
    it) never answers; the second holds the announcement. The asker learns it from the second
    within its budget instead of spending the budget on the first."""
    async with NetFactory() as net:
        asker = await net.node("inference", bootstrap=[], connect_found_peers=False)
        slow = await net.node("inference", bootstrap=[], connect_found_peers=False)
        good = await net.node("inference", bootstrap=[], connect_found_peers=False)

        async def never(_peer: str, _body: bytes) -> bytes:
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        async def newest(_peer: str, _body: bytes) -> bytes:
            assert good.policy.newest is not None
            return good.policy.newest.raw

        slow.handle(POLICY, never, POLICY_LIMITS)
        good.handle(POLICY, newest, POLICY_LIMITS)
        announcement = sign(
            PolicyAnnouncement(good.run_id, 3, b"\x03" * 32, 1), net.trainer_keys[0]
        )
        good.policy_gate.keep(good.policy_gate.check(announcement.raw))
        for peer in (slow, good):
            assert await asker.overlay.connect(peer.peer_id, peer.overlay.addrs()) is None

        feed = PolicyFeed(asker, tmp_path / "shards")
        with trio.fail_after(4):
            assert await feed.pull([slow.peer_id, good.peer_id], timeout=3.0)
        assert asker.policy.version == 3
