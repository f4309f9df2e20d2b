"""Every private name of py-libp2p (and hivemind) this project relies on, in one place, checked
when a node starts (``Overlay.start``), by ``swarm-node doctor`` and by a test that pins them
against the installed versions (tests/unit/test_internals.py).

``libp2p<0.9`` is allowed, and a patch release may rename any of these: each would otherwise
switch a feature off without a word (the DCUtR scan, for one, catches every error of a round
and logs it at debug level). A missing name is a warning in ``status`` (``warnings``) and in
``doctor`` naming the feature that is off; the node runs on.

Class names are checked on the class (a method we override or call); names a library sets on
its instances in ``__init__`` are checked on the live object when there is one (``Overlay``
passes its own), else in the class's ``__init__`` source.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Internal:
    where: str
    """``module:Class``"""
    name: str
    feature: str
    """What is off (or degraded) without it."""
    live: str = ""
    """The key of the live object in ``missing(live=...)`` that holds it (instance names)."""


DCUTR = "libp2p.relay.circuit_v2.dcutr:DCUtRProtocol"
RELAY = "libp2p.relay.circuit_v2.protocol:CircuitV2Protocol"
GOSSIPSUB = "libp2p.pubsub.gossipsub:GossipSub"

LIBP2P: tuple[Internal, ...] = (
    Internal(DCUTR, "_auto_drive_loop", "the cheap scan for relayed connections to hole-punch"),
    Internal(DCUTR, "_in_progress", "hole punching of relayed connections (DCUtR)", "dcutr"),
    Internal(DCUTR, "_direct_connections", "hole punching of relayed connections", "dcutr"),
    Internal(DCUTR, "_hole_punch_attempts", "hole punching of relayed connections", "dcutr"),
    Internal(RELAY, "_active_relays", "the relay's circuit count in status", "relay_hop"),
    Internal(RELAY, "_read_stream_with_retry", "the relay's count of bytes relayed"),
    Internal(
        "libp2p.host.basic_host:BasicHost",
        "multiselect",
        "the guard against a protocol removed during negotiation (it can end the host)",
        "host",
    ),
    Internal(GOSSIPSUB, "_get_peers_to_send", "flood publishing to every subscribed peer"),
    Internal(GOSSIPSUB, "_perform_opportunistic_grafting", "opportunistic grafting's pace"),
    Internal(GOSSIPSUB, "_maintain_mesh_quality", "mesh quality upkeep's pace"),
    Internal(
        GOSSIPSUB, "equivocation_detection", "the trim of gossip's message memory", "gossipsub"
    ),
    Internal(
        "libp2p.kad_dht.value_store:ValueStore",
        "_get_from_peer",
        "direct advert asks to connected DHT servers (lookups walk the DHT instead)",
    ),
    Internal(
        "libp2p.kad_dht.provider_store:ProviderStore",
        "_get_providers_from_peer_with_closers",
        "role lookups from connected peers (they walk the DHT instead)",
    ),
    Internal(
        "libp2p.network.swarm:Swarm",
        "_inbound_limiter",
        "inbound connections after the host's first (max_connections - min_connections):"
        " py-libp2p 0.8.1 holds a slot for the swarm's life (swarm/net/host.py)",
        "network",
    ),
    Internal(
        "libp2p.network.swarm:Swarm",
        "unblock_peer",
        "redialing a restarted peer within py-libp2p's 60 s dial backoff",
    ),
)
PARTIAL_ROUNDS = "telling a partial all-reduce (a peer died mid-round) from a whole one"
HIVEMIND: tuple[Internal, ...] = (
    Internal(
        "hivemind.p2p.p2p_daemon:P2P",
        "_client",
        "connecting trainers' averagers to each other (several trainers cannot average)",
        "p2p",
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager", "_aggregate_with_group", PARTIAL_ROUNDS
    ),
    Internal(
        "hivemind.averaging.averager:DecentralizedAverager",
        "_running_groups",
        PARTIAL_ROUNDS,
        "instance",
    ),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "tensor_part_container",
        PARTIAL_ROUNDS,
        "instance",
    ),
    Internal(
        "hivemind.averaging.allreduce:AllReduceRunner",
        "tensor_part_reducer",
        PARTIAL_ROUNDS,
        "instance",
    ),
    Internal(
        "hivemind.averaging.partition:TensorPartContainer",
        "failed_size",
        PARTIAL_ROUNDS,
        "instance",
    ),
    Internal(
        "hivemind.averaging.partition:TensorPartReducer",
        "sender_failed_after",
        PARTIAL_ROUNDS,
        "instance",
    ),
)


def missing(
    internals: tuple[Internal, ...] = LIBP2P, live: Mapping[str, object] | None = None
) -> list[str]:
    """One line per internal not found: the name, and the feature that is off."""
    out = []
    for item in internals:
        if not _present(item, live or {}):
            out.append(
                f"{item.where.split(':')[0].split('.')[0]} {_version(item.where)} has no "
                f"{item.where.split(':')[1]}.{item.name}: {item.feature} is off"
            )
    return out


def check(
    internals: tuple[Internal, ...] = LIBP2P, live: Mapping[str, object] | None = None
) -> list[str]:
    """``missing``, each logged as a warning."""
    found = missing(internals, live)
    for line in found:
        log.warning("%s (swarm/internals.py)", line)
    return found


def _present(item: Internal, live: Mapping[str, object]) -> bool:
    module, _, name = item.where.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    if hasattr(cls, item.name):
        return True
    if not item.live:
        return False
    obj = live.get(item.live)
    if obj is not None:
        return hasattr(obj, item.name)
    try:
        return f"self.{item.name}" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False


def _version(where: str) -> str:
    from importlib import metadata

    package = where.split(".")[0]
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "(not installed)"
