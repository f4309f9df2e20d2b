"""Every decoder of the wire, as a fuzz target: ``run(data)`` may raise only ``SwarmError``.

A target is a name, a function of one byte string and the valid encodings its mutations start
from. ``check(target, data)`` runs one case and classifies it (``ok``, ``typed``, ``untyped``,
``hang``); the tests assert there are no untyped errors, ``bench/fuzz.py`` counts them.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import trio
from hypothesis import strategies as st

from node.audit import BUNDLE_FORMAT, AuditAssets, audit_bundle
from node.roles.sample_queue import SampleQueue
from node.run import create_genesis
from swarm import toploc, wire
from swarm.errors import SwarmError
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import (
    KINDS,
    LIMITS,
    Evaluation,
    LedgerEvent,
    PolicyAnnouncement,
    RoleAdvert,
    RolloutSubmission,
    Sample,
    SampleReceipt,
    ShardFile,
    ShardManifest,
    TrainingDispute,
    TrainingRecord,
    Verdict,
    decode,
    decode_any,
    run_id_of,
    sign,
)
from swarm.messages.training import GradientCommitment
from swarm.shardcast.protocol import ChannelOffer, Holdings, ManifestRequest, ShardRequest
from tests.fuzz.inputs import fuzz_bytes, pack, structure

HANG_S = 2.0
KEY = NodeKey.from_seed(b"\x11" * 32)
OTHER = NodeKey.from_seed(b"\x12" * 32)
GENESIS = create_genesis(
    KEY, name="fuzz", trainers=[KEY.peer_id], validators=[OTHER.peer_id], created_at=1
)
RUN = run_id_of(GENESIS)
PROOF = bytes([0xFF, 0xD9]) + bytes(range(256))


def message_seeds() -> dict[str, Any]:
    """One valid message of every kind."""
    sample = Sample("p1", (1, 2, 3), 7, (PROOF,), "stop")
    submission = RolloutSubmission(RUN, 0, 1, ("p1",), (sample,), 5)
    return {
        "run-genesis": GENESIS.message,
        "role-advert": RoleAdvert(RUN, KEY.peer_id, "inference", "0.1", ("/ip4/1.2.3.4",), 1, 9),
        "policy-announcement": PolicyAnnouncement(RUN, 3, bytes(32), 4),
        "shard-manifest": ShardManifest(
            RUN, 1, (ShardFile("a.safetensors", 0, 100),), 64, (bytes(32), bytes(32)), 100, 1
        ),
        "rollout-submission": submission,
        "verdict": Verdict(RUN, bytes(32), KEY.peer_id, True, "none", (), (1, 0), 5, {"m": 1}),
        "ledger-event": LedgerEvent(RUN, "credit", KEY.peer_id, 10, bytes(32), 5),
        "evaluation": Evaluation(RUN, 0, 9, (97, 98), (1_000_000, 0), 500_000, 5),
        "training-record": TrainingRecord(
            RUN,
            2,
            1,
            0,
            (bytes(32),),
            (1,),
            '{"threads":1}',
            5,
            bytes(32),
            bytes(32),
            bytes(32),
            6,
            (
                sign(
                    GradientCommitment(
                        RUN, 2, 4, (bytes(32),), (1,), 5, 1, bytes(32), bytes(32), 6
                    ),
                    KEY,
                ).raw,
            ),
        ),
        "gradient-commitment": GradientCommitment(
            RUN, 2, 4, (bytes(32),), (1,), 5, 1, bytes(32), bytes(32), 6
        ),
        "sample-receipt": SampleReceipt(RUN, bytes(32), bytes(32), KEY.peer_id, 1, 1, True, 3, 7),
        "training-dispute": TrainingDispute(
            RUN, 2, KEY.peer_id, bytes(32), "replay-mismatch", "off", 8, (bytes(32),)
        ),
    }


@cache
def signed_seeds() -> dict[str, bytes]:
    out = {}
    for message in message_seeds().values():
        out[message.KIND] = sign(message, KEY).raw
    return out


@st.composite
def resigned(
    draw: st.DrawFn, kind: str, keys: tuple[NodeKey, ...] = (KEY, OTHER), run_id: str = ""
) -> bytes:
    """A correctly signed envelope of ``kind`` whose payload fields were changed at random: the
    signature passes, so the field checks of ``from_wire`` are what is fuzzed."""
    messages = {m.KIND: m for m in message_seeds().values()}
    fields = dict(messages[kind].to_wire())
    if run_id:
        fields["run_id"] = run_id
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from([*fields, "extra"]))
        if draw(st.booleans()):
            fields[name] = draw(structure)
        else:
            fields.pop(name, None)
    try:
        payload = wire.canonical(fields)
    except SwarmError:
        payload = pack(fields)
    signer = draw(st.sampled_from(keys))
    return wire.seal(kind, payload, signer.public, signer.signature(kind, payload))


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], object]
    seeds: tuple[bytes, ...] = ()
    extra: tuple[st.SearchStrategy[bytes], ...] = field(default=())

    def inputs(self) -> st.SearchStrategy[bytes]:
        return st.one_of(fuzz_bytes(self.seeds), *self.extra)


@dataclass
class Tally:
    cases: int = 0
    untyped_errors: int = 0
    hangs: int = 0
    examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        return {"cases": self.cases, "untyped_errors": self.untyped_errors, "hangs": self.hangs}


def check(target: Target, data: bytes, tally: Tally | None = None, hang_s: float = HANG_S) -> str:
    """Run one case: ``ok`` (accepted), ``typed`` (a SwarmError), ``untyped``, or ``hang``
    (took longer than ``hang_s``). Untyped errors are recorded in ``tally.examples``."""
    start = time.monotonic()
    try:
        target.run(data)
        outcome = "ok"
    except SwarmError:
        outcome = "typed"
    except Exception:
        outcome = "untyped"
        if tally is not None and len(tally.examples) < 5:
            tally.examples.append(f"{data[:80]!r}\n{traceback.format_exc(limit=4)}")
    if outcome != "untyped" and time.monotonic() - start > hang_s:
        outcome = "hang"
    if tally is not None:
        tally.cases += 1
        tally.untyped_errors += outcome == "untyped"
        tally.hangs += outcome == "hang"
    return outcome


# --- the targets --------------------------------------------------------------------------


def _decode_kind(cls: type[Any]) -> Callable[[bytes], object]:
    return lambda data: decode(data, cls)


HIDDEN = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
GOOD_PROOFS = tuple(toploc.build_proofs(HIDDEN))


def _verify_proofs(data: bytes) -> object:
    """The first byte chooses how the rest is cut into proofs (mostly 258-byte pieces)."""
    if not data:
        return toploc.verify_proofs(HIDDEN, [])
    step = toploc.proof_size() if data[0] < 200 else max(1, data[0] - 190)
    body = data[1:]
    proofs = [body[i : i + step] for i in range(0, len(body), step)]
    return toploc.verify_proofs(HIDDEN, proofs)


@cache
def _scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="swarm-fuzz-"))


def _bundle(data: bytes) -> object:
    path = _scratch() / "bundle.msgpack"
    path.write_bytes(data)
    # No policy weights: parsing and checks are fuzzed, the replay itself stops typed.
    return audit_bundle(path, lambda version: None, AuditAssets(v0_from_model=False))


def _ledger_file(data: bytes) -> object:
    path = _scratch() / "ledger.db"
    path.write_bytes(data)
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    store = LedgerStore.open_existing(path)
    try:
        return store.balances()
    finally:
        store.close()


def _sample_queue_file(data: bytes) -> object:
    path = _scratch() / "samples.db"
    path.write_bytes(data)
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    queue = SampleQueue(path)
    try:
        return queue.pending(0), queue.take(1, 4, 0)
    finally:
        queue.close()


def _bundle_seed() -> bytes:
    s = signed_seeds()
    return msgpack.packb(
        {
            "format": BUNDLE_FORMAT,
            "genesis": GENESIS.raw,
            "submission": s["rollout-submission"],
            "verdict": s["verdict"],
            "related": [],
        },
        use_bin_type=True,
    )


def decoder_targets() -> list[Target]:
    seeds = signed_seeds()
    all_seeds = tuple(seeds.values())
    targets = [
        Target("messages.decode_any", decode_any, all_seeds),
        Target("wire.open_envelope", lambda d: wire.open_envelope(d, LIMITS), all_seeds),
        Target(
            "wire.decode_canonical",
            lambda d: wire.decode_canonical(d, 4096),
            tuple(wire.open_envelope(s, LIMITS).payload for s in all_seeds),
        ),
        Target("toploc.parse_proof", toploc.parse_proof, GOOD_PROOFS),
        Target("toploc.verify_proofs", _verify_proofs, (b"\x00" + b"".join(GOOD_PROOFS),)),
        Target(
            "shardcast.ManifestRequest",
            ManifestRequest.from_bytes,
            (ManifestRequest(3).to_bytes(), ManifestRequest().to_bytes()),
        ),
        Target(
            "shardcast.ShardRequest",
            ShardRequest.from_bytes,
            tuple(ShardRequest(op, 1, 2, 3, 4).to_bytes() for op in ("have", "get", "channel")),  # type: ignore[arg-type]
        ),
        Target(
            "shardcast.Holdings", Holdings.from_bytes, (Holdings(False, b"\x01\x00").to_bytes(),)
        ),
        Target(
            "shardcast.ChannelOffer",
            ChannelOffer.from_bytes,
            (ChannelOffer("127.0.0.1", 4000, bytes(16)).to_bytes(),),
        ),
        Target("audit.bundle", _bundle, (_bundle_seed(),)),
        Target("ledger.open_existing", _ledger_file),
        Target("sample_queue.open", _sample_queue_file),
    ]
    for kind, cls in KINDS.items():
        targets.append(
            Target(f"messages.decode.{kind}", _decode_kind(cls), (seeds[kind],), (resigned(kind),))
        )
    targets.append(datachannel_target())
    return targets


# --- the data channel's hello and request parsing ---------------------------------------------


def datachannel_target() -> Target:
    """Random bytes into a data channel session on a socket pair; the server may end the
    session with the errors its connection loop handles (``SwarmError``, ``OSError``, trio's
    broken/closed/too-slow), anything else counts as untyped."""
    from swarm.shardcast.datachannel import (
        _HELLO,
        _REQUEST,
        MAGIC,
        DataChannelConfig,
        DataChannelServer,
    )
    from swarm.shardcast.serve import ShardServer
    from tests.shardcast_util import published

    _, manifest, store = published(_scratch(), size=40_000, shard_size=16_384)
    server = ShardServer(store)
    channel = DataChannelServer(server, DataChannelConfig(idle_timeout=1.0, send_timeout=1.0))
    version = manifest.message.version

    async def session(data: bytes) -> None:
        token = server.issue_token("fuzzer")
        # Seeds carry the placeholder token b"T"*16; swap in a live one so requests get parsed.
        data = data.replace(b"T" * 16, token)
        a, b = trio.socket.socketpair()
        client, peer = trio.SocketStream(a), trio.SocketStream(b)
        failure: Exception | None = None
        async with client, peer:
            await client.send_all(data)
            await client.send_eof()
            async with trio.open_nursery() as nursery:

                async def drain() -> None:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        while await client.receive_some(65536):
                            pass

                nursery.start_soon(drain)
                try:
                    await channel._session(peer)
                except Exception as exc:  # classified below, outside the nursery
                    failure = exc
                finally:
                    await peer.aclose()
        if failure is None or isinstance(failure, SwarmError):
            if failure is not None:
                raise failure
            return
        if isinstance(
            failure,
            trio.BrokenResourceError | trio.ClosedResourceError | trio.TooSlowError | OSError,
        ):
            raise _Typed(str(failure)) from failure
        raise failure

    def run(data: bytes) -> None:
        trio.run(session, data)

    hello = _HELLO.pack(MAGIC, b"T" * 16)
    seeds = (
        hello,
        hello + _REQUEST.pack(version, 0, 0, 100),
        hello + _REQUEST.pack(version, 1, 10, 2**20) + _REQUEST.pack(version + 5, 9, 0, 1),
    )
    return Target("datachannel.session", run, seeds)


class _Typed(SwarmError):
    """A transport error the data channel's connection loop handles by closing."""
