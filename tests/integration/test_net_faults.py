"""Faults on real loopback sockets: bootstrap peers that cannot be reached (and why), forged
DHT records, and one peer flooding gossip and streams."""

from __future__ import annotations

import contextlib
import gc
import math
import socket
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from node import admin
from swarm.errors import BootstrapError, NetworkError
from swarm.messages import PolicyAnnouncement, RoleAdvert, sign
from swarm.net import (
    DialPolicy,
    DialReport,
    Overlay,
    OverlayConfig,
    StreamLimits,
    advert_key,
    dial_bootstrap,
    policy_topic,
)
from tests.netfactory import NetFactory, key_named, wait_until

QUICK = DialPolicy(attempts=3, timeout=0.5, backoff=0.05, max_backoff=0.2)


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def silent_listener() -> AsyncIterator[int]:
    """A TCP port that accepts connections and never says a word."""
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


def addr_at(port: int, peer_id: str) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"


async def test_dial_names_each_unreachable_address_and_why_after_retries() -> None:
    # One peer ID per address, as bootstrap lists have (py-libp2p dials every known address
    # of a peer ID at once, so one ID behind three addresses would blur the reasons).
    async with (
        Overlay.start(key_named("dialer")) as dialer,
        Overlay.start(key_named("real")) as real,
        silent_listener() as silent,
    ):
        refused = addr_at(closed_port(), key_named("stranger-1").peer_id)
        timeout = addr_at(silent, key_named("stranger-2").peer_id)
        # A real host answers there, but it is not the peer the address names.
        wrong_id = real.addrs()[0].rsplit("/p2p/", 1)[0] + "/p2p/" + key_named("x").peer_id
        report = DialReport()
        with pytest.raises(BootstrapError) as caught:
            await dial_bootstrap(dialer.host, [refused, timeout, wrong_id], QUICK, report)

    message = str(caught.value)
    assert message.startswith("no bootstrap peer answered: ")
    assert f"{refused} (connection refused)" in message
    assert f"{timeout} (timeout after 0.5 s" in message
    assert f"{wrong_id} (wrong peer ID" in message
    assert "--bootstrap" in message and "--wait" in message
    assert report.attempts == {refused: 3, timeout: 3, wrong_id: 3}
    assert report.connected == []


async def test_dial_succeeds_with_any_answering_peer_and_reports_the_others() -> None:
    stranger = key_named("stranger").peer_id
    async with Overlay.start(key_named("dialer")) as dialer, Overlay.start(key_named("b")) as b:
        dead = addr_at(closed_port(), stranger)
        report = await dial_bootstrap(dialer.host, [dead, b.addrs()[0]], QUICK)
    assert report.connected == [b.addrs()[0]]
    assert report.failures == {dead: "connection refused"}


async def test_dial_with_wait_keeps_trying_until_a_peer_comes_up() -> None:
    port = closed_port()
    late_key = key_named("late")
    forever = DialPolicy(attempts=math.inf, timeout=0.5, backoff=0.05, max_backoff=0.1)
    report = DialReport()
    async with Overlay.start(key_named("dialer")) as dialer, trio.open_nursery() as nursery:
        done = trio.Event()

        async def dial() -> None:
            await dial_bootstrap(dialer.host, [addr_at(port, late_key.peer_id)], forever, report)
            done.set()

        nursery.start_soon(dial)
        await wait_until(lambda: sum(report.attempts.values()) >= 4, 10)
        assert not done.is_set()
        config = OverlayConfig(listen=(f"/ip4/127.0.0.1/tcp/{port}",))
        async with Overlay.start(late_key, config):
            with trio.fail_after(10):
                await done.wait()
    assert report.connected == [addr_at(port, late_key.peer_id)]


async def store_at(overlay: Overlay, peer: object, key: bytes, value: bytes) -> None:
    """A raw PUT_VALUE to one peer (a refusing peer drops the stream without answering)."""
    with trio.move_on_after(1.0):
        await overlay.dht.value_store._store_at_peer(peer, key, value)


class AnythingGoes:
    """Mallory's validator: she stores and sends whatever she likes."""

    def validate(self, key: str, value: bytes) -> None:
        return None

    def select(self, key: str, values: object) -> int:
        return 0


async def test_mallory_cannot_overwrite_bobs_role_advert_even_after_bob_left() -> None:
    async with NetFactory() as net:
        boot = await net.bootstrap()
        alice = await net.node("inference", key_named("alice"))
        mallory = await net.node("inference", key_named("mallory"))
        run_id = alice.run_id
        async with net.node_scope("inference", key_named("bob")) as bob:
            genuine = bob.membership.mine
            assert genuine is not None
            await wait_until(lambda: alice.overlay.records.get_advert(run_id, bob.peer_id), 10)
        # Bob has left. Mallory signs an advert for bob's peer ID with her own key, stores it
        # at every peer she knows (her own validator bypassed), and keeps it to answer with.
        forged = sign(
            RoleAdvert(
                run_id=run_id,
                peer_id=genuine.message.peer_id,
                role="inference",
                software="evil",
                addrs=tuple(mallory.overlay.addrs()),
                issued_at=genuine.message.issued_at + 1,
                expires_at=genuine.message.expires_at + 1,
            ),
            mallory.key,
        )
        key = advert_key(run_id, genuine.message.peer_id).encode()
        rejected_before = [n.advert_validator.rejected for n in (alice.overlay, boot.overlay)]
        mallory.overlay.dht.validator = AnythingGoes()
        mallory.overlay.dht.value_store.put(key, forged.raw)
        async with trio.open_nursery() as nursery:
            for peer in mallory.overlay.host.get_connected_peers():
                nursery.start_soon(store_at, mallory.overlay, peer, key, forged.raw)
        assert mallory.overlay.dht.value_store.get(key).value == forged.raw

        rejected_after = [n.advert_validator.rejected for n in (alice.overlay, boot.overlay)]
        assert sum(rejected_after) > sum(rejected_before)
        for holder in (alice.overlay, boot.overlay):
            stored = holder.dht.value_store.get(key)
            assert stored is not None and stored.value == genuine.raw
        # A node that joins now and asks the network gets bob's record, never mallory's.
        carol = await net.node("inference", key_named("carol"))
        await wait_until(lambda: len(carol.overlay.connected_peers()) >= 2, 10)
        found = await carol.overlay.records.get_advert(run_id, genuine.message.peer_id)
        assert found is not None and found.raw == genuine.raw
        assert carol.overlay.dht.value_store.get(key).value != forged.raw


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0  # pragma: no cover - not Linux


async def _status_latency(sock: Path) -> float:
    start = trio.current_time()
    answer = await admin.query(sock, {"cmd": "status"}, timeout=5)
    assert answer["status"]["role"] == "inference"
    return trio.current_time() - start


async def test_a_gossip_and_stream_flood_from_one_peer_leaves_the_node_responsive(
    tmp_path: Path,
) -> None:
    """1,500 forged announcements and 600 stream requests from one peer, bounded in time: the
    node's admin status answers throughout (within a second, or a fifth of the flood's time),
    its memory stays bounded, and an honest request is served again within seconds afterwards.
    """
    async with NetFactory(home_root=tmp_path) as net:
        target = await net.node("inference", home=True, bootstrap=[], connect_found_peers=False)
        addr = target.overlay.addrs()[:1]
        mallory = await net.node("inference", key_named("mallory"), bootstrap=addr)
        honest = await net.node("inference", key_named("honest"), bootstrap=addr)
        topic = policy_topic(target.run_id)
        await wait_until(lambda: mallory.peer_id in target.overlay.mesh_peers(topic), 10)
        mallory.overlay.pubsub.remove_topic_validator(topic)

        async def echo(_peer: str, body: bytes) -> bytes:
            return body

        server = target.handle("echo", echo, StreamLimits(timeout=1.0, concurrency=8))
        sock = admin.socket_path(target.config.home.path)
        latencies: list[float] = []
        flooding = True

        async def watch_status() -> None:
            while flooding:
                latencies.append(await _status_latency(sock))
                await trio.sleep(0.05)

        async def gossip_flood(count: int, tag: int) -> None:
            for i in range(count):
                forged = sign(PolicyAnnouncement(target.run_id, i + 1, bytes(32), tag), mallory.key)
                await mallory.overlay.publish(topic, forged.raw)
                if i % 50 == 0:
                    await trio.sleep(0)

        quick = StreamLimits(timeout=2.0)

        async def stream_flood(count: int) -> None:
            async def one() -> None:
                # Shed or reset (NetworkError) is the target's choice under load.
                with contextlib.suppress(NetworkError):
                    await mallory.request(target.peer_id, "echo", b"x" * 64, quick)

            for start in range(0, count, 50):
                async with trio.open_nursery() as batch:
                    for _ in range(start, min(start + 50, count)):
                        batch.start_soon(one)

        await gossip_flood(100, 0)  # warm-up: caches and mesh state exist before we measure
        await wait_until(lambda: target.stats.rejected["policy", "not-authorized"] >= 5, 10)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        rss_before = _rss_kib()
        flood_started = trio.current_time()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_status)
                await gossip_flood(1500, 1)
                await stream_flood(600)
                flooding = False
        flood_s = trio.current_time() - flood_started
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
        rss_grown = _rss_kib() - rss_before

        # Answered beside the flood, not after it: within a second, or (when another test's
        # load shares the two cores) within a fifth of the flood's own time; a node that
        # served the flood first would answer only once it had passed.
        bound = max(1.0, flood_s / 5)
        print(f"flood {flood_s:.1f} s; status answered in at most {max(latencies):.2f} s")
        assert latencies and max(latencies) < bound, (f"flood {flood_s:.1f} s", latencies)
        assert grown < 24 * 1024 * 1024, f"{grown / 1e6:.1f} MB kept after the flood"
        assert rss_grown < 96 * 1024, f"RSS grew by {rss_grown / 1024:.0f} MiB"
        # py-libp2p's GossipSub drops past 10 messages a second per peer and topic before our
        # gate runs; what got through the rate limit was refused by the gate, none accepted.
        assert target.stats.rejected["policy", "not-authorized"] >= 5
        assert target.stats.accepted["policy"] == 0 and target.policy.version is None
        # The flood pressed on the stream gate: beyond its 8 slots, it shed dozens. How many of
        # the 600 got that far, rather than being reset in py-libp2p's muxer or timed out by
        # mallory, depends on the machine (150-300 here on 2 cores).
        assert server.shed >= 50, (server.served, server.shed, server.refused)

        async def honest_answer() -> bytes | None:
            # Right after the flood the target may still be clearing mallory's streams (on a
            # slow 2-core box one honest open failed): served again within seconds is the bar.
            with contextlib.suppress(NetworkError):
                return await honest.request(target.peer_id, "echo", b"still here")
            return None

        assert await wait_until(honest_answer, 15) == b"still here"
        assert (await _status_latency(sock)) < 1.0


async def test_gossipsub_equivocation_memory_is_trimmed_to_the_newest_messages() -> None:
    async with Overlay.start(key_named("long-running")) as overlay:
        table = overlay.gossipsub.equivocation_detection
        table.clear()
        for i in range(5000):
            table[b"peer" + i.to_bytes(8, "big")] = object()
        assert overlay.trim_gossip_state(keep=4096) == 904
        assert len(table) == 4096
        assert b"peer" + (4999).to_bytes(8, "big") in table  # the newest are kept
        assert b"peer" + (0).to_bytes(8, "big") not in table
        assert overlay.trim_gossip_state(keep=4096) == 0
