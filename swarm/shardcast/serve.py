"""Answering providers' requests from the shard store, whatever carries them.

``ShardServer`` is the transport-free half of serving: it finds a version's manifest, says which
shards this node holds (complete versions and verified shards of versions still being fetched:
every holder serves), checks a requested span against the manifest, and issues one-time data
channel tokens. The data channel and the libp2p stream handlers call it; every refusal is a
``SwarmError`` whose text goes back to the asker, and none of them affects the server.

Upload slots (``max_uploads``): at most that many spans are being sent at once; a request past
them is refused with ``PeerBusy`` (no fault: the asker takes the shard from another holder or
asks again shortly). Without them every receiver pulls from the first holder, the trainer, at
once, each at 1/N of its rate, and nobody holds a whole shard to pass on until late: on 25
loopback nodes the trainer served 45% of all bytes (docs/BENCHMARKS.md, Scale). With a few
slots, the first receivers get whole shards fast and serve them to the rest.

Super-seeding (``seed_copies``, for the versions this node signed: the origin): the origin
grants shard ``i`` to its first ``seed_copies`` askers, and after that only when nobody was
granted it for ``seed_stale`` seconds (a receiver whose peers cannot serve it still gets it),
or when the origin is not contended (fewer than ``seed_busy`` uploads running: an idle uplink
serves whatever is asked; on a loaded box, where the receivers' processes are the bottleneck,
a strict origin starved them). Anything else is refused with ``ShardElsewhere``: no fault, the
asker takes that shard from a peer and asks the origin for another one, so the origin's busy
upload goes to the shards nobody holds yet. On 25-50 loopback nodes the origin served 53-73%
of the bytes without it (docs/BENCHMARKS.md, Scale).

Waiting ``have`` (``wait_have``): an asker says how many shards it knows we hold; the answer
comes as soon as we hold more (a shard verified here: ``changed``) or after ``wait`` seconds.
That is the push of new holdings to the peers that asked, over the asker's own request, so no
one polls, and a receiver learns of a new shard at its source within a round trip.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from swarm.errors import MalformedError, NotAuthorizedError, PeerError
from swarm.shardcast.source import BUSY, ELSEWHERE, PeerBusy, ShardElsewhere, ShardNotHeld
from swarm.shardcast.store import ShardStore, VersionFile

TOKEN_BYTES = 16
MAX_TOKENS = 4096
MAX_HAVE_WAIT = 10.0
"""The longest a ``have`` answer is held back waiting for a new shard (below stream timeouts)."""
HAVE_RECHECK = 0.5
MAX_WAITING = 32
"""``have`` answers held back at once; past that they are answered at once (the asker polls)."""


@dataclass(frozen=True, slots=True)
class ShardSpan:
    """A validated request: read ``length`` bytes at ``offset`` of the version's data file."""

    fd: int
    offset: int
    length: int


class ShardServer:
    """Serves one store. Safe to share between the data channel and libp2p handlers."""

    def __init__(
        self,
        store: ShardStore,
        *,
        token_ttl: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_uploads: int | None = None,
        origin: str | None = None,
        seed_copies: int | None = None,
        seed_stale: float = 10.0,
        seed_busy: int | None = None,
    ) -> None:
        self.store = store
        self.max_uploads = max_uploads
        self.origin = origin
        """Our peer id: versions signed by it are super-seeded (``seed_copies``)."""
        self.seed_copies = seed_copies
        self.seed_stale = seed_stale
        self.seed_busy = seed_busy
        """Super-seed only while at least this many uploads run (this one included): an
        origin with idle slots serves any shard. ``None``: always."""
        self._granted: dict[int, list[int]] = {}
        self._last_grant: dict[tuple[int, int], float] = {}
        self.elsewhere_refusals = 0
        self._changed: trio.Event | None = None
        self.waiting = 0
        self.uploading = 0
        self.busy_refusals = 0
        self.token_ttl = token_ttl
        self._clock = clock
        self._open: dict[int, VersionFile] = {}
        self.closed = False
        """Serving ended (``close``): every version is refused as not held. The stream
        handlers stay registered on the host (py-libp2p's, shared by the node's roles)."""
        self._tokens: dict[bytes, tuple[str, float]] = {}
        self.served_bytes = 0
        self.served_shards = 0
        self.manifests_served = 0
        self.refused = 0

    # --- versions --------------------------------------------------------------------------
    def _version(self, version: int) -> VersionFile:
        if self.closed:
            self.refused += 1
            raise ShardNotHeld(f"version {version} is not served here any more")
        vf = self._open.get(version)
        if vf is not None and not self.store.directory(version).exists():
            vf.close()  # pruned by retention
            del self._open[version]
            vf = None
        if vf is None:
            if version < 0 or version not in self.store.versions():
                self.refused += 1
                raise ShardNotHeld(f"version {version} is not held here")
            vf = self.store.open_existing(version)
            self._open[version] = vf
        vf.refresh()
        return vf

    def latest(self) -> int | None:
        """The newest version this node holds any verified shard of."""
        for version in reversed(self.store.versions()):
            with contextlib.suppress(PeerError):
                vf = self._version(version)
                if vf.complete or vf.verified_indices():
                    return version
        return None

    def manifest(self, version: int | None) -> bytes:
        if version is None:
            version = self.latest()
            if version is None:
                raise ShardNotHeld("no version is held here")
        raw = self._version(version).signed.raw
        self.manifests_served += 1
        return raw

    def have(self, version: int) -> bytes | None:
        vf = self._version(version)
        return None if vf.complete else vf.bitmap()

    def _held(self, version: int) -> int:
        """How many shards of ``version`` are held here (0: not held at all)."""
        try:
            bits = self.have(version)
        except ShardNotHeld:
            return 0
        return len(self._version(version).manifest.shard_hashes) if bits is None else sum(bits)

    def changed(self) -> None:
        """A shard was verified here (or a version added): wake the waiting ``have`` answers."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_have(self, version: int, known: int, wait: float) -> bytes | None:
        """``have``, held back until we hold more than the ``known`` shards the asker knows of,
        or ``wait`` seconds (at most ``MAX_HAVE_WAIT``) have passed."""
        if self.waiting >= MAX_WAITING:
            wait = 0.0  # the shard protocol's stream slots are for shard requests too
        self.waiting += 1
        try:
            with trio.move_on_after(min(max(wait, 0.0), MAX_HAVE_WAIT)):
                await self._wait_more(version, known)
        finally:
            self.waiting -= 1
        return self.have(version)

    async def _wait_more(self, version: int, known: int) -> None:
        while known >= 0 and self._held(version) <= known:
            if self._changed is None:
                self._changed = trio.Event()
            # ``changed`` wakes it at once; the look every ``HAVE_RECHECK`` s covers shards
            # verified by a fetch that does not call it (another process).
            with trio.move_on_after(HAVE_RECHECK):
                await self._changed.wait()

    def span(
        self, version: int, index: int, offset: int = 0, length: int | None = None
    ) -> ShardSpan:
        """Check a request for (part of) shard ``index``; ``MalformedError`` for absurd indices,
        offsets or lengths, ``ShardNotHeld`` for what is not (yet) held."""
        vf = self._version(version)
        count = len(vf.manifest.shard_hashes)
        if not 0 <= index < count:
            self.refused += 1
            raise MalformedError(
                f"shard index {index} out of range 0..{count - 1} of version {version}"
            )
        start, size = vf.manifest.shard_span(index)
        if length is None:
            length = size - offset
        if not (0 <= offset <= size and 0 <= length <= size - offset):
            self.refused += 1
            raise MalformedError(
                f"span offset {offset} length {length} outside shard {index} of {size} bytes"
            )
        if not vf.complete and not vf.is_verified(index):
            self.refused += 1
            raise ShardNotHeld(f"shard {index} of version {version} is not held here yet")
        return ShardSpan(vf.data_fd, start + offset, length)

    def grant(self, version: int, index: int, offset: int = 0) -> None:
        """Super-seeding: refuse (``ShardElsewhere``) a shard of our own version that enough
        peers were given already; a request past the shard's start (a piece of a shard being
        fetched over streams) is never refused."""
        if self.seed_copies is None or offset or self.origin is None:
            return
        vf = self._version(version)
        if vf.signed.signer != self.origin:
            return
        granted = self._granted.setdefault(version, [0] * len(vf.manifest.shard_hashes))
        for old in [v for v in self._granted if v < version - 8]:  # bounded memory
            del self._granted[old]
            self._last_grant = {k: t for k, t in self._last_grant.items() if k[0] != old}
        now = self._clock()
        last = self._last_grant.get((version, index), -math.inf)
        contended = self.seed_busy is None or self.uploading >= self.seed_busy
        if granted[index] >= self.seed_copies and now - last < self.seed_stale and contended:
            self.elsewhere_refusals += 1
            raise ShardElsewhere(
                f"{ELSEWHERE}: shard {index} of version {version} went to {granted[index]} peers"
                " already; take it from one of them and ask the origin for another shard"
            )
        granted[index] += 1
        self._last_grant[(version, index)] = now

    def granted(self, version: int) -> list[int]:
        """How many times each shard of our own ``version`` was granted (super-seeding)."""
        return list(self._granted.get(version, []))

    def take_slot(self) -> None:
        """Take an upload slot (give it back with ``release_slot``); ``PeerBusy`` when all
        ``max_uploads`` are taken."""
        if self.max_uploads is not None and self.uploading >= self.max_uploads:
            self.busy_refusals += 1
            raise PeerBusy(
                f"{BUSY}: all {self.max_uploads} upload slots are in use; ask another holder"
            )
        self.uploading += 1

    def release_slot(self) -> None:
        self.uploading = max(0, self.uploading - 1)

    def read(self, version: int, index: int, offset: int = 0, length: int | None = None) -> bytes:
        """The bytes of a span (the libp2p stream path; the data channel uses sendfile)."""
        span = self.span(version, index, offset, length)
        self.take_slot()
        try:
            self.grant(version, index, offset)
            data = os.pread(span.fd, span.length, span.offset)
        finally:
            self.release_slot()
        self.served_bytes += len(data)
        self.served_shards += 1
        return data

    # --- data channel tokens ---------------------------------------------------------------
    def issue_token(self, peer: str) -> bytes:
        """A one-time token that lets ``peer`` open one data channel connection."""
        now = self._clock()
        self._tokens = {t: v for t, v in self._tokens.items() if v[1] > now}
        while len(self._tokens) >= MAX_TOKENS:  # bounded: the oldest offers lapse first
            del self._tokens[next(iter(self._tokens))]
        token = secrets.token_bytes(TOKEN_BYTES)
        self._tokens[token] = (peer, now + self.token_ttl)
        return token

    def redeem_token(self, token: bytes) -> str:
        """The peer a token was issued to; the token is used up. ``NotAuthorizedError`` else."""
        entry = self._tokens.pop(token, None)
        if entry is None or entry[1] <= self._clock():
            self.refused += 1
            raise NotAuthorizedError("unknown or expired data channel token; negotiate a new one")
        return entry[0]

    def close(self) -> None:
        self.closed = True
        for vf in self._open.values():
            vf.close()
        self._open.clear()
