"""Fuzz inputs: random bytes, mutations of valid encodings, and random msgpack structures.

``fuzz_bytes(seeds)`` is the strategy every target draws from: a third random bytes, a third
byte-level mutations of one of the target's valid seeds (flip, cut, insert, splice, duplicate),
a third msgpack-encoded random structures whose keys are the field names real messages use (so
decoders get past "not a map" and reach their field checks).
"""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import strategies as st

FIELD_NAMES = (
    "version", "op", "index", "offset", "length", "complete", "bits", "host", "port", "token",
    "run_id", "peer_id", "policy_version", "counter", "samples", "tokens", "proofs", "seed",
    "prompt_id", "prompt_ids", "finish_reason", "created_at", "manifest_id", "files", "path",
    "size", "shard_size", "shard_hashes", "total_size", "accepted", "rewards", "reasons",
    "severity", "submission_id", "worker", "metrics", "event", "peer", "amount", "evidence",
    "role", "addrs", "issued_at", "expires_at", "software", "capabilities", "format", "cmd",
    "genesis", "submission", "verdict", "related", "ranges", "split", "get",
)  # fmt: skip

INTERESTING_INTS = (0, 1, -1, 255, 256, 65535, 65536, 2**31 - 1, 2**32, 2**63 - 1, -(2**63))

scalar = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from(INTERESTING_INTS),
    st.text(max_size=24),
    st.binary(max_size=40),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
)
key = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=8), st.integers(-5, 5))
structure = st.recursive(
    scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(key, inner, max_size=8)),
    max_leaves=24,
)


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


@st.composite
def mutated(draw: st.DrawFn, seeds: tuple[bytes, ...]) -> bytes:
    raw = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "splice", "dup", "set"]))
        at = draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[at] ^= draw(st.integers(1, 255))
        elif op == "set" and raw:
            raw[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDD, 0xDF, 0xFF]))
        elif op == "cut":
            del raw[at : at + draw(st.integers(1, 64))]
        elif op == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "splice":
            other = draw(st.sampled_from(seeds))
            raw[at:] = other[draw(st.integers(0, len(other))) :]
        elif op == "dup" and raw:
            raw[at:at] = raw[at : at + draw(st.integers(1, 32))]
    return bytes(raw)


def fuzz_bytes(seeds: tuple[bytes, ...], max_size: int = 2048) -> st.SearchStrategy[bytes]:
    parts: list[st.SearchStrategy[bytes]] = [
        st.binary(max_size=max_size),
        structure.map(pack),
    ]
    if seeds:
        parts.append(mutated(seeds))
    return st.one_of(parts)
