"""A Sybil flood against one validator: many fresh identities, each a bare libp2p host of its
own (``swarm.net.host.build_host``, no membership, no gossip) in this process and trio run,
each sending what costs it nothing (issue 15):

- ``garbage``: well-formed work for its own real assignment (right prompts, seed, layout and
  termination fields, so every model-free check passes) with random tokens and proofs: the
  validator must judge it (a prefill), rejects it hard and slashes the key;
- ``unassigned``: valid-looking work for prompts it was not assigned (refused by the precheck);
- ``replay``: an honest worker's submission sent as its own, and its own garbage again;
- ``max-size``: a signed submission just under ``RolloutSubmission.MAX_BYTES`` (8 MiB; the
  validator reads, decodes and verifies it before the precheck refuses it).

``Flood.run`` is bounded in count (``rounds`` of the four per identity) and in time. Used by
``bench/flood.py`` (in its own process, apart from the swarm's) and, as a process of its own so
the test measures the validator's memory and not the flood's, by
``tests/integration/test_sybil_flood.py``:

    python -m tests.flood --genesis RUN.genesis --addr VALIDATOR_ADDR [--identities N]
        [--rounds R] [--seconds S] [--replay FILE]... [--version-file PATH] [--manifest HEX]
        [--seed N]                                         # prints the outcomes as JSON

``--version-file``: the policy version to sign work of, read from this file (``V`` or ``V
MANIFEST_HEX``, rewritten by whoever runs the flood, e.g. ``bench/flood.py`` from the
validator's status) at every submission; without it, version 0 with ``--manifest``. The
manifest id is what the assignment of a run with a quota mixes (``swarm.assignment``); an
identity's garbage uses counters ``0, 1, ...`` of the version, so past the quota the validator
refuses it at the door (``quota``) instead of judging it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import trio

from node.run import TaskSource, load_genesis, suite_for
from swarm.assignment import assign
from swarm.errors import NetworkError, PeerError, RequestTimeout
from swarm.identity import NodeKey
from swarm.messages import RolloutSubmission, RunGenesis, Sample, Signed, run_id_of, sign
from swarm.net.dial import dial_once
from swarm.net.host import build_host, listen_addrs
from swarm.net.names import SUBMIT, stream_protocol
from swarm.net.streams import StreamLimits, request
from swarm.toploc import CHUNK_SIZE, proof_size

KINDS = ("garbage", "unassigned", "replay", "max-size")
FLOOD_LIMITS = StreamLimits(
    max_request=RolloutSubmission.MAX_BYTES + 1024, max_response=1 << 20, timeout=30.0
)
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@dataclass
class FloodStats:
    sent: Counter[str] = field(default_factory=Counter)
    """Requests by kind."""
    outcomes: Counter[str] = field(default_factory=Counter)
    """``kind: outcome``: verdict (judged), refused (the first words of the reason), shed (no
    stream or reset: the per-peer and shared slot caps), timeout."""
    seconds: float = 0.0

    def judged(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k.endswith(": verdict"))


class Flood:
    def __init__(
        self,
        genesis: Signed[RunGenesis],
        validator_addr: str,
        *,
        identities: int = 50,
        rounds: int = 4,
        honest: Callable[[], Sequence[bytes]] = lambda: (),
        policy: Callable[[], tuple[int, bytes | None]] = lambda: (0, None),
        seed: int = 0,
    ) -> None:
        self.genesis = genesis
        self.run_id = run_id_of(genesis)
        self.params = genesis.message.params
        self.suite: TaskSource = suite_for(genesis.message)
        self.addr = validator_addr
        self.validator = validator_addr.rsplit("/p2p/", 1)[1]
        self.keys = [
            NodeKey.from_seed(hashlib.sha256(f"flood-{seed}-{i}".encode()).digest())
            for i in range(identities)
        ]
        self.rounds = rounds
        self.honest = honest
        self.policy = policy
        """The version to sign work of and its manifest id (None: unknown, or a legacy run)."""
        self.rng = random.Random(seed)
        self.stats = FloodStats()
        self._max_size: dict[str, bytes] = {}
        self.on_ready: Callable[[], None] | None = None
        """Called once every identity's host is up, as the flood starts."""

    async def run(self, seconds: float) -> FloodStats:
        """Every identity sends ``rounds`` x the four kinds, one request at a time, all
        identities at once; stops after ``seconds`` whatever is left."""
        start = trio.current_time()
        async with AsyncExitStack() as stack:
            hosts = []
            for key in self.keys:
                host = build_host(key, LOOPBACK)
                await stack.enter_async_context(host.run(listen_addrs(LOOPBACK)))
                hosts.append((key, host))
            if self.on_ready is not None:
                self.on_ready()  # every host is up: the flood starts now
            with trio.move_on_after(seconds):
                async with trio.open_nursery() as nursery:
                    for key, host in hosts:
                        nursery.start_soon(self._identity, key, host)
        self.stats.seconds = trio.current_time() - start
        return self.stats

    async def _identity(self, key: NodeKey, host: object) -> None:
        # Until connected (bounded by ``run``'s deadline): 50 handshakes at once on a loaded
        # machine time out, and an attacker dials again.
        while await dial_once(host, self.addr, 10.0) is not None:
            self.stats.outcomes["dial: failed"] += 1
            await trio.sleep(self.rng.uniform(0.5, 1.5))
        garbage = sign(self._garbage(key, counter=0), key).raw
        for r in range(self.rounds):
            honest = list(self.honest())
            bodies = {
                "garbage": garbage if r == 0 else sign(self._garbage(key, r), key).raw,
                "unassigned": sign(self._unassigned(key, r), key).raw,
                "replay": self.rng.choice(honest) if honest and r % 2 else garbage,
                "max-size": self._biggest(key),
            }
            for kind in KINDS:
                await self._send(host, kind, bodies[kind])

    async def _send(self, host: object, kind: str, body: bytes) -> None:
        self.stats.sent[kind] += 1
        protocol = stream_protocol(self.run_id, SUBMIT)
        try:
            await request(host, self.validator, protocol, body, FLOOD_LIMITS)
            outcome = "verdict"
        except RequestTimeout:
            outcome = "timeout"
        except PeerError as exc:
            reason = str(exc).split(": ", 1)[-1]
            outcome = "refused " + " ".join(reason.split()[:2])
        except NetworkError:
            outcome = "shed"
        self.stats.outcomes[f"{kind}: {outcome}"] += 1

    # -- what each identity signs --------------------------------------------------------------

    def _assigned(self, key: NodeKey, counter: int) -> tuple[list[str], int, int]:
        version, manifest_id = self.policy()
        a = assign(
            self.run_id,
            version,
            key.peer_id,
            counter,
            n_prompts=self.params.batch_prompts,
            suite_size=self.suite.size,
            excluded=self.suite.excluded,
            manifest_id=manifest_id if self.params.quota else None,
        )
        return [str(i) for i in a.prompt_ids], a.seed, version

    def _samples(self, prompts: list[str], seed: int) -> tuple[Sample, ...]:
        n = self.params.max_tokens
        chunks = -(-n // CHUNK_SIZE)
        return tuple(
            Sample(
                p,
                # Inside the vocabulary of any model (the embedded one has 259 tokens): the
                # validator must prefill it to find out.
                tuple(self.rng.randrange(3, 256) for _ in range(n)),
                seed,
                tuple(self.rng.randbytes(proof_size()) for _ in range(chunks)),
                "length",
            )
            for p in prompts
            for _ in range(self.params.group_size)
        )

    def _garbage(self, key: NodeKey, counter: int) -> RolloutSubmission:
        prompts, seed, version = self._assigned(key, counter)
        return RolloutSubmission(
            self.run_id, version, counter, tuple(prompts), self._samples(prompts, seed), 1
        )

    def _unassigned(self, key: NodeKey, counter: int) -> RolloutSubmission:
        # Inside the quota (a run without one: a counter of its own), so the assignment
        # check, not the quota, refuses it.
        n = counter % self.params.quota if self.params.quota else 1000 + counter
        prompts, seed, version = self._assigned(key, n)
        wrong = [str((int(p) + 1) % self.suite.size) for p in prompts]
        return RolloutSubmission(
            self.run_id, version, n, tuple(wrong), self._samples(wrong, seed), 1
        )

    def _biggest(self, key: NodeKey) -> bytes:
        """A signed submission just under the 8 MiB message limit (made once per key)."""
        if key.peer_id not in self._max_size:
            filler = Sample("0", tuple(range(1000)), 0, (b"\xaa" * (1 << 20),) * 7, "stop")
            body = RolloutSubmission(self.run_id, 0, 2000, ("0",), (filler,), 1)
            self._max_size[key.peer_id] = sign(body, key).raw
        return self._max_size[key.peer_id]


def main() -> None:
    parser = argparse.ArgumentParser(description="flood one validator from fresh identities")
    parser.add_argument("--genesis", type=Path, required=True)
    parser.add_argument("--addr", required=True, help="the validator's /ip4/.../p2p/ID address")
    parser.add_argument("--identities", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--replay", type=Path, action="append", default=[], help="a signed file")
    parser.add_argument(
        "--version-file", type=Path, help="holds the version to sign work of [and its manifest]"
    )
    parser.add_argument("--manifest", default="", help="hex manifest id of version 0")
    parser.add_argument("--seed", type=int, default=0, help="another seed: other identities")
    args = parser.parse_args()
    replays = [p.read_bytes() for p in args.replay]
    version_file: Path | None = args.version_file
    fixed = bytes.fromhex(args.manifest) if args.manifest else None

    def policy() -> tuple[int, bytes | None]:
        if version_file is None:
            return 0, fixed
        try:
            version, *manifest = version_file.read_text().split()
            return int(version), bytes.fromhex(manifest[0]) if manifest else None
        except (OSError, ValueError):
            return 0, fixed  # being rewritten: the next submission reads it again

    flood = Flood(
        load_genesis(args.genesis),
        args.addr,
        identities=args.identities,
        rounds=args.rounds,
        honest=lambda: replays,
        policy=policy,
        seed=args.seed,
    )
    flood.on_ready = lambda: print("flooding", file=sys.stderr, flush=True)
    stats = trio.run(flood.run, args.seconds)
    print(json.dumps({"sent": stats.sent, "outcomes": stats.outcomes, "seconds": stats.seconds}))


if __name__ == "__main__":
    main()
