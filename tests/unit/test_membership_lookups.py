"""Which adverts discovery looks up (``Membership.discover``): a connected provider is asked
(one request to it); an unconnected one costs a DHT walk, so it is skipped once we know
``ENOUGH_PEERS`` of its role. Any provider whose lookup found nothing is skipped for
``MISS_RETRY_S``. At N = 100 repeated walks for unconnected providers were most of an idle
swarm's DHT traffic, and on a saturated box the direct asks that timed out were repeated every
round."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from swarm.identity import NodeKey
from swarm.messages import RoleAdvert, Signed, sign
from swarm.net.membership import ENOUGH_PEERS, MISS_RETRY_S, Membership
from swarm.net.names import role_provider_key

RUN = "ab" * 16
NOW_MS = 1_700_000_000_000


def advert(key: NodeKey, role: str = "inference") -> Signed[RoleAdvert]:
    return sign(
        RoleAdvert(
            run_id=RUN,
            peer_id=key.peer_id,
            role=role,  # type: ignore[arg-type]
            software="swarm-node",
            addrs=(f"/ip4/127.0.0.1/tcp/4001/p2p/{key.peer_id}",),
            issued_at=NOW_MS,
            expires_at=NOW_MS + 3_600_000,
            capabilities={},
        ),
        key,
    )


@dataclass
class FakeOverlay:
    """Providers of the inference role, which of them we are connected to, which adverts the
    DHT holds; every advert lookup recorded."""

    providers: list[str]
    connected_to: set[str]
    adverts: dict[str, Signed[RoleAdvert]]
    trainers: list[str] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)
    config: Any = field(default_factory=lambda: SimpleNamespace(clock=lambda: NOW_MS))

    @property
    def records(self) -> FakeOverlay:  # the DhtRecords half of the overlay, faked here too
        return self

    async def find_providers(self, key: str) -> list[str]:
        if key == role_provider_key(RUN, "trainer"):
            return self.trainers
        return self.providers if key == role_provider_key(RUN, "inference") else []

    def connected(self, peer: str) -> bool:
        return peer in self.connected_to

    async def get_advert(self, run_id: str, peer: str) -> Signed[RoleAdvert] | None:
        self.asked.append(peer)
        return self.adverts.get(peer)


def membership(overlay: FakeOverlay) -> Membership:
    me = NodeKey.generate()
    return Membership(
        overlay,  # type: ignore[arg-type]
        me,
        RUN,
        "inference",
        trainers=overlay.trainers,
        validators=(),
    )


def test_unconnected_providers_are_not_walked_for_once_enough_are_known() -> None:
    keys = [NodeKey.generate() for _ in range(ENOUGH_PEERS + 10)]
    ids = [k.peer_id for k in keys]
    connected = set(ids[ENOUGH_PEERS:])  # the last 10 are connected
    overlay = FakeOverlay(ids, connected, {k.peer_id: advert(k) for k in keys})
    m = membership(overlay)
    # We know ENOUGH_PEERS, from earlier rounds, but none of them fresh: all are due again.
    m._peers = {k.peer_id: advert(k) for k in keys[:ENOUGH_PEERS]}
    m._fresh = lambda peer: False  # type: ignore[method-assign]
    trio.run(m.discover)
    assert sorted(overlay.asked) == sorted(connected)  # no walk for an unconnected provider
    assert len(m.peers_by_role()["inference"]) == ENOUGH_PEERS + 10


def test_below_enough_every_provider_is_looked_up() -> None:
    keys = [NodeKey.generate() for _ in range(5)]
    overlay = FakeOverlay([k.peer_id for k in keys], set(), {k.peer_id: advert(k) for k in keys})
    m = membership(overlay)
    trio.run(m.discover)
    assert sorted(overlay.asked) == sorted(k.peer_id for k in keys)
    assert len(m.peers_by_role()["inference"]) == 5


def test_a_provider_whose_advert_was_not_found_is_retried_only_after_a_while() -> None:
    lost, found = NodeKey.generate(), NodeKey.generate()
    overlay = FakeOverlay([lost.peer_id, found.peer_id], set(), {found.peer_id: advert(found)})
    m = membership(overlay)
    clock = trio.testing.MockClock()

    async def rounds() -> None:
        await m.discover()
        assert overlay.asked == [lost.peer_id, found.peer_id]
        clock.jump(MISS_RETRY_S / 2)
        await m.discover()  # ``found`` is fresh now, ``lost`` missed a moment ago
        assert overlay.asked == [lost.peer_id, found.peer_id]
        overlay.connected_to.add(lost.peer_id)
        await m.discover()  # connected now, but its lookup failed a moment ago: not yet
        assert overlay.asked == [lost.peer_id, found.peer_id]
        clock.jump(MISS_RETRY_S / 2 + 1)
        await m.discover()  # asked directly once the miss is old enough
        assert overlay.asked == [lost.peer_id, found.peer_id, lost.peer_id]
        overlay.connected_to.clear()
        clock.jump(MISS_RETRY_S + 1)
        await m.discover()
        assert overlay.asked == [lost.peer_id, found.peer_id, lost.peer_id, lost.peer_id]

    trio.run(rounds, clock=clock)
    assert math.isfinite(MISS_RETRY_S)


def test_a_trainer_whose_advert_was_not_found_is_looked_up_every_round() -> None:
    trainer = NodeKey.generate()
    overlay = FakeOverlay([], set(), {}, trainers=[trainer.peer_id])
    m = membership(overlay)

    async def rounds() -> None:
        await m.discover()
        await m.discover()  # missed a moment ago, looked up again all the same
        assert overlay.asked == [trainer.peer_id, trainer.peer_id]
        overlay.adverts[trainer.peer_id] = advert(trainer, "trainer")
        await m.discover()
        assert m.peers_by_role()["trainer"] == [trainer.peer_id]

    trio.run(rounds)


def test_each_role_slows_on_its_own_pace_and_a_settled_one_to_32x() -> None:
    """The trainer known with a fresh advert: its role settles at 32x (connected or not: a
    trainer with bounded connections trims most of a swarm). The genesis validator never
    came: its role stays at 8x, without holding the other roles at that pace. Inference
    nodes (an open role) back off to 32x while nothing new turns up, though fewer than
    ``enough_peers`` are known (a swarm that small never settles the role), and a new one
    found brings the base pace back. Once the trainer's advert is past half its life, its
    role is searched again within a base step."""
    trainer, validator = NodeKey.generate(), NodeKey.generate()
    overlay = FakeOverlay([], set(), {}, trainers=[trainer.peer_id])
    me = NodeKey.generate()
    m = Membership(
        overlay,  # type: ignore[arg-type]
        me,
        RUN,
        "inference",
        trainers=[trainer.peer_id],
        validators=[validator.peer_id],
    )
    m._peers = {trainer.peer_id: advert(trainer, "trainer")}
    rounds: dict[str, list[float]] = {"trainer": [], "validator": [], "inference": []}
    joins: list[NodeKey] = []  # an inference node that the next lookup of the role finds

    async def discover(roles: Any) -> dict[str, list[str]]:
        for role in roles:
            rounds[role].append(trio.current_time())
        if "inference" in roles:
            for key in joins:
                m._peers[key.peer_id] = advert(key)
            joins.clear()
        return {}

    async def nothing() -> None:
        pass

    m.discover = discover  # type: ignore[method-assign]
    m.publish = nothing  # type: ignore[method-assign]
    m.check_duplicate = nothing  # type: ignore[assignment, method-assign]
    base = m.config.discover_every_s

    def gaps(role: str, after: float = -1.0) -> list[float]:
        times = [t for t in rounds[role] if t > after]
        return [b - a for a, b in itertools.pairwise(times)]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(m.run)
            await trio.sleep(1000.0)
            assert max(gaps("trainer")) == base * 2**5  # settled: 96 s between two rounds
            assert max(gaps("validator")) == base * 2**3  # never found: 24 s
            assert max(gaps("inference")) == base * 2**5  # nothing new, though few are known
            joins.append(NodeKey.generate())
            found_at = trio.current_time()
            await trio.sleep(400.0)
            found = [t for t in rounds["inference"] if t > found_at]
            assert found[1] - found[0] == base  # found one: the base pace again
            assert max(gaps("inference", found_at)) == base * 2**5
            stale_at = trio.current_time()
            overlay.config.clock = lambda: NOW_MS + 3_600_000 // 2 + 1  # half its life gone
            await trio.sleep(60.0)
            nursery.cancel_scope.cancel()
            after = [t for t in rounds["trainer"] if t > stale_at]
            assert after and after[0] - stale_at <= base  # searched again within 3 s
            assert all(g <= base * 2**3 for g in gaps("trainer", stale_at))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_node_with_a_low_mark_of_8_stops_hurrying_at_8_peers() -> None:
    keys = [NodeKey.generate() for _ in range(10)]
    overlay = FakeOverlay([k.peer_id for k in keys], set(), {k.peer_id: advert(k) for k in keys})
    m = membership(overlay)
    m.config.enough_peers = 8
    m._peers = {k.peer_id: advert(k) for k in keys[:8]}
    trio.run(m.discover)
    assert overlay.asked == []  # 8 known: the unconnected providers cost a walk each
    assert m.settled("inference")


class _ProviderStore:
    """The closest peers' answers to a provider lookup: (seconds, providers), or None for a
    peer that never answers (gone behind a NAT that drops our SYN)."""

    def __init__(self, answers: dict[str, tuple[float, list[str]] | None]) -> None:
        self.answers = answers
        self.added: list[str] = []

    def get_providers(self, raw: bytes) -> list[Any]:
        return []

    def add_provider(self, raw: bytes, info: Any) -> None:
        self.added.append(str(info.peer_id))

    async def _get_providers_from_peer_with_closers(self, peer: str, raw: bytes) -> Any:
        answer = self.answers[peer]
        if answer is None:
            await trio.sleep_forever()
        assert answer is not None
        await trio.sleep(answer[0])
        return [SimpleNamespace(peer_id=p) for p in answer[1]], []


async def test_a_provider_lookup_does_not_wait_out_a_gone_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from swarm.net import dht_records
    from swarm.net.dht_records import DhtRecords

    store = _ProviderStore({"near": (0.01, ["x"]), "slow": (0.5, ["y"]), "gone": None})
    dht = SimpleNamespace(
        provider_store=store,
        routing_table=SimpleNamespace(
            find_local_closest_peers=lambda raw, n: ["near", "slow", "gone", "me"]
        ),
    )
    host = SimpleNamespace(get_id=lambda: "me")
    records = DhtRecords(host, dht, lambda: NOW_MS, lambda peer: False)
    started = trio.current_time()
    assert sorted(await records.find_providers("ab")) == ["x", "y"]
    took = trio.current_time() - started
    assert took < dht_records._QUERY_TIMEOUT_S / 2, took  # the first answer, then the settle
    assert store.added == ["x", "y"]

    # Nobody answers: the query timeout bounds it; everyone done early: no settle to wait.
    store.answers = {"near": None, "slow": None, "gone": None}
    started = trio.current_time()
    assert await records.find_providers("ab") == []
    assert trio.current_time() - started == dht_records._QUERY_TIMEOUT_S
    # A peer that fails at once answers with none (py-libp2p catches its own errors): the
    # peers that hold the records still get their time.
    store.answers = {"near": (0.0, []), "slow": (1.5, ["y"]), "gone": None}
    assert await records.find_providers("ab") == ["y"]
    store.answers = {"near": (0.01, ["x"]), "slow": (0.02, []), "gone": (0.03, [])}
    started = trio.current_time()
    assert await records.find_providers("ab") == ["x"]
    assert trio.current_time() - started < 0.1


async def test_a_provider_lookup_walks_the_dht_only_when_asked_and_the_closest_we_know_name_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A newcomer's routing table is a sample of a run with bounded connections: the closest
    peers it knows may not be those the providers placed their records at."""
    from swarm.net.dht_records import _ASK_WALKED, DhtRecords

    far = [f"far-{i}" for i in range(12)]
    store = _ProviderStore({"near": (0.01, []), "me": (0.0, []), **{p: (0.01, []) for p in far}})
    store.answers["far-3"] = (0.01, ["holder"])
    walks: list[bytes] = []

    async def walk(raw: bytes) -> list[str]:
        walks.append(raw)
        return ["me", "near", *far]

    dht = SimpleNamespace(
        provider_store=store,
        routing_table=SimpleNamespace(find_local_closest_peers=lambda raw, n: ["near", "me"]),
        peer_routing=SimpleNamespace(find_closest_peers_network=walk),
    )
    records = DhtRecords(SimpleNamespace(get_id=lambda: "me"), dht, lambda: NOW_MS, lambda p: False)
    assert await records.find_providers("ab") == []  # not asked to walk: no walk
    assert walks == []
    assert await records.find_providers("ab", walk=True) == ["holder"]
    assert walks == [b"\xab"]
    # Found among the closest we know: no walk.
    store.answers["near"] = (0.01, ["other"])
    assert await records.find_providers("ab", walk=True) == ["other"]
    assert len(walks) == 1
    # The walk's peers past ``_ASK_WALKED`` (and the ones asked already) are not asked.
    store.answers["near"] = (0.01, [])
    store.answers["far-3"] = (0.01, [])
    store.answers[far[_ASK_WALKED]] = (0.01, ["too-far"])
    assert await records.find_providers("ab", walk=True) == []
    # A failed walk is no lookup error: nothing found.

    async def broken(raw: bytes) -> list[str]:
        raise RuntimeError("no peers")

    dht.peer_routing.find_closest_peers_network = broken
    assert await records.find_providers("ab", walk=True) == []

    async def hangs(raw: bytes) -> list[str]:
        await trio.sleep_forever()
        raise AssertionError

    from swarm.net.dht_records import _WALK_TIMEOUT_S

    dht.peer_routing.find_closest_peers_network = hangs
    started = trio.current_time()
    assert await records.find_providers("ab", walk=True) == []
    assert trio.current_time() - started < _WALK_TIMEOUT_S + 1  # the local asks, the walk
