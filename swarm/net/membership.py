"""Who is in a run: publish our signed RoleAdvert and find the others by role.

A node stores its RoleAdvert in the DHT under ``/swarm-node/<run>/advert/<peer>`` and announces
itself as a provider of its role's key; both are refreshed well before the advert expires (a
third of its lifetime, and again whenever our DHT routing table has doubled since we last
published: records stored while the network was small sit at the peers that were closest then,
and a lookup asks only the peers closest now (``_grown``; without it, on 25 loopback nodes,
some never found a trainer that joined before them: docs/BENCHMARKS.md, Scale). Discovery
runs every ``discover_every_s`` (3 s), each role on its own pace: a role's lookups back off to
8x while nothing new of it turns up, and to 32x once it is settled (every trainer, or every
validator, the genesis names known with a fresh advert) or, for an open role, at once.
One more peer of a role we know ``enough_peers`` of does not bring the base pace back
(``hurry``).
Lookups go the other way: providers of a role's key, then each provider's advert, checked
again here (signed by the peer it describes, unexpired, the role it was found under, and for
trainers and validators named by the genesis), because provider records are unsigned and
anyone may claim to provide any key.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from swarm.errors import NotAuthorizedError, SwarmError
from swarm.identity import NodeKey
from swarm.messages import ROLES, Role, RoleAdvert, Signed, sign
from swarm.net.names import role_provider_key
from swarm.net.overlay import Overlay
from swarm.net.records import check_advert

log = logging.getLogger(__name__)

RUN_ROLES: tuple[Role, ...] = tuple(r for r in ROLES if r != "bootstrap")


@dataclass
class MembershipConfig:
    software: str = "swarm-node"
    advert_ttl_s: float = 600.0
    discover_every_s: float = 3.0
    enough_peers: int = 32
    """Peers of one role past which discovery slows down (``ENOUGH_PEERS``; a node with
    bounded connections needs no more than its low water mark: ``node.runtime``)."""
    capabilities: Mapping[str, Any] = field(default_factory=dict)


def authorize(
    role: Role, peer_id: str, trainers: Collection[str], validators: Collection[str]
) -> None:
    """``NotAuthorizedError`` when ``peer_id`` may not hold ``role`` under the genesis."""
    if role == "trainer" and peer_id not in trainers:
        raise NotAuthorizedError(
            f"{peer_id} is not a trainer of this run (the genesis names"
            f" {len(trainers)} trainer(s)); join as --role inference, or ask the run owner"
        )
    if role == "validator" and peer_id not in validators:
        raise NotAuthorizedError(
            f"{peer_id} is not a validator of this run (the genesis names"
            f" {len(validators)} validator(s)); join as --role inference, or ask the run owner"
        )


WITHDRAWN_TTL_S = 2.0
"""Lifetime of the last advert of a node that stops serving its role (``withdraw``)."""


class Membership:
    """Our advert in a run, and the adverts of the peers we found, by role."""

    def __init__(
        self,
        overlay: Overlay,
        key: NodeKey,
        run_id: str,
        role: Role,
        *,
        trainers: Collection[str],
        validators: Collection[str],
        config: MembershipConfig | None = None,
        issued_before: Collection[int] = (),
        on_issue: Callable[[int], None] | None = None,
    ) -> None:
        """``issued_before``: the issue times of this node's adverts in earlier lives (its
        home's), which ``check_duplicate`` knows as its own; ``on_issue`` is told each new
        advert's issue time, to remember it for the next life."""
        authorize(role, key.peer_id, trainers, validators)
        self.overlay = overlay
        self.key = key
        self.run_id = run_id
        self.role = role
        self.trainers = frozenset(trainers)
        self.validators = frozenset(validators)
        self.config = config or MembershipConfig()
        self.mine: Signed[RoleAdvert] | None = None
        self._issued: set[int] = set(issued_before)
        self._on_issue = on_issue
        self._peers: dict[str, Signed[RoleAdvert]] = {}
        self.rejected_adverts = 0
        self.duplicate_warnings: list[str] = []
        self.found = trio.Event()
        self._published_at_size = 0
        """Our routing table's size when we last published (see ``_grown``)."""
        self.withdrawn = False
        """``withdraw()`` was called: our advert is no longer refreshed."""
        self._missed: dict[str, float] = {}
        """Providers whose advert a lookup did not find, and when (see ``discover``)."""

    def make_advert(self, ttl_s: float | None = None) -> Signed[RoleAdvert]:
        """Our advert, valid ``ttl_s`` (default: the configured lifetime)."""
        ttl = self.config.advert_ttl_s if ttl_s is None else ttl_s
        now = self.overlay.config.clock()
        issued = max(now, max(self._issued, default=0) + 1)  # strictly newer than the last
        self._issued.add(issued)
        if self._on_issue is not None:
            self._on_issue(issued)
        advert = RoleAdvert(
            run_id=self.run_id,
            peer_id=self.key.peer_id,
            role=self.role,
            software=self.config.software,
            addrs=tuple(self.overlay.addrs()),
            issued_at=issued,
            expires_at=issued + int(ttl * 1000),
            capabilities=dict(self.config.capabilities),
        )
        return sign(advert, self.key)

    async def withdraw(self) -> None:
        """Stop advertising our role: replace the advert by one that expires within
        ``WITHDRAWN_TTL_S`` and never refresh it again (peers drop us when it expires)."""
        self.withdrawn = True
        signed = self.make_advert(WITHDRAWN_TTL_S)
        try:
            await self.overlay.records.put_advert(signed)
        except SwarmError as exc:
            log.warning("withdrawing our RoleAdvert failed (%s); it expires unrefreshed", exc)
        self.mine = signed

    async def publish(self) -> Signed[RoleAdvert]:
        """Store a fresh advert and our provider record for our role."""
        signed = self.make_advert()
        self._published_at_size = self._table_size()
        # The two DHT walks together (a node's start waits on them): the first error is raised.
        errors: list[SwarmError] = []

        async def put(store: Callable[[], Awaitable[None]]) -> None:
            try:
                await store()
            except SwarmError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(put, partial(self.overlay.records.put_advert, signed))
            key = role_provider_key(self.run_id, self.role)
            nursery.start_soon(put, partial(self.overlay.records.provide, key))
        if errors:
            raise errors[0]
        self.mine = signed
        return signed

    def _table_size(self) -> int:
        try:
            return int(self.overlay.dht.get_routing_table_size())
        except Exception:  # a test double without a DHT
            return 0

    def _grown(self) -> bool:
        """The routing table doubled (by 4 peers at least) since our records were placed: the
        peers closest to our keys are likely others now, so place them again. A node
        republishes O(log N) times while the swarm grows to N, then only on the refresh."""
        size = self._table_size()
        return size >= max(2 * self._published_at_size, self._published_at_size + 4)

    def _accept(self, raw_role: Role, signed: Signed[RoleAdvert]) -> bool:
        advert = signed.message
        if advert.run_id != self.run_id or advert.role != raw_role:
            return False
        try:
            authorize(advert.role, advert.peer_id, self.trainers, self.validators)
        except NotAuthorizedError as exc:
            log.warning("ignoring advert: %s", exc)
            return False
        return True

    async def discover(self, roles: Collection[Role] = RUN_ROLES) -> dict[str, list[str]]:
        """Look ``roles`` up once (every role unless told); returns ``peers_by_role()``.

        A provider we are connected to is asked for its advert directly (one request). One we
        are not connected to costs a DHT walk (about 40 requests), so it is skipped when we
        already know ``enough_peers`` of its role. Either way, a provider whose lookup found
        nothing less than ``MISS_RETRY_S`` ago is skipped. At N = 100, walks for the same
        unconnected providers, round after round, were most of an idle swarm's DHT traffic
        (1,675 of 2,782 DHT streams in 20 s, ``bench/idle.py --nodes 100``); on a saturated box
        the direct asks time out too, and asking again every round kept it saturated (at N = 50,
        13 of 19 direct asks in 20 s timed out while the nodes were still placing their
        records). Trainers and validators are few and each is needed (a trainer that skipped
        another for a minute would publish as if alone): they are looked up every round until
        found."""
        now = trio.current_time()
        self._missed = {p: t for p, t in self._missed.items() if now - t < MISS_RETRY_S}
        for role in roles:
            enough = self._role_counts()[role] >= self.config.enough_peers
            for peer in await self.overlay.records.find_providers(
                role_provider_key(self.run_id, role)
            ):
                if peer == self.key.peer_id or self._fresh(peer):
                    continue
                if peer in self._missed and role not in GENESIS_ROLES:
                    continue
                if enough and not self.overlay.connected(peer):
                    continue
                signed = await self.overlay.records.get_advert(self.run_id, peer)
                if signed is None:
                    self._missed[peer] = trio.current_time()
                if signed is None or not self._accept(role, signed):
                    self.rejected_adverts += 1
                    continue
                known = self._peers.get(peer)
                if known is None or known.message.issued_at < signed.message.issued_at:
                    if known is None:
                        log.info("found %s %s at %s", role, peer, ", ".join(signed.message.addrs))
                    self._peers[peer] = signed
                    self.found.set()
        return self.peers_by_role()

    async def refresh(self, peer: str) -> Signed[RoleAdvert] | None:
        """Fetch ``peer``'s advert again now (its capabilities changed since we read it)."""
        known = self._peers.get(peer)
        if known is None:
            return None
        signed = await self.overlay.records.newest_advert(self.run_id, peer)
        if (
            signed is not None
            and self._accept(known.message.role, signed)
            and known.message.issued_at < signed.message.issued_at
        ):
            self._peers[peer] = signed
            return signed
        return known

    def _fresh(self, peer: str) -> bool:
        """Known with more than half its advert's lifetime left (no need to fetch it again)."""
        known = self._peers.get(peer)
        if known is None:
            return False
        advert = known.message
        return self.overlay.config.clock() < (advert.issued_at + advert.expires_at) // 2

    def peers_by_role(self) -> dict[str, list[str]]:
        """Peers with an unexpired advert, by role (we are not in it)."""
        now = self.overlay.config.clock()
        out: dict[str, list[str]] = {role: [] for role in RUN_ROLES}
        for peer, signed in list(self._peers.items()):
            if signed.message.expires_at <= now:
                log.info("advert of %s %s expired", signed.message.role, peer)
                del self._peers[peer]
                continue
            out[signed.message.role].append(peer)
        return {role: sorted(peers) for role, peers in out.items()}

    async def refresh_advert(self, peer_id: str) -> Signed[RoleAdvert] | None:
        """Look ``peer_id``'s advert up again now (its addresses may have changed: a new relay),
        keeping it when newer; returns what we hold."""
        known = self._peers.get(peer_id)
        signed = await self.overlay.records.newest_advert(self.run_id, peer_id)
        if (
            signed is not None
            and (known is None or known.message.issued_at < signed.message.issued_at)
            and self._accept(signed.message.role, signed)
        ):
            self._peers[peer_id] = signed
        return self._peers.get(peer_id)

    def advert_of(self, peer_id: str) -> Signed[RoleAdvert] | None:
        return self._peers.get(peer_id)

    async def check_duplicate(self) -> str | None:
        """Warn loudly when a live advert for our peer ID, not issued by this node (in this
        life or, per ``issued_before``, an earlier one), is in the DHT: another node runs with
        our key.

        Called before our first advert (``Node`` does, when it has a home) and after each
        refresh. Only the node that started later can tell: py-libp2p's peers keep the newest
        signed peer record of a peer ID and reset every DHT stream that carries an older one
        (``kad_dht.KadDHT.handle_stream``: ``maybe_consume_signed_record`` is False when
        ``Peerstore.consume_peer_record`` rejects a lower ``seq``), so once the later node has
        spoken the earlier one's lookups go unanswered (docs/contributors.md,
        "two-nodes-with-one-key")."""
        now = self.overlay.config.clock()
        for raw in await self.overlay.records.remote_adverts(self.run_id, self.key.peer_id):
            try:
                signed = check_advert(raw, now_ms=now)
            except SwarmError:
                continue
            if signed.message.issued_at in self._issued:
                continue
            mine = set(self.mine.message.addrs) if self.mine else set()
            if set(signed.message.addrs) == mine:
                continue
            warning = (
                f"ANOTHER NODE IS RUNNING WITH THIS KEY ({self.key.peer_id}) at"
                f" {', '.join(signed.message.addrs) or 'unknown addresses'}; two nodes with"
                " one key fight over its records and its ledger balance: stop one of them"
            )
            if warning not in self.duplicate_warnings:
                self.duplicate_warnings.append(warning)
                log.error(warning)
            return warning
        return None

    async def run(self) -> None:
        """Publish now and keep advert, provider record and peer list fresh until cancelled."""
        refresh_every = self.config.advert_ttl_s / 3
        next_refresh = trio.current_time() + (refresh_every if self.mine else 0.0)
        base = self.config.discover_every_s
        quiet: dict[Role, int] = dict.fromkeys(RUN_ROLES, 0)
        next_lookup: dict[Role, float] = dict.fromkeys(RUN_ROLES, trio.current_time())
        while True:
            stale = trio.current_time() >= next_refresh or (self.mine is not None and self._grown())
            if stale and not self.withdrawn:
                try:
                    await self.publish()
                    next_refresh = trio.current_time() + refresh_every
                except SwarmError as exc:
                    log.warning("refreshing our RoleAdvert failed (%s); retrying soon", exc)
                    next_refresh = trio.current_time() + min(5.0, refresh_every)
                await self.check_duplicate()
            due = [r for r in RUN_ROLES if next_lookup[r] <= trio.current_time()]
            before = self._role_counts()
            await self.discover(due)
            # Each role backs off while nothing new of it turns up (3 s, 6 s, ... up to 8x):
            # every node's discovery asks the DHT for 3 roles, and with all 100 nodes of a
            # swarm asking every 3 s the bootstrap peers, which hold the records early on,
            # stopped answering (docs/BENCHMARKS.md, Scale). Something new found starts the
            # role again at the base pace, unless it is one more of a role we know
            # ``enough_peers`` of (``hurry``). A settled role backs off further (to 32x,
            # 96 s): what is left to find is more peers than we use. Each role on its own
            # pace: a genesis validator that never came (or 29 joining workers) kept all three
            # lookups at the fast pace, 12 DHT requests a round, most of an idle node's loop
            # (bench/idle.py --profile, N = 25), and the connections those requests opened were
            # most of the trims of 30 nodes with marks of 8 and 12
            # (tests/integration/test_connection_bounds.py).
            after = self._role_counts()
            for role in due:
                most = QUIET_SETTLED if self._may_rest(role) else QUIET_SEARCHING
                gained = hurry({role: before[role]}, {role: after[role]}, self.config.enough_peers)
                quiet[role] = 0 if gained else min(quiet[role] + 1, most)
                next_lookup[role] = trio.current_time() + base * 2 ** quiet[role]
            # Sleep to the next role due, a base step at a time: a role that stops being
            # settled (a trainer's advert past half its life, say) is searched again at once.
            while (left := min(next_lookup.values()) - trio.current_time()) > 0:
                await trio.sleep(min(left, base))
                for role in RUN_ROLES:
                    if quiet[role] > QUIET_SEARCHING and not self._may_rest(role):
                        quiet[role] = QUIET_SEARCHING
                        next_lookup[role] = trio.current_time()

    def settled(self, role: Role) -> bool:
        """Nothing discovery must find soon for ``role``: every peer the genesis names for it
        (trainers, validators) is known with an advert less than half its life old, or for
        an open role, ``enough_peers`` are known.

        Connections do not count: a trainer with bounded connections trims most of a large
        swarm, and discovery would find nothing new of a peer whose advert is fresh (it is
        skipped) whether we are connected to it or not."""
        if role == "trainer":
            servers: frozenset[str] = self.trainers
        elif role == "validator":
            servers = self.validators
        else:
            return self._role_counts()[role] >= self.config.enough_peers
        return all(self._fresh(p) for p in servers - {self.key.peer_id})

    def _may_rest(self, role: Role) -> bool:
        """May ``role``'s lookups back off past 8x (to 32x) while they find nothing new: a
        settled role, or an open one whatever we know of it. A swarm holding fewer than
        ``enough_peers`` inference nodes never settles that role, and its lookups (each
        answer carrying every provider's signed peer record, which py-libp2p verifies) were
        the largest share of an idle node's loop (``bench/idle.py --profile``, N = 25: 0.83 s
        of 3.0 s);
        a role that gains a peer is searched at the base pace again (``hurry``). Trainers and
        validators are few and each is needed: searched at 8x until found."""
        return role not in GENESIS_ROLES or self.settled(role)

    def _role_counts(self) -> dict[str, int]:
        counts: dict[str, int] = dict.fromkeys(RUN_ROLES, 0)
        for signed in self._peers.values():
            counts[signed.message.role] += 1
        return counts


QUIET_SEARCHING = 3
"""A role's lookups back off to ``discover_every_s * 2**QUIET_SEARCHING`` (8x) while it is not
settled (a genesis trainer or validator still unknown), and to ``2**QUIET_SETTLED`` (32x) once
it is (``Membership.settled``), or at once for an open role (``Membership._may_rest``)."""
QUIET_SETTLED = 5
ENOUGH_PEERS = 32
"""Peers of one role past which finding one more does not quicken discovery: what a node
uses them for (gossip connections, ``node.runtime.MAX_GOSSIP_PEERS``; shard sources, 8 of
them) is served. While 100 nodes joined, each newcomer set every node back to the base pace
(a discovery round every 3 s each, for as long as nodes kept joining)."""


GENESIS_ROLES = ("trainer", "validator")
"""Roles the genesis names: few peers, each of them needed (see ``discover``)."""
MISS_RETRY_S = 60.0
"""A provider whose advert was not found is looked up again after this long at the earliest
(sooner once we are connected to it: then it is asked directly)."""


def hurry(before: Mapping[str, int], after: Mapping[str, int], enough: int = ENOUGH_PEERS) -> bool:
    """Discover again at the base pace: a role gained a peer while we knew fewer than
    ``enough`` of it (a new trainer or validator always counts: there are few)."""
    return any(after.get(role, 0) > n and n < enough for role, n in before.items())
