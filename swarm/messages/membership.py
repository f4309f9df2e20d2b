"""Who is in the run (RoleAdvert, stored in the DHT) and which policy is newest
(PolicyAnnouncement, gossiped)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self

from swarm.errors import MalformedError
from swarm.messages._base import Fields, typed

Role = Literal["trainer", "inference", "validator", "bootstrap"]
ROLES: tuple[Role, ...] = ("trainer", "inference", "validator", "bootstrap")


def parse_role(value: str) -> Role:
    if value not in ROLES:
        raise MalformedError(f"unknown role {value[:32]!r}; expected one of {', '.join(ROLES)}")
    return value


@dataclass(frozen=True, slots=True)
class RoleAdvert:
    """A node's signed statement of its role and addresses, valid until ``expires_at`` (ms).

    Only the peer it describes may sign it: DHT record validators compare ``peer_id`` with the
    envelope's signer.
    """

    KIND: ClassVar[str] = "role-advert"
    MAX_BYTES: ClassVar[int] = 8 * 1024

    run_id: str
    peer_id: str
    role: Role
    software: str
    addrs: tuple[str, ...]
    issued_at: int
    expires_at: int
    capabilities: Mapping[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "peer_id": self.peer_id,
            "role": self.role,
            "software": self.software,
            "addrs": list(self.addrs),
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "capabilities": dict(self.capabilities),
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            run_id=f.text("run_id"),
            peer_id=f.text("peer_id"),
            role=parse_role(f.text("role")),
            software=f.text("software"),
            addrs=f.seq("addrs", typed(str, "addrs")),
            issued_at=f.integer("issued_at", minimum=0),
            expires_at=f.integer("expires_at", minimum=0),
            capabilities=f.plain_map("capabilities", {}),
        )


INLINE_MANIFEST_MAX = 32 * 1024
"""The largest signed manifest an announcement carries (about 1,000 shards: 4 GiB in shards of
4 MiB); a larger one is asked of peers by its id (``swarm.shardcast.fetch_manifest``)."""


@dataclass(frozen=True, slots=True)
class PolicyAnnouncement:
    """A genesis trainer's statement that policy ``version`` exists, with its manifest's id and,
    when it is small (``INLINE_MANIFEST_MAX``), the signed manifest itself.

    The manifest rides along so that no receiver has to ask for it: at an announcement every
    node wanted it at once, and at N = 100 loopback nodes the trainer's answers timed out
    (docs/BENCHMARKS.md, Scale). It is omitted from the wire when empty, so announcements
    without it keep the bytes (and ids) they always had."""

    KIND: ClassVar[str] = "policy-announcement"
    MAX_BYTES: ClassVar[int] = 1024 + INLINE_MANIFEST_MAX

    run_id: str
    version: int
    manifest_id: bytes
    issued_at: int
    manifest: bytes = b""
    """The signed ShardManifest's envelope (its sha256 is ``manifest_id``), or empty."""

    def __post_init__(self) -> None:
        if len(self.manifest) > INLINE_MANIFEST_MAX:
            raise MalformedError(
                f"inline manifest of {len(self.manifest)} bytes; at most {INLINE_MANIFEST_MAX}"
            )
        if self.manifest and hashlib.sha256(self.manifest).digest() != self.manifest_id:
            raise MalformedError("the inline manifest is not the one manifest_id names")

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "run_id": self.run_id,
            "version": self.version,
            "manifest_id": self.manifest_id,
            "issued_at": self.issued_at,
        }
        if self.manifest:
            wire["manifest"] = self.manifest
        return wire

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            run_id=f.text("run_id"),
            version=f.integer("version", minimum=0),
            manifest_id=f.blob("manifest_id", length=32),
            issued_at=f.integer("issued_at", minimum=0),
            manifest=f.blob("manifest", b""),
        )
