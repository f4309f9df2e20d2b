"""ShardManifest: the signed description of one policy version's weights, cut into shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from swarm.errors import MalformedError
from swarm.messages._base import Fields, typed


@dataclass(frozen=True, slots=True)
class ShardFile:
    """One file of the version, laid out at ``offset`` in the concatenation of all files."""

    path: str
    offset: int
    size: int

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path, "offset": self.offset, "size": self.size}

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        path = f.text("path")
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise MalformedError(f"shard file path {path[:64]!r} must be relative and inside")
        return cls(
            path=path, offset=f.integer("offset", minimum=0), size=f.integer("size", minimum=0)
        )


@dataclass(frozen=True, slots=True)
class ShardManifest:
    """Run, version, file layout, shard size, the sha256 of every shard, total size."""

    KIND: ClassVar[str] = "shard-manifest"
    MAX_BYTES: ClassVar[int] = 1024 * 1024

    run_id: str
    version: int
    files: tuple[ShardFile, ...]
    shard_size: int
    shard_hashes: tuple[bytes, ...]
    total_size: int
    created_at: int

    def __post_init__(self) -> None:
        if self.shard_size < 1:
            raise MalformedError("shard_size must be positive")
        expected = -(-self.total_size // self.shard_size)
        if len(self.shard_hashes) != expected:
            raise MalformedError(
                f"{len(self.shard_hashes)} shard hashes for {self.total_size} bytes in shards of"
                f" {self.shard_size}; expected {expected}"
            )
        if sum(f.size for f in self.files) != self.total_size:
            raise MalformedError("file sizes do not add up to total_size")

    def shard_span(self, index: int) -> tuple[int, int]:
        """(offset, length) of shard ``index`` in the concatenated version."""
        if not 0 <= index < len(self.shard_hashes):
            raise MalformedError(
                f"shard index {index} out of range 0..{len(self.shard_hashes) - 1}"
            )
        start = index * self.shard_size
        return start, min(self.shard_size, self.total_size - start)

    def to_wire(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "version": self.version,
            "files": [f.to_wire() for f in self.files],
            "shard_size": self.shard_size,
            "shard_hashes": list(self.shard_hashes),
            "total_size": self.total_size,
            "created_at": self.created_at,
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        def sha256(value: Any) -> bytes:
            digest = typed(bytes, "shard_hashes")(value)
            if len(digest) != 32:
                raise MalformedError("every shard hash is 32 bytes")
            return digest

        return cls(
            run_id=f.text("run_id"),
            version=f.integer("version", minimum=0),
            files=f.items("files", ShardFile.from_wire),
            shard_size=f.integer("shard_size", minimum=1),
            shard_hashes=f.seq("shard_hashes", sha256),
            total_size=f.integer("total_size", minimum=0),
            created_at=f.integer("created_at", minimum=0),
        )
