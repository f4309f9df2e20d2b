"""Our GossipSub: py-libp2p 0.8.1's, brought back to the GossipSub v1.1 spec in three places.

- **Flood publishing**, which py-libp2p lacks: what we originate on a flood topic goes to every
  subscribed peer we are connected to, not only to our mesh.
- **Opportunistic grafting as the spec has it**: every ``OPPORTUNISTIC_GRAFT_TICKS``
  heartbeats, and only peers that score above the mesh's median. py-libp2p grafts 2 peers per
  topic on *every* heartbeat, taking every peer whose score is at least half the median: with
  no score parameters set every score is 0, so every peer qualifies.
- **No mesh "quality maintenance"** (py-libp2p's GossipSub 2.0 extra, in no spec): a PRUNE and
  a GRAFT whenever an outside peer outscores the worst mesh peer, after scoring every
  subscriber on every heartbeat.

Why it matters: in an idle swarm of 100 nodes (``bench/idle.py --nodes 100``) the two extras
sent 4,313 GRAFTs and 4,270 PRUNEs in 20 s. Each heartbeat's grafts pushed meshes past D_hi,
the D_hi prune undid them, and the next heartbeat grafted again. That work, on every node,
kept the box busy with nothing to broadcast (docs/BENCHMARKS.md, Scale).
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from typing import Any

from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub

OPPORTUNISTIC_GRAFT_TICKS = 60
"""Heartbeats between opportunistic grafts (go-libp2p's ``OpportunisticGraftTicks``)."""
OPPORTUNISTIC_GRAFT_PEERS = 2
"""Peers grafted at most per topic at each opportunistic graft (``OpportunisticGraftPeers``)."""
OPPORTUNISTIC_GRAFT_THRESHOLD = 0.0
"""Graft opportunistically only while the mesh's median score is below this. Our topics set no
score parameters, so scores stay 0 and a healthy mesh is left alone; a mesh whose peers earn
penalties (a negative median) takes on better-scoring peers."""


class SwarmGossipSub(GossipSub):
    """GossipSub v1.1 as the module docstring says: flood publishing on ``flood_topics``, the
    spec's opportunistic grafting, no mesh-quality churn.

    Flood publishing: a message we originate goes to every peer subscribed to its topic that
    we are connected to (score gates still apply), not only to our mesh of ``degree`` peers;
    messages we forward go to the mesh as before. For a trainer, whom every node of a run
    dials, an announcement then reaches most nodes in one hop instead of log(N) / log(degree)
    hops, each of which waits for the CPU of a busy node (docs/BENCHMARKS.md, Scale: 33 s to
    95% of 100 nodes before). The cost is one copy of a small message per connected
    subscriber, paid only by the node that publishes, and only for what it publishes itself.
    A receiver validates and forwards it as any gossip message (duplicates stop at its seen
    cache), so the signed-announcement checks are the same.

    Only on ``flood_topics`` (the policy topic: a few small messages per version): a validator
    flooding every verdict to its hundreds of connections would pay for it on every judgement,
    where go-libp2p floods every topic.
    """

    flood_topics: frozenset[str] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._graft_ticks: defaultdict[str, int] = defaultdict(int)

    def _get_peers_to_send(
        self, topic_ids: Any, msg_forwarder: ID, origin: ID, msg_id: bytes | None = None
    ) -> Any:
        peers = set(super()._get_peers_to_send(topic_ids, msg_forwarder, origin, msg_id))
        pubsub = self.pubsub
        if pubsub is None or origin != pubsub.my_id or msg_forwarder != pubsub.my_id:
            return peers
        scorer = self.scorer
        for topic in topic_ids:
            if topic not in self.flood_topics:
                continue
            for peer in pubsub.peer_topics.get(topic, ()):
                if peer == origin or self.peer_protocol.get(peer) is None:
                    continue
                if scorer is not None and scorer.is_graylisted(peer, [topic]):
                    continue
                peers.add(peer)
        return peers

    def _perform_opportunistic_grafting(self, topic: str, peers_to_graft: Any) -> int:
        """Every ``OPPORTUNISTIC_GRAFT_TICKS`` heartbeats of ``topic``: when the median score
        of its mesh is below ``OPPORTUNISTIC_GRAFT_THRESHOLD``, graft up to
        ``OPPORTUNISTIC_GRAFT_PEERS`` peers, picked at random, that score above that median
        and are not backing off. Returns how many were grafted (added to ``peers_to_graft``,
        whose GRAFTs the heartbeat sends)."""
        self._graft_ticks[topic] += 1
        if self._graft_ticks[topic] % OPPORTUNISTIC_GRAFT_TICKS:
            return 0
        scorer, pubsub = self.scorer, self.pubsub
        mesh = self.mesh.get(topic)
        if scorer is None or pubsub is None or not mesh:
            return 0
        median = statistics.median(scorer.score(p, [topic]) for p in mesh)
        if median >= OPPORTUNISTIC_GRAFT_THRESHOLD:
            return 0
        better = [
            p
            for p in pubsub.peer_topics.get(topic, ())
            if p not in mesh
            and not self._check_back_off(p, topic)
            and scorer.score(p, [topic]) > median
        ]
        chosen = random.sample(better, min(OPPORTUNISTIC_GRAFT_PEERS, len(better)))
        for peer in chosen:
            mesh.add(peer)
            self._notify_mesh_peer_added(peer, topic)
            scorer.on_join_mesh(peer, topic)
            peers_to_graft[peer].append(topic)
        return len(chosen)

    async def _maintain_mesh_quality(self, topic: str) -> None:
        """Off: py-libp2p's per-heartbeat peer replacement is in no GossipSub spec and scored
        every subscriber of every topic on every heartbeat (see the module docstring)."""
