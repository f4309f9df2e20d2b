"""``SwarmGossipSub`` grafts opportunistically as GossipSub v1.1 says (every 60 heartbeats, only
peers above the mesh's median score) and does not churn its mesh: py-libp2p 0.8.1 grafted 2
peers per topic on every heartbeat and replaced mesh peers by score, 4,313 GRAFTs and 4,270
PRUNEs in 20 s of an idle 100-node swarm (docs/BENCHMARKS.md, Scale)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11

from swarm.identity import NodeKey
from swarm.net.gossipsub import OPPORTUNISTIC_GRAFT_PEERS, OPPORTUNISTIC_GRAFT_TICKS, SwarmGossipSub

TOPIC = "t"


class Scores:
    """A scorer stand-in: fixed scores by peer, joins recorded."""

    def __init__(self, scores: dict[ID, float]) -> None:
        self.scores = scores
        self.joined: list[ID] = []

    def score(self, peer: ID, topics: list[str]) -> float:
        return self.scores.get(peer, 0.0)

    def on_join_mesh(self, peer: ID, topic: str) -> None:
        self.joined.append(peer)


def peers(n: int) -> list[ID]:
    return [ID.from_base58(NodeKey.generate().peer_id) for _ in range(n)]


def gossipsub(mesh: list[ID], others: list[ID], scores: dict[ID, float]) -> SwarmGossipSub:
    gs = SwarmGossipSub([PROTOCOL_ID_V11], degree=6, degree_low=4, degree_high=12)
    gs.pubsub = SimpleNamespace(peer_topics={TOPIC: set(mesh) | set(others)})  # type: ignore[assignment]
    gs.mesh = {TOPIC: set(mesh)}
    gs.scorer = Scores(scores)  # type: ignore[assignment]
    return gs


def run_ticks(gs: SwarmGossipSub, ticks: int) -> list[tuple[int, list[ID]]]:
    """Run ``ticks`` heartbeats' opportunistic grafting; the (tick, grafted peers) with any."""
    out = []
    for tick in range(1, ticks + 1):
        to_graft: defaultdict[ID, list[str]] = defaultdict(list)
        if gs._perform_opportunistic_grafting(TOPIC, to_graft):
            out.append((tick, list(to_graft)))
    return out


def test_zero_scores_never_graft_opportunistically() -> None:
    mesh, others = peers(6), peers(20)
    gs = gossipsub(mesh, others, {})
    assert run_ticks(gs, 3 * OPPORTUNISTIC_GRAFT_TICKS) == []
    assert gs.mesh[TOPIC] == set(mesh)


def test_a_penalised_mesh_takes_better_peers_once_every_60_heartbeats() -> None:
    mesh, better, worse = peers(6), peers(5), peers(5)
    backing_off = better[0]
    scores = {p: -5.0 for p in mesh} | {p: -10.0 for p in worse} | {p: 0.0 for p in better}
    gs = gossipsub(mesh, better + worse, scores)
    gs.back_off = {TOPIC: {backing_off: 2**40}}  # in back-off until far in the future
    grafts = run_ticks(gs, 2 * OPPORTUNISTIC_GRAFT_TICKS)
    assert [tick for tick, _ in grafts] == [
        OPPORTUNISTIC_GRAFT_TICKS,
        2 * OPPORTUNISTIC_GRAFT_TICKS,
    ]
    for _, grafted in grafts:
        assert len(grafted) == OPPORTUNISTIC_GRAFT_PEERS
        assert set(grafted) <= set(better) - {backing_off}
    assert gs.mesh[TOPIC] == set(mesh) | {p for _, g in grafts for p in g}


def test_mesh_peers_are_not_replaced_by_score() -> None:
    mesh, others = peers(6), peers(6)
    scores = {p: -1.0 for p in mesh} | {p: 5.0 for p in others}
    gs = gossipsub(mesh, others, scores)
    trio.run(gs._maintain_mesh_quality, TOPIC)
    assert gs.mesh[TOPIC] == set(mesh)
