"""Bounded connections on a real swarm: 30 nodes on 127.0.0.1 (a trainer, a validator and
28 workers, one bootstrap peer) with low and high water marks of 8 and 12. Every node dials
past the low mark only to reach the trainer and trims what others' dials add past the high
one; once formed, every node stays at or under 12 through an announcement that reaches all of
them, no node trims a peer it protects, and a node that joins then still fetches a version
from several peers.

The bootstrap peer is no run node: it keeps its resource manager's limit (``HostLimits``),
as every node stays connected to it (``docs/protocol.md``, "Bounded connections")."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from libp2p.peer.id import ID

from node.runtime import Node
from node.shardcast import ShardcastService, version_provider_key
from swarm.errors import NetworkError, PeerError
from swarm.messages import run_id_of
from swarm.net.connections import IDLE_PROTOCOLS, ConnectionBounds
from swarm.shardcast import ShardStore, publish
from swarm.shardcast.fetch import MIN_SOURCES
from tests.netfactory import NetFactory, WaitTimedOut, wait_until
from tests.shardcast_util import checkpoint, seeder_store

N = 30
BOUNDS = ConnectionBounds(low=8, high=12)
HOLDERS = 4
"""Workers that hold the version before the newcomer joins, so that there are several sources."""
VERSION_BYTES = 16_000_000
START_ALONE_S = 75.0
"""How long starting the 30 nodes takes here with the machine to itself (70-74 s, five runs);
the later deadlines scale with how much longer it took (``pace``)."""


def counts(nodes: list[Node]) -> list[int]:
    return [n.connections.count() for n in nodes]


@pytest.mark.slow
@pytest.mark.alone  # 30 nodes in one loop: beside the other worker, starting them took 278 s
@pytest.mark.timeout(600)
async def test_thirty_nodes_stay_under_the_high_water_mark_and_still_spread_and_share(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The product's 1 s heartbeat and 3 s discovery pace (the factory's 0.2 s and 1 s are for
    # small swarms): 30 nodes share this one loop. At a 1 s pace it took 145-217 s alone here
    # (four runs), at 3 s 120-135 s (three runs; a fourth beside another process, 231 s).
    started = trio.current_time()
    # The fetches' steps, in a failure's captured log (WARNING and above otherwise).
    for name in ("node.shardcast", "swarm.shardcast"):
        caplog.set_level(logging.DEBUG, logger=name)

    def phase(name: str) -> None:
        # Printed as it happens: a failure's captured output says how far the test got.
        print(f"{trio.current_time() - started:6.1f} s  {name}", flush=True)

    # How much slower than alone this machine runs the test (``START_ALONE_S``), set once the
    # nodes are up. The deadlines bound a hang, not the speed (``bench/`` measures that):
    # beside two busy processes the start took 179-206 s, and a newcomer's fetch that takes
    # 5 s alone took over 60.
    pace = 1.0

    @contextmanager
    def within(
        seconds: float, what: str, state: Callable[[], object] | None = None
    ) -> Iterator[None]:
        """``trio.fail_after(seconds * pace)``, failing with a message that names ``what``
        and ``state()`` then (a bare ``TooSlowError`` in a CI log said nothing of which step
        hung, or where)."""
        limit = seconds * pace
        try:
            with trio.fail_after(limit):
                yield
        except trio.TooSlowError:
            then = "" if state is None else f"; {state()}"
            raise WaitTimedOut(
                f"{what}: not done in {limit:.0f} s (pace {pace:.2f}){then}"
            ) from None

    async with NetFactory(heartbeat=1.0, discover_every_s=3.0) as net:
        await net.bootstrap()
        trainer = await net.node("trainer", connections=BOUNDS)
        validator = await net.node("validator", connections=BOUNDS)
        workers = [await net.node("inference", connections=BOUNDS) for _ in range(N - 2)]
        nodes = [trainer, validator, *workers]
        pace = max(1.0, (trio.current_time() - started) / START_ALONE_S)
        phase(f"{N} nodes started (pace {pace:.2f})")
        await wait_until(lambda: all(n.peers_by_role().get("trainer") for n in workers), 180 * pace)
        phase("every worker knows the trainer")

        # Formed: the trainer (dialed by everyone) and the popular workers trimmed, and every
        # node is at or under the high water mark.
        def formed() -> bool:
            return sum(n.connections.stats.trims for n in nodes) > 0 and max(counts(nodes)) <= (
                BOUNDS.high
            )

        await wait_until(formed, 120 * pace, poll=0.5)
        phase(f"formed: at most {max(counts(nodes))} connections a node")
        formed_at = [n.connections.stats.trims for n in nodes]

        # An announcement reaches every node (mesh and flood publishing) while the counts are
        # sampled: none goes over the high water mark.
        peaks: list[int] = []

        async def sample() -> None:
            while True:
                peaks.append(max(counts(nodes)))
                await trio.sleep(0.2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            await trainer.announce_policy(1, b"\x01" * 32)
            await wait_until(lambda: all(n.policy.version == 1 for n in nodes), 60 * pace)
            phase("every node heard the announcement")
            await trio.sleep(0)  # at least one sample after the last node heard it
            peaks.append(max(counts(nodes)))
            nursery.cancel_scope.cancel()
        assert peaks and max(peaks) <= BOUNDS.high, (peaks, counts(nodes))

        # Nobody trimmed a peer it protects (its bootstrap peer, the trainer).
        for n in nodes:
            protected = n._protected_peers()
            assert not set(n.connections.stats.recent) & protected, n.connections.status()
        status = workers[0].status()["connections"]
        assert status["high"] == BOUNDS.high and status["connections"] <= BOUNDS.high

        # A node that joins now fetches a version from several peers.
        stores = {i: ShardStore(tmp_path / f"store-{i}") for i in range(N + 1)}
        signed = publish(
            # Big enough that the newcomer's fetch outlasts finding a second holder (its peers
            # are a sample of the run, and a provider-record lookup takes a second or two
            # here): 2 MB came from one peer in 0.3 s. A real version is hundreds of MB, and a
            # fetch asks the records again while it lasts (``fetch.RECRUIT_MAX_S``).
            checkpoint(tmp_path / "policy.safetensors", VERSION_BYTES),
            key=net.trainer_keys[0],
            genesis=net.genesis,
            version=2,
            store=stores[0],
            shard_size=65_536,
        )
        # HOLDERS workers hold v2: the first copies it from the trainer over the swarm (a
        # node at its cap fetching from a trainer at its cap); the others' copies are written
        # here, which saves the suite their transfers (all 30 nodes share one core).
        data = (stores[0].directory(2) / "data").read_bytes()
        for i in range(2, HOLDERS + 1):
            stores[i] = seeder_store(tmp_path / f"store-{i}", signed, data)
        fresh = await net.node("inference", connections=BOUNDS)
        async with trio.open_nursery() as services:
            # Every worker serves what it holds (as `join` does).
            served = [
                await services.start(_serve, w, net, stores[i])
                for i, w in enumerate(workers, start=1)
            ]
            async with ShardcastService.start(trainer, net.genesis, stores[0]) as origin:
                await origin.advertise(2)
                # The trainer, at its cap, refuses new connections until it trims: the copy
                # may take a few tries.
                with within(60, "a worker's copy from the trainer"):
                    while True:
                        try:
                            await served[0].fetch(2, only=[trainer.peer_id])
                            break
                        except PeerError as exc:
                            phase(f"a copy failed: {exc}; {room(workers[0])}, {room(trainer)}")
                            await trio.sleep(1.0)
                phase("a worker copied the version from the trainer")
                async with trio.open_nursery() as placing:  # as a fetch does once complete
                    for h in served[1:HOLDERS]:
                        placing.start_soon(h.advertise, 2)
                phase(f"{HOLDERS} workers hold the version")
                # ... and their provider records are placed (the fetched copy's in the
                # background: a DHT walk of seconds at a cap of 12). Asked by the validator,
                # so that the newcomer's own lookup stays its own.
                key = version_provider_key(run_id_of(net.genesis), 2)
                holder_ids = {w.peer_id for w in workers[:HOLDERS]}
                # At caps of 12 (tighter than the DHT's 20 closest), a record placed while
                # the closest peers sat at their caps reached too few of them: in 2 of 10
                # runs the validator did not find 2 in 60 s. Every 15 s the holders place
                # theirs again (a node places it once; docs/RELIABILITY.md, section 5).
                with within(90, f"the records naming {MIN_SOURCES} holders"):
                    asked_since = trio.current_time()
                    while True:
                        try:
                            named = set(
                                await validator.overlay.records.find_providers(key, walk=True)
                            )
                        except NetworkError:
                            named = set()
                        if len(named & holder_ids) >= MIN_SOURCES:
                            break
                        if trio.current_time() - asked_since > 15:
                            phase(f"the records name {len(named & holder_ids)}: placed again")
                            async with trio.open_nursery() as placing:
                                for h in served[:HOLDERS]:
                                    placing.start_soon(h.advertise, 2)
                            asked_since = trio.current_time()
                        await trio.sleep(0.5)
                phase(f"the records name {len(named & holder_ids)} of them")
            # The trainer stops serving (as one that restarts does): the newcomer's copy must
            # come from the workers, which its sample of the run may not hold, dialed at its
            # own cap. An idle trainer served the 16 MB in 3 s, sooner than the newcomer found
            # the holders in some runs (a CI run's newcomer took all 245 shards from it).
            await wait_until(lambda: fresh.peers_by_role().get("trainer"), 60 * pace)
            newcomer = await services.start(_serve, fresh, net, stores[N])
            # The holders may sit at their cap for a moment after their own copies (a
            # connection is not trimmed in its first 10 s): the newcomer tries again, as a
            # node's policy feed does (a CI run's newcomer was refused by all 4 at once).
            # The newcomer's own room while it fetches, each time it is at its cap: its dials
            # to holders were refused there, two dials at once having closed the same
            # connection for their room (docs/RELIABILITY.md, section 4).
            at_cap: list[tuple[float, tuple[str, int, int, int, int, int, int, list[str]]]] = []

            async def watch_newcomer() -> None:
                while True:
                    if fresh.connections.count() >= BOUNDS.high:
                        at_cap.append((round(trio.current_time() - started, 1), room(fresh)))
                    await trio.sleep(0.25)

            def newcomer_state() -> str:
                fetching = newcomer.progress.view() if newcomer.progress is not None else None
                return (
                    f"its fetch {fetching}; polled for nothing {sorted(newcomer.expendable())};"
                    f" its room {room(fresh)}; at its cap {at_cap[-3:]}"
                )

            with within(60, "the newcomer's fetch", newcomer_state):
                async with trio.open_nursery() as watching:
                    watching.start_soon(watch_newcomer)
                    while True:
                        try:
                            got = await newcomer.fetch(2)
                            break
                        except PeerError as exc:
                            phase(f"the newcomer's fetch failed: {exc}")
                            await trio.sleep(1.0)
                    watching.cancel_scope.cancel()
            phase(f"the newcomer at its cap, sampled every 0.25 s: {at_cap[:12]}")
            board = [
                (p["peer"][-8:], p["shards"], p["failures"], p["last_error"])  # type: ignore[index]
                for p in got.progress.peers()
            ]
            holders = [room(h) for h in [trainer, *workers[:HOLDERS]]]
            # Printed whole (an assertion's message is cut short): (peer, shards, failures,
            # last error) of the newcomer's board; each holder's ``room``.
            phase(f"the newcomer fetched it: {board}; holders {holders}")
            sources = [p for p in got.progress.peers() if int(p["shards"]) > 0]  # type: ignore[call-overload]
            assert len(sources) >= 2, (board, holders)
            assert {p["peer"] for p in sources} <= holder_ids, board  # not the trainer
            assert fresh.connections.count() <= BOUNDS.high
            services.cancel_scope.cancel()
        print(
            f"N={N}: connections per node {sorted(counts(nodes))}; trims by formation"
            f" {sum(formed_at)}, after {sum(n.connections.stats.trims for n in nodes)};"
            f" the fresh node fetched from {len(sources)} peers"
        )


def room(node: Node) -> tuple[str, int, int, int, int, int, int, list[str]]:
    """A holder's connections: (peer, connections, could let go now, could let go for a
    connection arriving, protected, young, in use, the transfer protocols open)."""
    t = node.connections
    peers = [str(p) for p in node.overlay.host.get_connected_peers()]
    ages = t._ages(peers)
    keep = set(node._protected_peers())
    busy = []
    for p in peers:
        for conn in node.overlay.host.get_network().get_connections(ID.from_base58(p)):
            for stream in conn.get_streams():
                protocol = str(stream.get_protocol() or "")
                if not protocol.startswith(IDLE_PROTOCOLS):
                    busy.append(protocol[-24:] or "(negotiating)")
    return (
        node.peer_id[-8:],
        t.count(),
        len(t.candidates()),
        len(t.candidates(wanted=True)),
        len(keep & set(peers)),
        sum(1 for p in peers if ages[p] < BOUNDS.grace_s),
        sum(1 for p in peers if t.in_use(p)),
        busy,
    )


async def _serve(
    node: Node,
    net: NetFactory,
    store: ShardStore,
    *,
    task_status: trio.TaskStatus[ShardcastService] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with ShardcastService.start(node, net.genesis, store) as service:
        task_status.started(service)
        await trio.sleep_forever()
