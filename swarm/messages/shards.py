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
    base: int | None = None
    """A patch: the version whose weights these bytes patch (docs/shardcast.md); ``None``: the
    bytes are the version's weights themselves (a full version, or a snapshot)."""
    base_id: bytes = b""
    """A patch: the manifest id of ``base`` (so it applies to exactly that copy)."""
    tensors: tuple[tuple[str, bytes], ...] = ()
    """``(name, sha256)`` of every tensor of the version's weights, in data order: what a
    reconstruction is checked against, bit for bit (empty in manifests before issue 25)."""
    header_sha256: bytes = b""
    """A patch: the sha256 of the reconstructed safetensors file's header."""
    weights_size: int = 0
    """Bytes of the version's weights (for a patch, of the reconstructed file)."""

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
        if self.base is not None and (
            not 0 <= self.base < self.version
            or len(self.base_id) != 32
            or len(self.header_sha256) != 32
            or not self.tensors
        ):
            raise MalformedError(
                "a patch names an earlier base version, its manifest id, its header hash and"
                " its tensors"
            )

    @property
    def is_patch(self) -> bool:
        return self.base is not None

    @property
    def full_size(self) -> int:
        """Bytes of the version's weights: the reconstructed size of a patch."""
        return self.weights_size or self.total_size

    def file_spans(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of each file in the version's bytes."""
        return [(f.offset, f.size) for f in self.files]

    def shard_span(self, index: int) -> tuple[int, int]:
        """(offset, length) of shard ``index`` in the concatenated version."""
        if not 0 <= index < len(self.shard_hashes):
            raise MalformedError(
                f"shard index {index} out of range 0..{len(self.shard_hashes) - 1}"
            )
        start = index * self.shard_size
        return start, min(self.shard_size, self.total_size - start)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "version": self.version,
            "files": [f.to_wire() for f in self.files],
            "shard_size": self.shard_size,
            "shard_hashes": list(self.shard_hashes),
            "total_size": self.total_size,
            "created_at": self.created_at,
        }
        # Written only when set: a manifest without them encodes exactly as before issue 25.
        if self.base is not None:
            out["base"] = self.base
            out["base_id"] = self.base_id
            out["header_sha256"] = self.header_sha256
        if self.tensors:
            out["tensors"] = [[name, digest] for name, digest in self.tensors]
        if self.weights_size:
            out["weights_size"] = self.weights_size
        return out

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
            base=f.integer("base", minimum=0) if f.has("base") else None,
            base_id=f.blob("base_id", b""),
            tensors=f.seq("tensors", _tensor_hash, []),
            header_sha256=f.blob("header_sha256", b""),
            weights_size=f.integer("weights_size", 0, minimum=0),
        )


def _tensor_hash(value: Any) -> tuple[str, bytes]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not isinstance(value[0], str)
        or not isinstance(value[1], bytes)
        or len(value[1]) != 32
    ):
        raise MalformedError("every tensor hash is [name, 32-byte sha256]")
    return value[0], value[1]
