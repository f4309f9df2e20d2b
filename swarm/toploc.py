"""TOPLOC proofs of the final hidden states, byte-compatible with the reference implementation.

Reference: PrimeIntellect-ai/toploc (``toploc/poly.py``, ``toploc/C/csrc/poly.cpp``,
``toploc/C/csrc/ndd.cpp``, ``toploc/C/csrc/utils.cpp``). Each choice below, and where it comes
from:

* Chunks: the ``[n_tokens, hidden]`` activations are cut into chunks of ``chunk_size`` (32) token
  rows, a final shorter chunk gets its own proof, and each chunk is flattened row-major
  (``poly.py``: ``torch.cat([a.view(-1) ...])`` / ``poly.cpp``: ``activations.slice(0, ...)``
  then ``view({-1})``; this module is the reference's ``skip_prefill=True`` path).
* Values are bf16 (``from_points_tensor`` reads the bf16 bit patterns; float32 is refused there
  "because interpolate has hardcode prime"). Other float inputs are rounded to bf16 first, to
  nearest even as ``tensor.to(torch.bfloat16)`` does.
* Top-k: the ``topk`` entries of largest magnitude of the flattened chunk
  (``flat_view.abs().topk(topk).indices``). For finite bf16 values, magnitude order is the order
  of ``bits & 0x7FFF``, which is what we sort. The polynomial is the same whatever order the k
  points come in (interpolation through distinct points is unique), so only the *set* matters;
  **not pinned by the reference**: which of several equal magnitudes enters the set at the k-th
  place (torch leaves ``topk`` tie order unspecified, CPU and CUDA differ). We take the lower
  flat index first, deterministically.
* Modulus: the largest ``m <= 65497`` under which the k indices are pairwise distinct
  (``find_injective_modulus`` counts down from 65497; the C++ ``from_points`` does the same).
  x = index mod m.
* y = the bf16 bit pattern as an unsigned 16-bit integer, reduced mod 65497 (``ndd.cpp``
  ``compute_newton_coefficients`` starts from ``safeMod(y[i])``; only NaN patterns exceed it).
* Coefficients: Newton divided differences over GF(65497) expanded to the monomial basis,
  ``c[0] + c[1] x + ... + c[k-1] x^(k-1)`` (``ndd.cpp``), every value in [0, 65497).
* Bytes: m as u16 big-endian, then the k coefficients as u16 big-endian (``to_bytes``):
  2 + 2k = 258 bytes for k = 128.
* Verification (``poly.cpp`` ``verify_proofs``): the validator takes the top-k of its own
  activations, evaluates the committed polynomial at ``index mod m`` (Horner, mod 65497), reads
  each value as bf16 bits, and compares with its own values: exponent bits ``(b & 0x7F80) >> 7``
  and mantissa bits ``b & 0x7F``; the sign bit is not compared (as in the reference).
  ``exp_mismatches`` counts exponent differences; over the rest, the mean and median of
  ``|mantissa difference|``; with no matching exponent both are ``2**64``. The median is the
  C++ one, ``sorted[len // 2]`` (the Python fallback in ``poly.py`` averages the two middle
  values for even lengths; we follow the C++ path that ``verify_proofs_bytes`` takes for a
  tensor with ``skip_prefill``).

Thresholds (run genesis; defaults from the design): at most 38 exponent mismatches of 128,
mantissa error mean <= 10 and median <= 8.

Everything is vectorised with numpy across all chunks of a sample (loops run over the k
interpolation columns, never over elements). ``swarm`` does not import numpy or torch at import
time; torch tensors are accepted and converted inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from swarm.errors import ProofError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    U16 = npt.NDArray[np.uint16]
    I64 = npt.NDArray[np.int64]

PRIME = 65497
CHUNK_SIZE = 32
TOPK = 128
NO_MATCH_ERROR = float(2**64)


@dataclass(frozen=True)
class ProofCheck:
    """Verification numbers of one chunk (all measures of error: lower is better)."""

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float


@dataclass(frozen=True)
class ProofThresholds:
    """Acceptance thresholds of a run (a chunk passes when every number is at or below)."""

    max_exp_mismatches: int = 38
    max_mant_err_mean: float = 10.0
    max_mant_err_median: float = 8.0

    def passes(self, check: ProofCheck) -> bool:
        return (
            check.exp_mismatches <= self.max_exp_mismatches
            and check.mant_err_mean <= self.max_mant_err_mean
            and check.mant_err_median <= self.max_mant_err_median
        )


def proofs_pass(checks: list[ProofCheck], thresholds: ProofThresholds | None = None) -> bool:
    """True when every chunk passes ``thresholds`` (the defaults when None)."""
    t = thresholds or ProofThresholds()
    return all(t.passes(c) for c in checks)


def proof_size(topk: int = TOPK) -> int:
    """Bytes of one proof: 2 (modulus) + 2 per coefficient."""
    return 2 + 2 * topk


# -- input conversion ----------------------------------------------------------------------------


def to_bf16_bits(hidden: Any) -> U16:
    """bf16 bit patterns (uint16, 2-D) of ``hidden``: numpy uint16 (taken as bf16 bits), any
    numpy float array, or a torch tensor of any float dtype. :class:`ProofError` otherwise."""
    import numpy as np

    if type(hidden).__module__.startswith("torch"):
        import torch

        t = hidden.detach().to("cpu")
        if not t.is_floating_point():
            raise ProofError(f"hidden states must be floating point, got {t.dtype}")
        arr = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    else:
        try:
            a = np.asarray(hidden)
        except (TypeError, ValueError) as exc:
            raise ProofError(f"hidden states are not an array: {exc}") from exc
        if a.dtype == np.uint16:
            arr = a
        elif a.dtype.kind == "f":
            f = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = (f + 0x7FFF + ((f >> 16) & 1)) >> 16
            arr = rounded.astype(np.uint16)
            nan = np.isnan(a)
            if nan.any():
                arr = np.where(nan, np.uint16(0x7FC0), arr)
        else:
            raise ProofError(f"hidden states must be bf16 bits or floats, got dtype {a.dtype}")
    if arr.ndim != 2:
        raise ProofError(f"hidden states must be [n_tokens, hidden], got shape {arr.shape}")
    if ((arr & 0x7F80) == 0x7F80).any():
        raise ProofError("hidden states hold inf or NaN; no proof can commit to them")
    bits: U16 = arr
    return bits


def _chunks(bits: U16, chunk_size: int) -> list[U16]:
    if chunk_size <= 0:
        raise ProofError(f"chunk_size must be positive, got {chunk_size}")
    return [bits[i : i + chunk_size].reshape(-1) for i in range(0, bits.shape[0], chunk_size)]


def _topk(flat: U16, topk: int) -> I64:
    """Flat indices of the ``topk`` largest magnitudes, ascending (ties: lower index first)."""
    import numpy as np

    n = flat.shape[0]
    if topk > n:
        raise ProofError(
            f"topk={topk} exceeds the {n} values of a chunk: TOPLOC (like its reference) cannot"
            f" prove a chunk with fewer hidden values than its top-k, as the last chunk of one"
            f" token of a model whose hidden_size is below {topk}; use a model with"
            f" hidden_size >= {topk}"
        )
    mag = (flat & 0x7FFF).astype(np.int64)
    key = mag * n + (n - 1 - np.arange(n, dtype=np.int64))  # unique; larger = preferred
    idx = np.argpartition(-key, topk - 1)[:topk] if topk < n else np.arange(n)
    out: I64 = np.sort(idx.astype(np.int64))
    return out


# -- modular arithmetic --------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _inverses() -> I64:
    """Multiplicative inverses mod PRIME of 0..PRIME-1 (inv[0] = 0), by Fermat, vectorised."""
    import numpy as np

    base = np.arange(PRIME, dtype=np.int64)
    result = np.ones(PRIME, dtype=np.int64)
    e = PRIME - 2
    while e:
        if e & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        e >>= 1
    result[0] = 0
    return result


def injective_modulus(indices: I64) -> int:
    """Largest m <= 65497 under which ``indices`` are pairwise distinct (the reference's rule)."""
    import numpy as np

    if np.unique(indices).size != indices.size:
        raise ProofError("indices are not distinct")
    block = 256
    for top in range(PRIME, 0, -block):
        ms = np.arange(top, max(top - block, 0), -1, dtype=np.int64)
        r = np.sort(indices[:, None] % ms[None, :], axis=0)
        ok = (np.diff(r, axis=0) != 0).all(axis=0) if indices.size > 1 else np.ones_like(ms, bool)
        hits = np.flatnonzero(ok)
        if hits.size:
            return int(ms[hits[0]])
    raise ProofError("no injective modulus found")  # pragma: no cover - needs > 65497 indices


def _newton_coefficients(x: I64, y: I64) -> I64:
    """Monomial coefficients over GF(PRIME) of the polynomial through (x, y), rows independent.

    x, y: [rows, k] with distinct x per row, values in [0, PRIME).
    """
    import numpy as np

    inv = _inverses()
    k = x.shape[1]
    dd = y % PRIME
    for j in range(1, k):
        num = (dd[:, j:] - dd[:, j - 1 : -1]) % PRIME
        den = (x[:, j:] - x[:, :-j]) % PRIME
        dd[:, j:] = num * inv[den] % PRIME
    coeffs = np.zeros_like(dd)
    factor = np.zeros_like(dd)
    factor[:, 0] = 1
    for i in range(k):
        coeffs[:, : i + 1] = (coeffs[:, : i + 1] + dd[:, i : i + 1] * factor[:, : i + 1]) % PRIME
        if i + 1 < k:
            minus = (-x[:, i : i + 1]) % PRIME
            shifted = np.concatenate([np.zeros_like(factor[:, :1]), factor[:, :-1]], axis=1)
            factor = (shifted + factor * minus) % PRIME
    return coeffs


def _evaluate(coeffs: I64, x: I64) -> I64:
    """Horner evaluation mod PRIME of each row's polynomial at that row's points."""
    import numpy as np

    result = np.broadcast_to(coeffs[:, -1:], x.shape).copy()
    for i in range(coeffs.shape[1] - 2, -1, -1):
        result = (result * x + coeffs[:, i : i + 1]) % PRIME
    return result


# -- public API ----------------------------------------------------------------------------------


def build_proofs(hidden: Any, chunk_size: int = CHUNK_SIZE, topk: int = TOPK) -> list[bytes]:
    """One proof of ``2 + 2 * topk`` bytes per chunk of ``chunk_size`` token rows of ``hidden``.

    ``hidden``: [n_tokens, hidden_dim] as bf16 bits (uint16) or floats (numpy or torch).
    Raises :class:`ProofError` on a wrong shape, non-finite values or too few values per chunk.
    """
    return build_proofs_batch([hidden], chunk_size, topk)[0]


def build_proofs_batch(
    hiddens: list[Any], chunk_size: int = CHUNK_SIZE, topk: int = TOPK
) -> list[list[bytes]]:
    """:func:`build_proofs` for many samples at once (one interpolation over all their chunks:
    much faster than a call per sample when samples are short)."""
    import numpy as np

    if topk <= 0:
        raise ProofError(f"topk must be positive, got {topk}")
    per_sample = [_chunks(to_bf16_bits(h), chunk_size) for h in hiddens]
    chunks = [c for cs in per_sample for c in cs]
    if not chunks:
        return [[] for _ in hiddens]
    xs, ys, moduli = [], [], []
    for flat in chunks:
        idx = _topk(flat, topk)
        m = injective_modulus(idx)
        moduli.append(m)
        xs.append(idx % m)
        ys.append(flat[idx].astype(np.int64))
    coeffs = _newton_coefficients(np.stack(xs), np.stack(ys))
    flat_out = [
        m.to_bytes(2, "big") + row.astype(">u2").tobytes()
        for m, row in zip(moduli, coeffs, strict=True)
    ]
    out: list[list[bytes]] = []
    for cs in per_sample:
        out.append(flat_out[: len(cs)])
        flat_out = flat_out[len(cs) :]
    return out


def parse_proof(proof: bytes, topk: int = TOPK) -> tuple[int, I64]:
    """(modulus, coefficients) of a proof; :class:`ProofError` if it is not ``2 + 2k`` bytes or
    names a zero modulus."""
    import numpy as np

    if not isinstance(proof, bytes | bytearray | memoryview):
        raise ProofError(f"a proof must be bytes, got {type(proof).__name__}")
    data = bytes(proof)
    if len(data) != proof_size(topk):
        raise ProofError(f"a proof must be {proof_size(topk)} bytes, got {len(data)}")
    m = int.from_bytes(data[:2], "big")
    if m == 0:
        raise ProofError("proof modulus is 0 (a null proof)")
    coeffs = np.frombuffer(data, dtype=">u2", offset=2).astype(np.int64) % PRIME
    return m, coeffs


def verify_proofs(
    hidden: Any,
    proofs: list[bytes],
    chunk_size: int = CHUNK_SIZE,
    topk: int = TOPK,
) -> list[ProofCheck]:
    """Check ``proofs`` against the validator's own ``hidden`` states, chunk by chunk.

    The number of proofs must equal the number of chunks; :class:`ProofError` otherwise, and for
    malformed proofs or hidden states.
    """
    result = verify_proofs_batch([hidden], [proofs], chunk_size, topk)[0]
    if isinstance(result, ProofError):
        raise result
    return result


def verify_proofs_batch(
    hiddens: list[Any],
    proofs: list[list[bytes]],
    chunk_size: int = CHUNK_SIZE,
    topk: int = TOPK,
) -> list[list[ProofCheck] | ProofError]:
    """:func:`verify_proofs` for many samples: one polynomial evaluation over every chunk of
    every sample (a submission's proofs in one pass). Each sample's entry is its checks, or the
    :class:`ProofError` that made its proofs uncheckable (the others are still checked)."""
    import numpy as np

    if topk <= 0:
        raise ProofError(f"topk must be positive, got {topk}")
    out: list[list[ProofCheck] | ProofError] = []
    rows: list[tuple[int, int, U16, I64]] = []  # (sample, modulus, own chunk, own top-k)
    coeff_rows: list[I64] = []
    for i, (hidden, sample_proofs) in enumerate(zip(hiddens, proofs, strict=True)):
        try:
            chunks = _chunks(to_bf16_bits(hidden), chunk_size)
            if not isinstance(sample_proofs, list | tuple) or len(sample_proofs) != len(chunks):
                n = len(sample_proofs) if isinstance(sample_proofs, list | tuple) else "no list of"
                raise ProofError(f"{n} proofs for {len(chunks)} chunks of {chunk_size} tokens")
            parsed = [parse_proof(p, topk) for p in sample_proofs]
            mine = [(flat, _topk(flat, topk)) for flat in chunks]
        except ProofError as exc:
            out.append(exc)
            continue
        out.append([])
        for (m, coeffs), (flat, idx) in zip(parsed, mine, strict=True):
            rows.append((i, m, flat, idx))
            coeff_rows.append(coeffs)
    if not rows:
        return out
    x = np.stack([idx % m for _, m, _, idx in rows])
    claimed = _evaluate(np.stack(coeff_rows), x).astype(np.uint16)
    own = np.stack([flat[idx] for _, _, flat, idx in rows])
    exp_mismatch = ((claimed & 0x7F80) >> 7) != ((own & 0x7F80) >> 7)
    mant_err = np.abs((claimed & 0x7F).astype(np.int64) - (own & 0x7F).astype(np.int64))
    for (i, _, _, _), row_mismatch, row_err in zip(rows, exp_mismatch, mant_err, strict=True):
        errs = np.sort(row_err[~row_mismatch])
        if errs.size:
            mean, median = float(errs.mean()), float(errs[errs.size // 2])
        else:
            mean = median = NO_MATCH_ERROR
        checks = out[i]
        assert isinstance(checks, list)
        checks.append(ProofCheck(int(row_mismatch.sum()), mean, median))
    return out
