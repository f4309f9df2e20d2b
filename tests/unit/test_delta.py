"""Patches reconstruct the new version bit for bit (every bit pattern: NaN payloads, inf, -0.0),
cost nothing where nothing changed, and anything that is not the signed bytes is refused."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from swarm.shardcast.delta import (
    MAGIC,
    PatchError,
    apply_patch,
    apply_patches,
    composable,
    encode_patch,
    hash_tensors,
    header_sha256,
    tensor_layout,
)

SPECIAL = np.array([0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x7F81], np.uint16)
"""bf16 bit patterns: quiet NaN, a negative NaN with a payload, +inf, -inf, -0.0, +0.0, the
smallest subnormal, a signalling NaN."""


def write(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file(tensors, str(path))
    return path


def roundtrip(tmp: Path, old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> bytes:
    base, target = write(tmp / "base", old), write(tmp / "target", new)
    encode_patch(base, target, tmp / "patch", chunk=64)
    apply_patch(
        base,
        tmp / "patch",
        tmp / "out",
        tensors=hash_tensors(target),
        header_sha256=header_sha256(target),
    )
    out = (tmp / "out").read_bytes()
    assert out == target.read_bytes()
    return (tmp / "patch").read_bytes()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(0, 300),
    share=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
    specials=st.booleans(),
)
def test_a_patch_reconstructs_random_sparse_updates_bit_for_bit(
    tmp_path: Path, n: int, share: float, seed: int, specials: bool
) -> None:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 2**16, n, dtype=np.uint16)
    if specials and n:
        old[rng.integers(0, n, min(n, 8))] = SPECIAL[: min(n, 8)]
    new = old.copy()
    hit = rng.random(n) < share
    new[hit] = rng.integers(0, 2**16, int(hit.sum()), dtype=np.uint16)
    if specials and n:
        new[rng.integers(0, n, min(n, 8))] = SPECIAL[::-1][: min(n, 8)]
    roundtrip(
        tmp_path,
        {"w": old, "f32": old.view(np.uint8)[: n // 4 * 4].view(np.float32).copy()},
        {"w": new, "f32": new.view(np.uint8)[: n // 4 * 4].view(np.float32).copy()},
    )


def test_unchanged_chunks_cost_nothing_and_new_tensors_travel_whole(tmp_path: Path) -> None:
    same = np.arange(4096, dtype=np.uint16)
    patch = roundtrip(
        tmp_path,
        {"a": same, "gone": np.ones(3, np.float32)},
        {"a": same, "b": np.arange(10, dtype=np.int64), "c": np.zeros((2, 3), np.float32)},
    )
    full = (tmp_path / "target").stat().st_size
    assert len(patch) < full / 4


def test_a_tensor_of_another_shape_is_not_xored_against_the_old_one(tmp_path: Path) -> None:
    roundtrip(tmp_path, {"w": np.ones(8, np.float32)}, {"w": np.ones((2, 8), np.float32)})


def test_several_files_as_the_base(tmp_path: Path) -> None:
    """A sharded checkpoint's files laid end to end are a base like one file."""
    a = write(tmp_path / "a", {"x": np.arange(100, dtype=np.float32)})
    b = write(tmp_path / "b", {"y": np.arange(50, dtype=np.uint16)})
    joined = tmp_path / "joined"
    joined.write_bytes(a.read_bytes() + b.read_bytes())
    spans = [(0, a.stat().st_size), (a.stat().st_size, b.stat().st_size)]
    assert [t.name for t in tensor_layout(joined, spans)] == ["x", "y"]
    target = write(
        tmp_path / "t",
        {"x": np.arange(100, dtype=np.float32) + 1, "y": np.arange(50, dtype=np.uint16)},
    )
    encode_patch(joined, target, tmp_path / "patch", base_files=spans)
    apply_patch(
        joined,
        tmp_path / "patch",
        tmp_path / "out",
        tensors=hash_tensors(target),
        header_sha256=header_sha256(target),
        base_files=spans,
    )
    assert (tmp_path / "out").read_bytes() == target.read_bytes()


@pytest.fixture
def patched(tmp_path: Path) -> tuple[Path, Path, Path]:
    rng = np.random.default_rng(1)
    old = rng.integers(0, 2**16, 5000, dtype=np.uint16)
    new = old.copy()
    new[::37] += 1
    base = write(tmp_path / "base", {"w": old, "b": np.ones(4, np.float32)})
    target = write(tmp_path / "target", {"w": new, "b": np.ones(4, np.float32)})
    encode_patch(base, target, tmp_path / "patch", chunk=1024)
    return base, target, tmp_path / "patch"


def apply_to(base: Path, target: Path, patch: Path, out: Path) -> None:
    apply_patch(base, patch, out, tensors=hash_tensors(target), header_sha256=header_sha256(target))


def test_a_patch_applied_to_another_base_is_refused_by_its_tensor_hash(
    tmp_path: Path, patched: tuple[Path, Path, Path]
) -> None:
    _, target, patch = patched
    other = write(tmp_path / "other", {"w": np.zeros(5000, np.uint16), "b": np.ones(4, np.float32)})
    with pytest.raises(PatchError, match="tensor 'w' reconstructs to other bytes"):
        apply_to(other, target, patch, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda b: b[:-1], "payload does not have the length"),
        (lambda b: b"NOTPATCH" + b[8:], "bad magic"),
        (lambda b: b[:8] + struct.pack("<Q", 2**40) + b[16:], "index length"),
        (lambda b: b[:-5] + bytes(x ^ 0xFF for x in b[-5:]), "bad zstd frame|reconstructs"),
    ],
)
def test_a_damaged_patch_is_refused_with_one_line_and_nothing_written(
    tmp_path: Path,
    patched: tuple[Path, Path, Path],
    damage,
    why: str,  # type: ignore[no-untyped-def]
) -> None:
    base, target, patch = patched
    assert patch.read_bytes()[:8] == MAGIC
    patch.write_bytes(damage(patch.read_bytes()))
    with pytest.raises(PatchError, match=why) as info:
        apply_to(base, target, patch, tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_patch_whose_header_is_not_the_signed_one_is_refused(
    tmp_path: Path, patched: tuple[Path, Path, Path]
) -> None:
    base, target, patch = patched
    with pytest.raises(PatchError, match="header is not the one the manifest signs"):
        apply_patch(
            base, patch, tmp_path / "out", tensors=hash_tensors(target), header_sha256=bytes(32)
        )


def test_a_chain_of_patches_applies_in_one_pass_to_the_newest_version(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    w = rng.integers(0, 2**16, 3000, dtype=np.uint16)
    files = []
    for v in range(4):
        w = w.copy()
        w[rng.random(w.size) < 0.05] ^= 1
        files.append(write(tmp_path / f"v{v}", {"w": w, "b": np.full(3, v, np.float32)}))
    patches = []
    for v in range(1, 4):
        encode_patch(files[v - 1], files[v], tmp_path / f"p{v}", chunk=512)
        patches.append(tmp_path / f"p{v}")
    assert composable(patches)
    apply_patches(
        files[0],
        patches,
        tmp_path / "out",
        tensors=hash_tensors(files[3]),
        header_sha256=header_sha256(files[3]),
    )
    assert (tmp_path / "out").read_bytes() == files[3].read_bytes()
    # Checked against the newest manifest: the chain without its last patch is refused.
    with pytest.raises(PatchError, match="reconstructs to other bytes"):
        apply_patches(
            files[0],
            patches[:2],
            tmp_path / "out2",
            tensors=hash_tensors(files[3]),
            header_sha256=header_sha256(files[3]),
        )


def test_a_chain_that_changes_the_tensors_does_not_compose(tmp_path: Path) -> None:
    a = write(tmp_path / "a", {"w": np.zeros(64, np.uint16)})
    b = write(tmp_path / "b", {"w": np.ones(64, np.uint16)})
    c = write(tmp_path / "c", {"w": np.ones(64, np.uint16), "new": np.ones(2, np.uint8)})
    encode_patch(a, b, tmp_path / "p1")
    encode_patch(b, c, tmp_path / "p2")
    assert not composable([tmp_path / "p1", tmp_path / "p2"])
    with pytest.raises(PatchError, match="one pass"):
        apply_patches(
            a,
            [tmp_path / "p1", tmp_path / "p2"],
            tmp_path / "out",
            tensors=hash_tensors(c),
            header_sha256=header_sha256(c),
        )
