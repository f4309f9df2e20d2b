"""Policy versions as patches: what changed between two checkpoints, checked bit for bit.

Decisions this module owns:

- **Tensors, by name.** A version's weights are read as a list of tensors (``tensor_layout``)
  across every safetensors file of its manifest (one file, or a sharded checkpoint's files
  concatenated), each with its absolute byte span. A patch pairs each tensor of the new version
  with the old version's tensor of the same name, dtype and shape; anything else travels whole.
- **XOR of bit patterns, byte planes, zstd** (``encode_patch``). The patch of a paired tensor is
  ``new ^ old`` over its raw bytes: exact for every bit pattern (NaN payloads, inf, -0.0),
  because reconstruction is the same XOR. RL updates leave most bf16 weights bitwise unchanged
  and move the others by an ulp or two, so the XOR is mostly zero bytes with a few low mantissa
  bits set; splitting it into byte planes (all first bytes, then all second bytes, as blosc's
  shuffle does) puts the near-empty high bytes together, and zstd level 1 compresses it. Chosen
  by measurement (docs/BENCHMARKS.md, Delta SHARDCAST, bench/delta.py): on the XOR of two
  Qwen2-0.5B-shaped versions of the project's GRPO step at lr 3e-6 (4.0% of weights changed),
  zstd-1 with planes gave 4.07% of the full size, zstd-1 on raw bytes 4.5%, zlib-1 5.5-6.2%,
  zstd-9 3.6% at 4x the time, sparse (index, value) pairs 7.2%.
- **Chunks.** Every tensor is cut into ``CHUNK`` bytes, each compressed alone: memory stays bounded
  by a chunk on both sides (a 7B model's embedding is a GiB), and a chunk that did not change at
  all costs nothing (its compressed length is 0).
- **Chains in one pass** (``apply_patches``, ``composable``). XORs compose, so a node that is
  several versions behind applies the chain of patches chunk by chunk and writes the newest
  version once, checked against the newest manifest; the versions between are not rebuilt.
- **Checked on arrival** (``apply_patch``). The manifest signs the sha256 of every tensor of the
  reconstructed version (``ShardManifest.tensors``) and of its safetensors header; the patch's
  own bytes are checked by their shard hashes on the way in, like any version. A reconstruction
  that differs anywhere raises ``PatchError`` naming the first tensor that differs, and leaves
  nothing behind (the output is written to a temporary name and renamed only once every tensor
  matched).

The patch format (``swarm-patch/1``, specified in docs/shardcast.md)::

    magic    8 bytes  b"SWPATCH1"
    length   u64 LE   length of the index
    index    msgpack  {"header": bin, "chunk": int,
                       "tensors": [[name, mode, [chunk lengths ...]], ...]}
    payload           every chunk's zstd frame, in index order (length 0: chunk unchanged)

``header`` is the new version's safetensors header (the JSON), ``mode`` is ``"xor"`` (against
the base tensor of that name) or ``"raw"`` (the tensor's own bytes, byte-planed and compressed).
The index lists the new version's tensors in the order of their data offsets.

numpy and zstandard are imported inside the functions that need them (``swarm`` imports neither
at import time).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from swarm.errors import ConfigError, ValidationError

MAGIC = b"SWPATCH1"
CHUNK = 4 * 1024 * 1024
"""Bytes of a tensor compressed as one zstd frame (a multiple of every dtype's item size)."""
ZSTD_LEVEL = 1
MAX_HEADER = 100 * 1024 * 1024
MAX_INDEX = 64 * 1024 * 1024
_ITEM_SIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class PatchError(ValidationError):
    """A patch that is malformed, or does not reconstruct the bytes its manifest signs."""


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of a version: its name, dtype, shape and absolute byte span in the data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def item_size(self) -> int:
        return _ITEM_SIZE.get(self.dtype, 1)


@dataclass(frozen=True, slots=True)
class PatchStats:
    """What ``encode_patch`` wrote: the patch's size against the full version's."""

    patch_bytes: int
    full_bytes: int
    changed_chunks: int
    chunks: int
    raw_tensors: int
    tensors: tuple[tuple[str, bytes], ...] = ()
    """``(name, sha256)`` of every tensor of the new version, hashed on the same read."""

    @property
    def share(self) -> float:
        return self.patch_bytes / max(1, self.full_bytes)


# --- reading a version's tensors -------------------------------------------------------------


def read_header(fd: int, offset: int = 0, size: int | None = None) -> tuple[bytes, dict[str, Any]]:
    """The raw header (JSON bytes) and parsed header of the safetensors file at ``offset``."""
    head = os.pread(fd, 8, offset)
    if len(head) < 8:
        raise ConfigError("not a safetensors file (shorter than 8 bytes)")
    (length,) = struct.unpack("<Q", head)
    limit = MAX_HEADER if size is None else min(MAX_HEADER, size - 8)
    if length > limit:
        raise ConfigError(f"not a safetensors file (header length {length})")
    raw = os.pread(fd, length, offset + 8)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("not a safetensors file (header is not JSON)") from exc
    if not isinstance(header, dict):
        raise ConfigError("not a safetensors file (header is not a map)")
    return raw, header


def _tensors_of(header: dict[str, Any], data_start: int, data_size: int) -> list[Tensor]:
    out: list[Tensor] = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in spec["data_offsets"])
            dtype = str(spec["dtype"])
            shape = tuple(int(x) for x in spec["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"safetensors header entry {name[:80]!r} is malformed") from exc
        if not 0 <= begin <= end <= data_size:
            raise ConfigError(f"tensor {name[:80]!r} lies outside its file's data")
        out.append(Tensor(name, dtype, shape, data_start + begin, data_start + end))
    out.sort(key=lambda t: (t.start, t.end))
    return out


def tensor_layout(path: Path, files: Sequence[tuple[int, int]] | None = None) -> list[Tensor]:
    """Every tensor of the version whose bytes are ``path``: one safetensors file, or (``files``,
    each ``(offset, size)``) several concatenated. ``ConfigError`` for bytes that are not
    safetensors, or a name that two files both hold."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        spans = files if files is not None else [(0, os.fstat(fd).st_size)]
        tensors: list[Tensor] = []
        for offset, size in spans:
            raw, header = read_header(fd, offset, size)
            start = offset + 8 + len(raw)
            tensors += _tensors_of(header, start, offset + size - start)
    finally:
        os.close(fd)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: a tensor name occurs in two of the version's files")
    return tensors


class TensorHasher:
    """sha256 of every tensor, fed the version's bytes in order as they stream by (so a
    publish reads each byte once for shard hashes and tensor hashes together)."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self._tensors = sorted(tensors, key=lambda t: t.start)
        self._hashes = [hashlib.sha256() for _ in self._tensors]
        self._next = 0  # the first tensor not yet fully fed

    def update(self, offset: int, block: memoryview | bytes) -> None:
        """Feed ``block``, which lies at ``offset`` of the version's bytes."""
        end = offset + len(block)
        i = self._next
        while i < len(self._tensors) and self._tensors[i].start < end:
            t = self._tensors[i]
            lo, hi = max(t.start, offset), min(t.end, end)
            if lo < hi:
                self._hashes[i].update(block[lo - offset : hi - offset])
            if t.end <= end:
                i += 1
                self._next = i
            else:
                break

    def digests(self) -> tuple[tuple[str, bytes], ...]:
        return tuple((t.name, h.digest()) for t, h in zip(self._tensors, self._hashes, strict=True))


def hash_tensors(
    path: Path, files: Sequence[tuple[int, int]] | None = None
) -> tuple[tuple[str, bytes], ...]:
    """``(name, sha256)`` of every tensor of the version at ``path``, in data order."""
    tensors = tensor_layout(path, files)
    hasher = TensorHasher(tensors)
    for offset, block in _blocks(path):
        hasher.update(offset, block)
    return hasher.digests()


def header_sha256(path: Path) -> bytes:
    """sha256 of the safetensors header (the JSON bytes) of the single file ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        raw, _ = read_header(fd)
    finally:
        os.close(fd)
    return hashlib.sha256(raw).digest()


def _blocks(path: Path, block: int = 1 << 20) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb", buffering=0) as f:
        offset = 0
        while chunk := f.read(block):
            yield offset, chunk
            offset += len(chunk)


# --- byte planes -----------------------------------------------------------------------------


def _planes(data: Any, item: int) -> Any:
    """``data`` (a uint8 array) with byte k of every item together: blosc's shuffle. Strided
    copies, one plane at a time: 5x faster here than a transpose of the (n, item) view."""
    if item == 1:
        return data
    import numpy as np

    out = np.empty_like(data)
    m = data.size // item
    for k in range(item):
        out[k * m : (k + 1) * m] = data[k::item]
    return out


def _unplanes(data: Any, item: int) -> Any:
    if item == 1:
        return data
    import numpy as np

    out = np.empty_like(data)
    m = data.size // item
    for k in range(item):
        out[k::item] = data[k * m : (k + 1) * m]
    return out


# --- encoding --------------------------------------------------------------------------------


def encode_patch(
    base: Path,
    target: Path,
    out: Path,
    *,
    base_files: Sequence[tuple[int, int]] | None = None,
    chunk: int = CHUNK,
) -> PatchStats:
    """Write to ``out`` the patch that turns version bytes ``base`` into the single safetensors
    file ``target``. Streams chunk by chunk; memory stays within a few chunks."""
    import numpy as np
    import zstandard

    if chunk % 8:
        raise ConfigError("the patch chunk must be a multiple of 8 bytes")
    old = {t.name: t for t in tensor_layout(base, base_files)}
    new = tensor_layout(target)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    entries: list[list[Any]] = []
    digests: list[tuple[str, bytes]] = []
    changed = chunks = raw_tensors = 0
    payload = out.with_name(out.name + ".payload")
    bfd = os.open(base, os.O_RDONLY)
    tfd = os.open(target, os.O_RDONLY)
    try:
        header, _ = read_header(tfd)
        with open(payload, "wb") as body:
            for t in new:
                pair = old.get(t.name)
                xor = pair is not None and (pair.dtype, pair.shape) == (t.dtype, t.shape)
                raw_tensors += not xor
                lengths: list[int] = []
                digest = hashlib.sha256()
                for lo in range(0, t.nbytes, chunk):
                    n = min(chunk, t.nbytes - lo)
                    now = np.frombuffer(_pread(tfd, n, t.start + lo), dtype=np.uint8)
                    digest.update(now.data)
                    if xor:
                        assert pair is not None
                        was = np.frombuffer(_pread(bfd, n, pair.start + lo), dtype=np.uint8)
                        now = np.bitwise_xor(now, was)
                        if not now.any():
                            lengths.append(0)
                            chunks += 1
                            continue
                    frame = compressor.compress(_planes(now, t.item_size))
                    body.write(frame)
                    lengths.append(len(frame))
                    chunks += 1
                    changed += 1
                entries.append([t.name, "xor" if xor else "raw", lengths])
                digests.append((t.name, digest.digest()))
        index = msgpack.packb({"header": header, "chunk": chunk, "tensors": entries})
        with open(out, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(index)) + index)
            with open(payload, "rb") as body_in:
                while block := body_in.read(1 << 20):
                    f.write(block)
            f.flush()
            os.fsync(f.fileno())
    finally:
        os.close(bfd)
        os.close(tfd)
        payload.unlink(missing_ok=True)
    return PatchStats(
        patch_bytes=out.stat().st_size,
        full_bytes=target.stat().st_size,
        changed_chunks=changed,
        chunks=chunks,
        raw_tensors=raw_tensors,
        tensors=tuple(digests),
    )


def _pread(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:  # pread may return short on some filesystems
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise PatchError(f"a version's file ended at byte {offset + len(data)}")
        data += more
    return data


# --- applying --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Index:
    header: bytes
    chunk: int
    tensors: list[tuple[str, str, list[int]]]
    payload_at: int


def _read_index(fd: int, size: int) -> _Index:
    head = os.pread(fd, 16, 0)
    if len(head) < 16 or head[:8] != MAGIC:
        raise PatchError("not a swarm-patch/1 patch (bad magic)")
    (length,) = struct.unpack("<Q", head[8:])
    if length > min(MAX_INDEX, size - 16):
        raise PatchError(f"patch index length {length} is out of bounds")
    try:
        index = msgpack.unpackb(
            _pread(fd, length, 16), raw=False, max_bin_len=MAX_HEADER, strict_map_key=True
        )
        header = index["header"]
        chunk = index["chunk"]
        tensors = [(str(n), str(m), [int(c) for c in cs]) for n, m, cs in index["tensors"]]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise PatchError(f"patch index is malformed: {exc}") from exc
    if not isinstance(header, bytes) or not isinstance(chunk, int) or chunk < 8 or chunk % 8:
        raise PatchError("patch index is malformed (header or chunk)")
    if any(c < 0 for _, _, cs in tensors for c in cs):
        raise PatchError("patch index holds a negative chunk length")
    if 16 + length + sum(c for _, _, cs in tensors for c in cs) != size:
        raise PatchError("patch payload does not have the length its index says")
    return _Index(header, chunk, tensors, 16 + length)


def composable(patches: Sequence[Path]) -> bool:
    """Whether a chain of patches (oldest first) can be applied in one pass: every patch after
    the first lays out the same tensors (the same header) as the one before and XORs every one
    of them. Successive versions of one trainer's model are; a chain that changes a tensor's
    shape or dtype, or adds one, is applied a version at a time."""
    indices = []
    for path in patches:
        fd = os.open(path, os.O_RDONLY)
        try:
            indices.append(_read_index(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    first = indices[0]
    return all(
        i.header == first.header
        and i.chunk == first.chunk
        and [n for n, _, _ in i.tensors] == [n for n, _, _ in first.tensors]
        and all(mode == "xor" for _, mode, _ in i.tensors)
        for i in indices[1:]
    )


def apply_patch(
    base: Path,
    patch: Path,
    out: Path,
    *,
    tensors: Sequence[tuple[str, bytes]],
    header_sha256: bytes,
    base_files: Sequence[tuple[int, int]] | None = None,
) -> None:
    """Reconstruct into ``out`` the version that ``patch`` makes of version bytes ``base``, and
    check it against the manifest's ``tensors`` (name, sha256) and ``header_sha256``.

    ``PatchError`` when the patch is malformed, needs a base tensor that is not there, or
    reconstructs other bytes than the manifest signs (naming the first tensor that differs);
    nothing is left at ``out`` then. Memory stays within a few chunks."""
    apply_patches(
        base, [patch], out, tensors=tensors, header_sha256=header_sha256, base_files=base_files
    )


def apply_patches(
    base: Path,
    patches: Sequence[Path],
    out: Path,
    *,
    tensors: Sequence[tuple[str, bytes]],
    header_sha256: bytes,
    base_files: Sequence[tuple[int, int]] | None = None,
) -> None:
    """``apply_patch`` of a whole chain at once (``composable``; oldest first): each chunk of
    the newest version is the first patch's chunk on ``base``, XORed with every later patch's
    chunk (the XORs compose), so one file is written however long the chain, and only the
    newest version's ``tensors`` and ``header_sha256`` (its manifest's) are checked. The
    versions between are not reconstructed: they are checked by their shard hashes only."""
    import numpy as np
    import zstandard

    if not patches:
        raise PatchError("no patch to apply")
    if len(patches) > 1 and not composable(patches):
        raise PatchError("this chain of patches cannot be applied in one pass (see composable)")
    old = {t.name: t for t in tensor_layout(base, base_files)}
    fds = [os.open(p, os.O_RDONLY) for p in patches]
    bfd = os.open(base, os.O_RDONLY)
    tmp = out.with_name(out.name + ".tmp")
    try:
        indices = [_read_index(fd, os.fstat(fd).st_size) for fd in fds]
        index = indices[-1]
        if hashlib.sha256(index.header).digest() != header_sha256:
            raise PatchError("the patch's safetensors header is not the one the manifest signs")
        try:
            header = json.loads(index.header)
        except (ValueError, UnicodeDecodeError) as exc:
            raise PatchError("the patch's safetensors header is not JSON") from exc
        if not isinstance(header, dict):
            raise PatchError("the patch's safetensors header is not a map")
        start = 8 + len(index.header)
        layout = _tensors_of(header, start, 1 << 62)
        expected = dict(tensors)
        if [t.name for t in layout] != [n for n, _, _ in indices[0].tensors]:
            raise PatchError("the patch's index and its header list different tensors")
        if set(expected) != {t.name for t in layout}:
            raise PatchError("the patch's tensors are not the ones the manifest signs")
        decompressor = zstandard.ZstdDecompressor()
        at = [i.payload_at for i in indices]

        def frame(i: int, length: int, n: int, name: str) -> Any:
            """Chunk bytes of patch ``i`` (un-planed; still XORed where its mode says)."""
            try:
                plain = decompressor.decompress(_pread(fds[i], length, at[i]), max_output_size=n)
            except zstandard.ZstdError as exc:
                raise PatchError(f"tensor {name[:80]!r}: bad zstd frame") from exc
            if len(plain) != n:
                raise PatchError(f"tensor {name[:80]!r}: a chunk has the wrong size")
            return np.frombuffer(plain, dtype=np.uint8)

        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(index.header)) + index.header)
            written = start
            for k_t, t in enumerate(layout):
                name, mode, _ = indices[0].tensors[k_t]
                chunks = [i.tensors[k_t][2] for i in indices]
                if t.start != written:
                    raise PatchError(f"tensor {name[:80]!r} does not follow the previous one")
                pair = old.get(name)
                paired = pair is not None and (pair.dtype, pair.shape) == (t.dtype, t.shape)
                if mode == "xor" and not paired:
                    raise PatchError(
                        f"tensor {name[:80]!r} is patched against a base tensor that the base"
                        " version does not hold"
                    )
                if mode not in ("xor", "raw"):
                    raise PatchError(f"tensor {name[:80]!r} has unknown patch mode {mode[:16]!r}")
                want = -(-t.nbytes // index.chunk)
                if any(len(c) != want for c in chunks):
                    raise PatchError(f"tensor {name[:80]!r} has the wrong number of chunks")
                digest = hashlib.sha256()
                for k in range(want):
                    lo = k * index.chunk
                    n = min(index.chunk, t.nbytes - lo)
                    first = chunks[0][k]
                    if mode == "raw":
                        data = _unplanes(frame(0, first, n, name), t.item_size)
                    else:
                        assert pair is not None
                        data = np.frombuffer(_pread(bfd, n, pair.start + lo), dtype=np.uint8)
                        if first:
                            delta = _unplanes(frame(0, first, n, name), t.item_size)
                            data = np.bitwise_xor(data, delta)
                    at[0] += first
                    for i in range(1, len(indices)):
                        length = chunks[i][k]
                        if length:
                            delta = _unplanes(frame(i, length, n, name), t.item_size)
                            data = np.bitwise_xor(data, delta)
                            at[i] += length
                    view = memoryview(data)
                    digest.update(view)
                    f.write(view)
                written = t.end
                if digest.digest() != expected[name]:
                    raise PatchError(
                        f"tensor {name[:80]!r} reconstructs to other bytes than the manifest"
                        " signs (sha256); the patch or its base is not the trainer's"
                    )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        for fd in fds:
            os.close(fd)
        os.close(bfd)
        tmp.unlink(missing_ok=True)
