"""Canonical msgpack and the signed envelope.

Every signed object travels as an envelope, a msgpack array::

    [1, kind, payload, signer_pubkey, signature]

``payload`` is the canonical msgpack encoding of a map with string keys (see ``canonical``);
``signature`` is Ed25519 over ``b"swarm-node/1\\0" + kind + b"\\0" + payload``, so a signature made
for one kind never verifies as another. An object's id is the sha256 of its envelope bytes, which
is why both the envelope and the payload must be canonical: one object, one encoding, one id.

Decoding is bounded (a size limit per kind, msgpack length limits, strict types) and every failure
raises a ``swarm.errors.WireError`` or ``SignatureError``; nothing else escapes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from swarm.errors import (
    MalformedError,
    NonCanonicalError,
    OversizeError,
    SignatureError,
    UnknownKindError,
)

ENVELOPE_VERSION: Final = 1
DOMAIN: Final = b"swarm-node/1\0"
PUBKEY_LEN: Final = 32
SIGNATURE_LEN: Final = 64
# Bounds on any single msgpack value we decode, whatever the kind's overall limit.
_MAX_CONTAINER_LEN: Final = 1 << 20
_MAX_DEPTH: Final = 16

# WireValue is what a canonical payload may hold: no floats (a signed value is an integer, or a
# decimal string a typed accessor parses), no None-keyed maps, no extension types.
WireValue: TypeAlias = (
    "bool | int | str | bytes | list[WireValue] | tuple[WireValue, ...] | Mapping[str, WireValue]"
    " | None"
)


def _normalise(value: Any, depth: int = 0) -> Any:
    """Sort map keys recursively and refuse what canonical encoding cannot hold."""
    if depth > _MAX_DEPTH:
        raise MalformedError(f"value nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str, bytes)):
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise MalformedError(f"integer {value} does not fit in 64 bits")
        return value
    if isinstance(value, (list, tuple)):
        return [_normalise(v, depth + 1) for v in value]
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise MalformedError(f"map key {key!r} is not a string")
        return {k: _normalise(value[k], depth + 1) for k in sorted(value)}
    if isinstance(value, float):
        raise MalformedError("floats are not allowed in signed payloads; use an int or a string")
    raise MalformedError(f"type {type(value).__name__} cannot be encoded")


def canonical(value: Mapping[str, Any]) -> bytes:
    """The one encoding of a payload map: sorted string keys, smallest int forms, bytes as bin."""
    return msgpack.packb(_normalise(value), use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(data: bytes, limit: int) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=min(limit, _MAX_CONTAINER_LEN),
            max_map_len=min(limit, _MAX_CONTAINER_LEN),
            max_ext_len=0,
        )
    except msgpack.ExtraData as exc:
        raise MalformedError("trailing bytes after the object") from exc
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise MalformedError(f"not valid msgpack: {exc}") from exc


def decode_canonical(data: bytes, limit: int) -> dict[str, Any]:
    """Decode a payload map and insist that it is in canonical encoding."""
    if len(data) > limit:
        raise OversizeError(f"payload of {len(data)} bytes exceeds the limit of {limit}")
    value = _unpack(data, limit)
    if not isinstance(value, dict):
        raise MalformedError(f"payload is a {type(value).__name__}, expected a map")
    try:
        again = canonical(value)
    except MalformedError as exc:
        raise NonCanonicalError(f"payload cannot be canonical: {exc}") from exc
    if again != data:
        raise NonCanonicalError("payload is not in canonical encoding")
    return value


def signing_input(kind: str, payload: bytes) -> bytes:
    return DOMAIN + kind.encode() + b"\0" + payload


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded, signature-checked envelope. ``raw`` is the exact bytes; ``id`` their sha256."""

    kind: str
    payload: bytes
    signer: bytes
    signature: bytes
    raw: bytes

    @property
    def id(self) -> bytes:
        return hashlib.sha256(self.raw).digest()


def seal(kind: str, payload: bytes, signer: bytes, signature: bytes) -> bytes:
    """Envelope bytes for an already signed payload."""
    return msgpack.packb(  # type: ignore[no-any-return]
        [ENVELOPE_VERSION, kind, payload, signer, signature], use_bin_type=True
    )


def open_envelope(data: bytes, limits: Mapping[str, int]) -> Envelope:
    """Decode envelope bytes and verify the signature. ``limits`` maps known kinds to byte limits.

    Raises ``OversizeError`` before decoding anything larger than the largest known limit,
    ``UnknownKindError`` for a kind not in ``limits``, ``MalformedError``/``NonCanonicalError``
    for bad encodings and ``SignatureError`` when the signature does not verify.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    ceiling = max(limits.values(), default=0) + 256
    if len(data) > ceiling:
        raise OversizeError(f"envelope of {len(data)} bytes exceeds the largest limit ({ceiling})")
    value = _unpack(data, ceiling)
    if not isinstance(value, list) or len(value) != 5:
        raise MalformedError("an envelope is a msgpack array of 5 items")
    version, kind, payload, signer, signature = value
    if type(version) is not int or version != ENVELOPE_VERSION:
        raise MalformedError(f"unsupported envelope version {version!r}")
    if not isinstance(kind, str):
        raise MalformedError("envelope kind is not a string")
    if kind not in limits:
        raise UnknownKindError(f"unknown envelope kind {kind[:64]!r}")
    if not isinstance(payload, bytes) or not isinstance(signer, bytes):
        raise MalformedError("envelope payload and signer must be bytes")
    if not isinstance(signature, bytes):
        raise MalformedError("envelope signature must be bytes")
    if len(payload) > limits[kind]:
        raise OversizeError(
            f"{kind} payload of {len(payload)} bytes exceeds its limit of {limits[kind]}"
        )
    if len(signer) != PUBKEY_LEN or len(signature) != SIGNATURE_LEN:
        raise MalformedError("signer must be a 32-byte Ed25519 key and signature 64 bytes")
    if seal(kind, payload, signer, signature) != data:
        raise NonCanonicalError("envelope is not in canonical encoding")
    verify_signature(signer, signature, signing_input(kind, payload))
    return Envelope(kind=kind, payload=payload, signer=signer, signature=signature, raw=data)


def verify_signature(pubkey: bytes, signature: bytes, message: bytes) -> None:
    try:
        Ed25519PublicKey.from_public_bytes(pubkey).verify(signature, message)
    except (InvalidSignature, ValueError) as exc:
        raise SignatureError("signature does not verify for this signer, kind and payload") from exc
