"""The envelope: canonical, domain-separated, bounded. Every tampering is a typed error."""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest

from swarm.errors import (
    MalformedError,
    NonCanonicalError,
    OversizeError,
    SignatureError,
    UnknownKindError,
    WireError,
)
from swarm.identity import NodeKey
from swarm.messages import PolicyAnnouncement, RoleAdvert, decode, sign
from swarm.wire import canonical, decode_canonical, open_envelope, seal

LIMITS = {"a": 1024, "b": 1024}


def _announcement() -> PolicyAnnouncement:
    return PolicyAnnouncement(run_id="ab" * 16, version=3, manifest_id=b"\x01" * 32, issued_at=5)


def _parts(raw: bytes) -> list[object]:
    parts = msgpack.unpackb(raw, raw=False)
    assert isinstance(parts, list)
    return parts


def test_canonical_sorts_keys_and_is_stable() -> None:
    assert canonical({"b": 1, "a": {"d": 2, "c": [1, b"x"]}}) == canonical(
        {"a": {"c": [1, b"x"], "d": 2}, "b": 1}
    )


def test_canonical_refuses_floats_and_non_string_keys() -> None:
    with pytest.raises(MalformedError, match="floats"):
        canonical({"lr": 0.1})
    with pytest.raises(MalformedError):
        canonical({1: "x"})  # type: ignore[dict-item]


def test_signed_message_decodes_to_an_equal_message(make_key: Callable[[str], NodeKey]) -> None:
    alice = make_key("alice")
    signed = sign(_announcement(), alice)
    back = decode(signed.raw, PolicyAnnouncement)
    assert back.message == _announcement()
    assert back.signer == alice.peer_id
    assert back.id == signed.id and len(back.id) == 32


@pytest.mark.parametrize("index", [1, 2, 3, 4])
def test_any_changed_envelope_field_is_refused(
    make_key: Callable[[str], NodeKey], index: int
) -> None:
    signed = sign(_announcement(), make_key("alice"))
    parts = _parts(signed.raw)
    if index == 1:
        parts[1] = RoleAdvert.KIND  # same signature presented as another kind
    elif index == 2:
        payload = msgpack.unpackb(parts[2])
        payload["version"] = 4
        parts[2] = canonical(payload)
    elif index == 3:
        parts[3] = make_key("mallory").public
    else:
        sig = bytearray(parts[4])  # type: ignore[arg-type]
        sig[0] ^= 1
        parts[4] = bytes(sig)
    forged = msgpack.packb(parts, use_bin_type=True)
    with pytest.raises((SignatureError, UnknownKindError)):
        decode(forged, PolicyAnnouncement)


def test_signature_for_kind_a_never_verifies_as_kind_b(make_key: Callable[[str], NodeKey]) -> None:
    key = make_key("alice")
    payload = canonical({"x": 1})
    raw = seal("a", payload, key.public, key.signature("a", payload))
    assert open_envelope(raw, LIMITS).kind == "a"
    swapped = seal("b", payload, key.public, key.signature("a", payload))
    with pytest.raises(SignatureError):
        open_envelope(swapped, LIMITS)


def test_truncated_bytes_are_malformed(make_key: Callable[[str], NodeKey]) -> None:
    raw = sign(_announcement(), make_key("alice")).raw
    for cut in (0, 1, 10, len(raw) // 2, len(raw) - 1):
        with pytest.raises(WireError):
            decode(raw[:cut], PolicyAnnouncement)


def test_trailing_bytes_are_malformed(make_key: Callable[[str], NodeKey]) -> None:
    raw = sign(_announcement(), make_key("alice")).raw
    with pytest.raises(MalformedError, match="trailing"):
        decode(raw + b"\x00", PolicyAnnouncement)


def test_bytes_past_the_kind_limit_are_refused_before_decoding(
    make_key: Callable[[str], NodeKey],
) -> None:
    key = make_key("alice")
    payload = canonical({"blob": b"x" * 2000})
    raw = seal("a", payload, key.public, key.signature("a", payload))
    with pytest.raises(OversizeError):
        open_envelope(raw, LIMITS)
    with pytest.raises(OversizeError):
        open_envelope(b"\x00" * 10_000, LIMITS)


def test_signing_an_oversized_message_is_refused(make_key: Callable[[str], NodeKey]) -> None:
    advert = RoleAdvert(
        run_id="r",
        peer_id="p",
        role="inference",
        software="x",
        addrs=("a" * 9000,),
        issued_at=0,
        expires_at=1,
    )
    with pytest.raises(OversizeError):
        sign(advert, make_key("alice"))


def test_wrong_field_types_are_malformed(make_key: Callable[[str], NodeKey]) -> None:
    key = make_key("alice")
    for bad in (
        {"run_id": "r", "version": "3", "manifest_id": b"\x01" * 32, "issued_at": 1},
        {"run_id": "r", "version": True, "manifest_id": b"\x01" * 32, "issued_at": 1},
        {"run_id": "r", "version": -1, "manifest_id": b"\x01" * 32, "issued_at": 1},
        {"run_id": "r", "version": 3, "manifest_id": b"\x01" * 31, "issued_at": 1},
        {"run_id": 7, "version": 3, "manifest_id": b"\x01" * 32, "issued_at": 1},
        {"version": 3, "manifest_id": b"\x01" * 32, "issued_at": 1},
    ):
        payload = canonical(bad)
        kind = PolicyAnnouncement.KIND
        raw = seal(kind, payload, key.public, key.signature(kind, payload))
        with pytest.raises(MalformedError):
            decode(raw, PolicyAnnouncement)


def test_unknown_fields_are_ignored(make_key: Callable[[str], NodeKey]) -> None:
    key = make_key("alice")
    fields = _announcement().to_wire() | {"from_the_future": [1, 2, {"x": b"y"}]}
    payload = canonical(fields)
    kind = PolicyAnnouncement.KIND
    raw = seal(kind, payload, key.public, key.signature(kind, payload))
    assert decode(raw, PolicyAnnouncement).message == _announcement()


def test_non_canonical_payload_is_refused_even_with_a_valid_signature(
    make_key: Callable[[str], NodeKey],
) -> None:
    key = make_key("alice")
    fields = _announcement().to_wire()
    unsorted = msgpack.packb(dict(reversed(list(fields.items()))), use_bin_type=True)
    assert unsorted != canonical(fields)
    kind = PolicyAnnouncement.KIND
    raw = seal(kind, unsorted, key.public, key.signature(kind, unsorted))
    with pytest.raises(NonCanonicalError):
        decode(raw, PolicyAnnouncement)


def test_non_canonical_envelope_is_refused(make_key: Callable[[str], NodeKey]) -> None:
    """The same envelope with a wider int encoding would have another id: refused."""
    signed = sign(_announcement(), make_key("alice"))
    assert signed.raw[1] == 0x01  # fixint version right after the array header
    wide = signed.raw[:1] + b"\xcc\x01" + signed.raw[2:]  # uint8 form of the same 1
    with pytest.raises(NonCanonicalError):
        decode(wide, PolicyAnnouncement)


def test_decode_canonical_refuses_non_maps_and_oversize() -> None:
    with pytest.raises(MalformedError):
        decode_canonical(msgpack.packb([1, 2]), 100)
    with pytest.raises(OversizeError):
        decode_canonical(canonical({"x": b"y" * 200}), 100)


def test_unknown_kind_and_version_are_refused(make_key: Callable[[str], NodeKey]) -> None:
    key = make_key("alice")
    payload = canonical({"x": 1})
    with pytest.raises(UnknownKindError):
        open_envelope(seal("zz", payload, key.public, key.signature("zz", payload)), LIMITS)
    raw = msgpack.packb([2, "a", payload, key.public, key.signature("a", payload)])
    with pytest.raises(MalformedError, match="version"):
        open_envelope(raw, LIMITS)


def test_deep_nesting_is_malformed_not_a_crash(make_key: Callable[[str], NodeKey]) -> None:
    nested: object = 1
    for _ in range(400):
        nested = [nested]
    key = make_key("alice")
    payload = msgpack.packb({"x": nested})
    raw = seal("a", payload, key.public, key.signature("a", payload))
    envelope = open_envelope(raw, {"a": 1 << 20})
    with pytest.raises(WireError):
        decode_canonical(envelope.payload, 1 << 20)
