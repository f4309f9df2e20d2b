"""Networking on py-libp2p (trio): host, DHT records, gossip validation, streams, membership.

Modules, each one thing:

- ``names``: topic names, DHT keys and stream protocol ids of a run;
- ``host``: a libp2p host whose peer ID is the node key's, and address parsing;
- ``records``: the RoleAdvert DHT record validator;
- ``gossip``: topic gates (policy, ledger), ``PolicyTracker``, counters by reason;
- ``streams``: length-framed request/response with size limits and deadlines;
- ``dial``: bootstrap dialing with backoff and per-address reasons;
- ``paths``: the two IP addresses of a direct connection (for SHARDCAST's data channel);
- ``reach``: reachability by dial-back from a fresh host (``/swarm-node/dialback/1``);
- ``relay``: circuit relay v2 hop with limits, explicit reservations, circuit dials, DCUtR;
- ``overlay``: host + DHT + GossipSub + relays + ping, started and stopped together;
- ``membership``: publish our RoleAdvert and provider record, find peers by role.

libp2p types never cross this package's public functions except as ``Any`` handles
(``Overlay.host``), and libp2p errors are translated into ``swarm.errors``.
"""

from swarm.net.dial import DialPolicy, DialReport, dial_bootstrap
from swarm.net.gossip import (
    LEDGER_MAX_BYTES,
    POLICY_MAX_BYTES,
    REASONS,
    GossipStats,
    LedgerGate,
    PolicyConflict,
    PolicyGate,
    PolicyTracker,
    Refused,
)
from swarm.net.host import (
    HostLimits,
    build_host,
    key_pair,
    parse_multiaddr,
    parse_peer_addr,
    peer_ids,
    peer_of,
    wanted_dials,
)
from swarm.net.membership import ENOUGH_PEERS, Membership, MembershipConfig, authorize
from swarm.net.names import (
    advert_key,
    ledger_topic,
    parse_topic,
    policy_topic,
    role_provider_key,
    stream_protocol,
)
from swarm.net.overlay import KEEP_CONNECTED_S, Overlay, OverlayConfig
from swarm.net.paths import DirectPath, same_ip
from swarm.net.records import RoleAdvertValidator, check_advert
from swarm.net.streams import StreamLimits, StreamServer, request, serve

__all__ = [
    "ENOUGH_PEERS",
    "KEEP_CONNECTED_S",
    "LEDGER_MAX_BYTES",
    "POLICY_MAX_BYTES",
    "REASONS",
    "DialPolicy",
    "DialReport",
    "DirectPath",
    "GossipStats",
    "HostLimits",
    "LedgerGate",
    "Membership",
    "MembershipConfig",
    "Overlay",
    "OverlayConfig",
    "PolicyConflict",
    "PolicyGate",
    "PolicyTracker",
    "Refused",
    "RoleAdvertValidator",
    "StreamLimits",
    "StreamServer",
    "advert_key",
    "authorize",
    "build_host",
    "check_advert",
    "dial_bootstrap",
    "key_pair",
    "ledger_topic",
    "parse_multiaddr",
    "parse_peer_addr",
    "parse_topic",
    "peer_ids",
    "peer_of",
    "policy_topic",
    "request",
    "role_provider_key",
    "same_ip",
    "serve",
    "stream_protocol",
    "wanted_dials",
]
