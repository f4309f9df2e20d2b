"""TOPLOC proofs: byte-identity with a slow plain-integer transcription of the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import ProofError
from swarm.toploc import (
    ProofCheck,
    ProofThresholds,
    build_proofs,
    build_proofs_batch,
    proof_size,
    proofs_pass,
    to_bf16_bits,
    verify_proofs,
)

P = 65497


# -- slow reference: plain Python integers, transcribed from toploc's poly.py / ndd.cpp ---------


def ref_injective_modulus(x: list[int]) -> int:
    for i in range(65497, 2**15, -1):
        if len({j % i for j in x}) == len(x):
            return i
    raise ValueError("no modulus")


def ref_newton(x: list[int], y: list[int]) -> list[int]:
    n = len(x)
    dd = [v % P for v in y]
    for k in range(1, n):
        for i in range(n - 1, k - 1, -1):
            num = (dd[i] - dd[i - 1]) % P
            den = (x[i] - x[i - k]) % P
            dd[i] = num * pow(den, P - 2, P) % P
    coeffs = [0] * n
    factor = [1] + [0] * (n - 1)
    for i in range(n):
        for j in range(i + 1):
            coeffs[j] = (coeffs[j] + dd[i] * factor[j]) % P
        if i + 1 < n:
            minus = (-x[i]) % P
            prev = factor[0]
            factor[0] = prev * minus % P
            for k in range(1, i + 2):
                old = factor[k]
                factor[k] = (prev + old * minus) % P
                prev = old
    return coeffs


def ref_eval(coeffs: list[int], x: int) -> int:
    r = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        r = (r * x + c) % P
    return r


def ref_topk(flat: torch.Tensor, k: int) -> list[int]:
    return flat.abs().float().topk(k).indices.tolist()


def ref_build(hidden: torch.Tensor, chunk: int, k: int) -> list[bytes]:
    out = []
    for start in range(0, hidden.shape[0], chunk):
        flat = hidden[start : start + chunk].reshape(-1)
        idx = ref_topk(flat, k)
        ys = flat[idx].view(torch.uint16).tolist()
        m = ref_injective_modulus(idx)
        coeffs = ref_newton([i % m for i in idx], ys)
        out.append(m.to_bytes(2, "big") + b"".join(c.to_bytes(2, "big") for c in coeffs))
    return out


def ref_verify(hidden: torch.Tensor, proofs: list[bytes], chunk: int, k: int) -> list[ProofCheck]:
    results = []
    for n, start in enumerate(range(0, hidden.shape[0], chunk)):
        flat = hidden[start : start + chunk].reshape(-1)
        data = proofs[n]
        m = int.from_bytes(data[:2], "big")
        coeffs = [int.from_bytes(data[i : i + 2], "big") for i in range(2, len(data), 2)]
        idx = ref_topk(flat, k)
        own = flat[idx].view(torch.uint16).tolist()
        claimed = [ref_eval(coeffs, i % m) for i in idx]
        mism, errs = 0, []
        for c, o in zip(claimed, own, strict=True):
            if (c & 0x7F80) != (o & 0x7F80):
                mism += 1
            else:
                errs.append(abs((c & 0x7F) - (o & 0x7F)))
        errs.sort()
        if errs:
            results.append(ProofCheck(mism, sum(errs) / len(errs), float(errs[len(errs) // 2])))
        else:
            results.append(ProofCheck(mism, 2.0**64, 2.0**64))
    return results


def distinct_magnitudes(rows: int, dim: int, seed: int) -> torch.Tensor:
    """bf16 activations whose 256 largest magnitudes per 32-row chunk are distinct, so every
    top-k set (k <= 256) is unambiguous: small background values (ties allowed) plus 256
    planted distinct magnitudes per chunk at random positions, random signs."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0x0100, 0x3000, (rows, dim)).astype(np.uint16)
    for start in range(0, rows, 32):
        flat = bits[start : start + 32].reshape(-1)
        n_plant = min(256, flat.size)
        pos = rng.choice(flat.size, n_plant, replace=False)
        flat[pos] = (0x3000 + rng.choice(0x4000, n_plant, replace=False)).astype(np.uint16)
        bits[start : start + 32] = flat.reshape(-1, dim)
    bits |= (rng.integers(0, 2, bits.shape) << 15).astype(np.uint16)
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


# -- byte identity --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "dim", "chunk", "k"),
    [(32, 64, 32, 128), (70, 96, 32, 128), (5, 16, 2, 8), (33, 3000, 32, 128)],
)
def test_proofs_are_byte_identical_to_the_reference(
    rows: int, dim: int, chunk: int, k: int
) -> None:
    hidden = distinct_magnitudes(rows, dim, seed=rows * dim)
    ours = build_proofs(hidden, chunk_size=chunk, topk=k)
    assert ours == ref_build(hidden, chunk, k)
    assert all(len(p) == proof_size(k) for p in ours)
    assert len(ours) == -(-rows // chunk)


def test_batch_build_equals_per_sample_build() -> None:
    hiddens = [distinct_magnitudes(r, 64, seed=r) for r in (3, 40, 70)]
    assert build_proofs_batch(hiddens) == [build_proofs(h) for h in hiddens]
    assert build_proofs_batch([]) == []


def test_numpy_bits_torch_bf16_and_float32_inputs_give_the_same_proofs() -> None:
    hidden = distinct_magnitudes(40, 64, seed=1)
    bits = hidden.view(torch.int16).numpy().view(np.uint16)
    a = build_proofs(hidden)
    assert build_proofs(bits) == a
    assert build_proofs(hidden.float().numpy()) == a
    assert build_proofs(hidden.float()) == a


def test_float32_rounds_to_bf16_like_torch() -> None:
    x = torch.randn(64, 64) * 10
    ours = to_bf16_bits(x.numpy())
    assert (ours == x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)).all()


def test_large_hidden_needs_a_smaller_modulus_and_still_matches() -> None:
    hidden = distinct_magnitudes(32, 4096, seed=7)
    flat = hidden.view(-1).view(torch.int16)
    flat[5], flat[5 + 65497] = 0x7100, 0x7101  # the two largest, colliding mod 65497
    proofs = build_proofs(hidden)
    assert int.from_bytes(proofs[0][:2], "big") < 65497
    assert proofs == ref_build(hidden, 32, 128)


def test_verification_matches_the_reference_on_perturbed_activations() -> None:
    hidden = distinct_magnitudes(64, 128, seed=3)
    proofs = build_proofs(hidden)
    for scale in (1.0, 1.01, 1.1, 4.0):
        other = (hidden.float() * scale).to(torch.bfloat16)
        assert verify_proofs(other, proofs) == ref_verify(other, proofs, 32, 128)


def test_honest_proofs_verify_with_zero_error() -> None:
    hidden = distinct_magnitudes(50, 128, seed=4)
    checks = verify_proofs(hidden, build_proofs(hidden))
    assert checks == [ProofCheck(0, 0.0, 0.0)] * 2
    assert proofs_pass(checks)


def test_reference_scenarios_small_noise_passes_large_fails() -> None:
    # The reference's own tests: x1.01 gives small mantissa errors, x1.10 large ones, x4 no match.
    hidden = distinct_magnitudes(64, 128, seed=5)
    proofs = build_proofs(hidden)
    near = verify_proofs((hidden.float() * 1.01).to(torch.bfloat16), proofs)
    far = verify_proofs((hidden.float() * 1.10).to(torch.bfloat16), proofs)
    none = verify_proofs((hidden.float() * 4).to(torch.bfloat16), proofs)
    assert all(c.exp_mismatches <= 8 and 0 < c.mant_err_mean <= 2 for c in near)
    assert proofs_pass(near)
    assert all(c.mant_err_mean > 10 for c in far)
    assert not proofs_pass(far)
    assert all(c.exp_mismatches == 128 and c.mant_err_mean == 2.0**64 for c in none)


def test_other_activations_fail() -> None:
    a = distinct_magnitudes(32, 128, seed=8)
    b = distinct_magnitudes(32, 128, seed=9)
    assert not proofs_pass(verify_proofs(b, build_proofs(a)))


def test_thresholds_are_inclusive() -> None:
    t = ProofThresholds()
    assert t.passes(ProofCheck(38, 10.0, 8.0))
    assert not t.passes(ProofCheck(39, 0.0, 0.0))
    assert not t.passes(ProofCheck(0, 10.5, 0.0))
    assert not t.passes(ProofCheck(0, 0.0, 9.0))


# -- bad input: only ProofError -------------------------------------------------------------------


def test_wrong_number_of_proofs_is_a_proof_error() -> None:
    hidden = distinct_magnitudes(40, 64, seed=2)
    proofs = build_proofs(hidden)
    with pytest.raises(ProofError):
        verify_proofs(hidden, proofs[:1])


@pytest.mark.parametrize(
    "bad", [np.zeros((4,), np.float32), np.zeros((2, 2, 2)), np.array([["a"]]), "text"]
)
def test_bad_hidden_is_a_proof_error(bad: object) -> None:
    with pytest.raises(ProofError):
        build_proofs(bad)


def test_non_finite_hidden_is_a_proof_error() -> None:
    h = np.ones((4, 64), np.float32)
    h[1, 3] = np.inf
    with pytest.raises(ProofError):
        build_proofs(h)


def test_chunk_too_small_for_topk_is_a_proof_error() -> None:
    with pytest.raises(ProofError):
        build_proofs(np.ones((1, 64), np.float32))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=300), min_size=0, max_size=3))
def test_random_bytes_as_proofs_raise_only_proof_error(proofs: list[bytes]) -> None:
    hidden = distinct_magnitudes(64, 64, seed=11)
    try:
        checks = verify_proofs(hidden, proofs)
    except ProofError:
        return
    assert len(checks) == 2


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 80),
    st.sampled_from([8, 16, 64]),
    st.integers(0, 2**31),
)
def test_round_trip_any_shape(rows: int, dim: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, dim, generator=g) * 3).to(torch.bfloat16)
    k = min(8, rows % 32 * dim or 32 * dim)
    proofs = build_proofs(hidden, topk=k)
    assert len(proofs) == -(-rows // 32)
    assert all(c == ProofCheck(0, 0.0, 0.0) for c in verify_proofs(hidden, proofs, topk=k))
