"""What every signed message shares: typed field reading, signing, and bounded decoding.

A message is a frozen dataclass with ``KIND`` and ``MAX_BYTES`` class attributes, ``to_wire``
(a map of plain values) and ``from_wire`` (the reverse, strict on the fields it knows and blind to
the ones it does not, so newer peers stay compatible). Handlers receive ``Signed[M]``: the message,
who signed it, and its id; they never touch raw msgpack.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from swarm.errors import MalformedError, OversizeError
from swarm.identity import NodeKey, peer_id_from_public
from swarm.wire import Envelope, canonical, decode_canonical, open_envelope, seal

T = TypeVar("T")


class Message(Protocol):
    KIND: ClassVar[str]
    MAX_BYTES: ClassVar[int]

    def to_wire(self) -> dict[str, Any]: ...

    @classmethod
    def from_wire(cls, fields: Fields) -> Self: ...


M = TypeVar("M", bound=Message)


class Fields:
    """Typed access to a decoded payload map; every mismatch is a ``MalformedError``."""

    __slots__ = ("_kind", "_map")

    def __init__(self, kind: str, mapping: Mapping[str, Any]) -> None:
        self._kind = kind
        self._map = mapping

    def _get(self, name: str, types: type | tuple[type, ...], default: Any) -> Any:
        if name not in self._map:
            if default is _REQUIRED:
                raise MalformedError(f"{self._kind}: missing field {name!r}")
            return default
        value = self._map[name]
        # bool is an int subclass; never accept one for the other.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            raise MalformedError(
                f"{self._kind}: field {name!r} is {type(value).__name__}, expected {_names(types)}"
            )
        return value

    def has(self, name: str) -> bool:
        """Whether the payload carries ``name`` (for optional fields without a default)."""
        return name in self._map

    def text(self, name: str, default: Any = None) -> str:
        return self._get(name, str, _REQUIRED if default is None else default)  # type: ignore[no-any-return]

    def integer(self, name: str, default: Any = None, *, minimum: int | None = None) -> int:
        value: int = self._get(name, int, _REQUIRED if default is None else default)
        if minimum is not None and value < minimum:
            raise MalformedError(f"{self._kind}: field {name!r} is {value}, below {minimum}")
        return value

    def flag(self, name: str, default: Any = None) -> bool:
        return self._get(name, bool, _REQUIRED if default is None else default)  # type: ignore[no-any-return]

    def blob(self, name: str, default: Any = None, *, length: int | None = None) -> bytes:
        value: bytes = self._get(name, bytes, _REQUIRED if default is None else default)
        if length is not None and len(value) != length:
            raise MalformedError(f"{self._kind}: field {name!r} must be {length} bytes")
        return value

    def seq(self, name: str, item: Callable[[Any], T], default: Any = None) -> tuple[T, ...]:
        raw = self._get(name, list, _REQUIRED if default is None else default)
        return tuple(item(v) for v in raw)

    def sub(self, name: str, default: Any = None) -> Fields:
        raw = self._get(name, dict, _REQUIRED if default is None else default)
        return Fields(f"{self._kind}.{name}", raw)

    def plain_map(self, name: str, default: Any = None) -> dict[str, Any]:
        return dict(self._get(name, dict, _REQUIRED if default is None else default))

    def items(self, name: str, item: Callable[[Fields], T], default: Any = None) -> tuple[T, ...]:
        """A list of nested maps, each read with ``item``."""
        raw = self._get(name, list, _REQUIRED if default is None else default)
        out = []
        for i, value in enumerate(raw):
            if not isinstance(value, dict):
                raise MalformedError(f"{self._kind}: {name}[{i}] is not a map")
            out.append(item(Fields(f"{self._kind}.{name}[{i}]", value)))
        return tuple(out)


_REQUIRED: Any = object()


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _names(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in _tuple(types))


def typed(kind: type[T], what: str) -> Callable[[Any], T]:
    """An item reader for ``Fields.list`` that accepts exactly ``kind``."""

    def read(value: Any) -> T:
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise MalformedError(
                f"{what}: item is {type(value).__name__}, expected {kind.__name__}"
            )
        return value

    return read


@dataclass(frozen=True, slots=True)
class Signed(Generic[M]):
    """A verified message with its envelope: who signed it (``signer``) and its ``id``."""

    message: M
    envelope: Envelope

    @property
    def id(self) -> bytes:
        return self.envelope.id

    @property
    def signer(self) -> str:
        """The signer's peer ID."""
        return peer_id_from_public(self.envelope.signer)

    @property
    def raw(self) -> bytes:
        return self.envelope.raw


def sign(message: M, key: NodeKey) -> Signed[M]:
    """Sign ``message`` with ``key``; the result decodes back to an equal message."""
    payload = canonical(message.to_wire())
    if len(payload) > message.MAX_BYTES:
        raise OversizeError(
            f"{message.KIND} of {len(payload)} bytes exceeds its limit of {message.MAX_BYTES}"
        )
    signature = key.signature(message.KIND, payload)
    raw = seal(message.KIND, payload, key.public, signature)
    return Signed(message, Envelope(message.KIND, payload, key.public, signature, raw))


def decode_as(cls: type[M], envelope: Envelope) -> Signed[M]:
    fields = decode_canonical(envelope.payload, cls.MAX_BYTES)
    return Signed(cls.from_wire(Fields(cls.KIND, fields)), envelope)


def decode(data: bytes, cls: type[M]) -> Signed[M]:
    """Verify and decode envelope bytes that must hold a ``cls`` message.

    A valid envelope of another kind is refused with ``UnknownKindError``: a signature made for
    kind A never passes as kind B.
    """
    return decode_as(cls, open_envelope(data, {cls.KIND: cls.MAX_BYTES}))
