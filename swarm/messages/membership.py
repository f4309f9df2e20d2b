"""Who is in the run (RoleAdvert, stored in the DHT) and which policy is newest
(PolicyAnnouncement, gossiped)."""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class PolicyAnnouncement:
    """A genesis trainer's statement that policy ``version`` exists, with its manifest's id."""

    KIND: ClassVar[str] = "policy-announcement"
    MAX_BYTES: ClassVar[int] = 1024

    run_id: str
    version: int
    manifest_id: bytes
    issued_at: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "version": self.version,
            "manifest_id": self.manifest_id,
            "issued_at": self.issued_at,
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            run_id=f.text("run_id"),
            version=f.integer("version", minimum=0),
            manifest_id=f.blob("manifest_id", length=32),
            issued_at=f.integer("issued_at", minimum=0),
        )
