"""Catching up on the policy (``PolicyFeed.pull``) while a peer does not answer."""

from __future__ import annotations

from pathlib import Path

import trio

from node.policy_feed import POLICY_LIMITS, PolicyFeed
from swarm.messages import PolicyAnnouncement, sign
from swarm.net.names import POLICY
from tests.netfactory import NetFactory, key_named


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


async def test_an_announcement_gossip_never_brought_is_asked_for_by_number(tmp_path: Path) -> None:
    """The asker accepted v1 and v3 but never v2 (its gossip lost: a validator could then not
    audit v2, docs/RELIABILITY.md). Asked by number, a peer that answers with another version
    and one that answers with an announcement no genesis trainer signed are refused; the
    holder's answer is kept as v2's, the newest untouched; a version nobody holds is None."""
    async with NetFactory() as net:
        asker = await net.node("inference", bootstrap=[], connect_found_peers=False)
        wrong = await net.node("inference", bootstrap=[], connect_found_peers=False)
        forger = await net.node("inference", bootstrap=[], connect_found_peers=False)
        holder = await net.node("inference", bootstrap=[], connect_found_peers=False)
        trainer = net.trainer_keys[0]
        announced = {
            v: sign(PolicyAnnouncement(holder.run_id, v, bytes([v]) * 32, v), trainer)
            for v in (1, 2, 3)
        }
        for v in (1, 2, 3):
            holder.policy_gate.keep(holder.policy_gate.check(announced[v].raw))
        for v in (1, 3):
            asker.policy_gate.keep(asker.policy_gate.check(announced[v].raw))
        holder.handle(POLICY, PolicyFeed(holder, tmp_path / "h")._on_policy, POLICY_LIMITS)

        async def newest(_peer: str, _body: bytes) -> bytes:
            return announced[3].raw

        forged = sign(PolicyAnnouncement(holder.run_id, 2, b"\xff" * 32, 2), key_named("forger"))

        async def forgery(_peer: str, _body: bytes) -> bytes:
            return forged.raw

        wrong.handle(POLICY, newest, POLICY_LIMITS)
        forger.handle(POLICY, forgery, POLICY_LIMITS)
        for peer in (wrong, forger, holder):
            assert await asker.overlay.connect(peer.peer_id, peer.overlay.addrs()) is None

        feed = PolicyFeed(asker, tmp_path / "a")
        with trio.fail_after(8):  # neither answer is taken
            assert await feed.announcement_of(2, [wrong.peer_id, forger.peer_id], 2.0) is None
        assert list(asker.policy.accepted) == [1, 3]
        peers = [wrong.peer_id, forger.peer_id, holder.peer_id]
        with trio.fail_after(8):
            got = await feed.announcement_of(2, peers, timeout=5.0)
        assert got is not None and got.id == announced[2].id
        assert asker.policy.accepted[2].id == announced[2].id
        assert list(asker.policy.accepted) == [1, 2, 3] and asker.policy.version == 3
        with trio.fail_after(8):
            assert await feed.announcement_of(7, peers, timeout=2.0) is None
        assert 7 not in asker.policy.accepted
