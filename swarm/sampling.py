"""Seeded Gumbel-max sampling that a validator on other hardware can check token by token.

The token at step ``t`` of sample ``j`` of a submission with seed ``s`` is::

    argmax_v  logits[v] / T + g[v],    g = gumbel(s, j, t)      (T > 0)
    argmax_v  logits[v]                                          (T == 0, greedy)

``g`` comes from a counter-based generator on the CPU, never from a device RNG: numpy's Philox
keyed by ``sha256(b"swarm-node/gumbel" | s | j | t)`` draws uniforms ``u`` in float64 and
``g = -log(-log(u))``. The same (seed, sample, step) gives the same noise on every machine up
to the last bits of libm's ``log``, which the tie tolerance below absorbs.

A validator recomputes the logits by prefill (possibly at another precision) and calls
:func:`check_sampling`. A token that is not the argmax of the recomputed scores is tolerated only
where the best score exceeds the sampled token's score by at most ``tolerance`` (float noise
between precisions); every such position is counted as a near-tie and reported, so a verdict can
carry the numbers that decided it.

numpy is imported inside the functions (``swarm`` never imports numpy or torch at import time).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarm.errors import ProofError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

DEFAULT_TIE_TOLERANCE = 0.25
"""Largest score gap (in logits/T units) between the best and the sampled token that still counts
as float noise. bf16 logits of the default model differ from fp32 by up to ~0.1; honest gaps
below 0.25 are rare (a few per thousand tokens) and a forged token almost never lands there."""


def _key(seed: int, sample: int, step: int) -> list[int]:
    data = b"swarm-node/gumbel\0" + b"".join(
        int(v).to_bytes(16, "big", signed=True) for v in (seed, sample, step)
    )
    digest = hashlib.sha256(data).digest()
    return [int.from_bytes(digest[0:8], "little"), int.from_bytes(digest[8:16], "little")]


def gumbel_noise(seed: int, sample: int, step: int, vocab: int) -> npt.NDArray[np.float64]:
    """The Gumbel noise ``g`` of ``vocab`` entries for (seed, sample, step); float64."""
    import numpy as np

    if vocab <= 0:
        raise ProofError(f"vocab must be positive, got {vocab}")
    gen = np.random.Generator(np.random.Philox(key=np.array(_key(seed, sample, step), np.uint64)))
    u = gen.random(vocab)
    u = np.clip(u, np.finfo(np.float64).tiny, 1.0 - 2.0**-53)
    g: npt.NDArray[np.float64] = -np.log(-np.log(u))
    return g


PARALLEL_NOISE_ENTRIES = 1 << 20
"""Noise for more entries than this (rows x vocab) is drawn by a thread pool: numpy's Philox
and ``log`` release the GIL, and at a 150k vocabulary the draw, not the model, dominates."""


def noise_rows(keys: list[tuple[int, int, int]], vocab: int) -> npt.NDArray[np.float64]:
    """:func:`gumbel_noise` of every ``(seed, sample, step)`` in ``keys``, stacked [rows, vocab]."""
    import numpy as np

    if not keys:
        return np.zeros((0, vocab), np.float64)
    if len(keys) * vocab < PARALLEL_NOISE_ENTRIES or len(keys) == 1:
        return np.stack([gumbel_noise(s, j, t, vocab) for s, j, t in keys])
    import os
    from concurrent.futures import ThreadPoolExecutor

    workers = min(len(keys), os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        return np.stack(list(pool.map(lambda k: gumbel_noise(k[0], k[1], k[2], vocab), keys)))


def _as_float64(x: Any, name: str) -> npt.NDArray[np.float64]:
    import numpy as np

    if type(x).__module__.startswith("torch"):
        x = x.detach().to("cpu").float().numpy()
    try:
        arr: npt.NDArray[np.float64] = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ProofError(f"{name} is not a numeric array: {exc}") from exc
    return arr


def sampling_scores(
    logits: Any, seed: int, sample: int, step: int, temperature: float
) -> npt.NDArray[np.float64]:
    """``logits / T + g`` for one position (``logits`` when T == 0); float64 of shape [vocab]."""
    row = _as_float64(logits, "logits")
    if row.ndim != 1:
        raise ProofError(f"logits of one position must be 1-D, got shape {row.shape}")
    if temperature < 0:
        raise ProofError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return row
    return row / temperature + gumbel_noise(seed, sample, step, row.shape[0])


def sample_tokens(
    logits: Any,
    seeds: list[int],
    samples: list[int],
    step: int,
    temperature: float,
) -> list[int]:
    """One sampled token per row of ``logits`` [batch, vocab] (numpy or torch, any float dtype)."""
    import numpy as np

    rows = _as_float64(logits, "logits")
    if rows.ndim != 2 or rows.shape[0] != len(seeds) or len(seeds) != len(samples):
        raise ProofError(
            f"logits {rows.shape} do not match {len(seeds)} seeds and {len(samples)} samples"
        )
    if temperature < 0:
        raise ProofError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return [int(i) for i in np.argmax(rows, axis=1)]
    keys = [(s, j, step) for s, j in zip(seeds, samples, strict=True)]
    noise = noise_rows(keys, rows.shape[1])
    return [int(i) for i in np.argmax(rows / temperature + noise, axis=1)]


@dataclass(frozen=True)
class SamplingCheck:
    """Result of :func:`check_sampling` with the numbers that decided it."""

    ok: bool
    n_tokens: int
    mismatches: int
    """Tokens that are not the argmax and not within the tolerance of it (0 for an honest run)."""
    tolerated: int
    """Tokens that are not the argmax but within the tolerance (float noise)."""
    near_ties: int
    """Positions whose two best scores are within the tolerance (whatever was sampled)."""
    first_mismatch: int | None
    max_gap: float
    """Largest gap best - sampled over all positions (0.0 when every token is the argmax)."""


def check_sampling(
    logits: Any,
    tokens: list[int],
    seed: int,
    temperature: float,
    *,
    sample: int = 0,
    tolerance: float = DEFAULT_TIE_TOLERANCE,
    first_step: int = 0,
) -> SamplingCheck:
    """Check that every token is the seeded Gumbel-max choice of the validator's ``logits``.

    ``logits`` is [n_tokens, vocab]: row ``t`` is the distribution that produced ``tokens[t]``,
    the token of step ``first_step + t`` (a chunk of a longer sample starts past 0; positions
    in the result, such as ``first_mismatch``, count from the chunk's first row).
    Raises :class:`ProofError` on mismatched shapes or a token outside the vocabulary.
    """
    import numpy as np

    rows = _as_float64(logits, "logits")
    n = len(tokens)
    if rows.ndim != 2 or rows.shape[0] != n:
        raise ProofError(f"logits of shape {rows.shape} do not match {n} tokens")
    if tolerance < 0 or temperature < 0:
        raise ProofError("tolerance and temperature must be >= 0")
    if n == 0:
        return SamplingCheck(True, 0, 0, 0, 0, None, 0.0)
    toks = np.asarray(tokens, dtype=np.int64)
    if toks.min() < 0 or toks.max() >= rows.shape[1]:
        raise ProofError(f"a token id lies outside the vocabulary of {rows.shape[1]}")
    if temperature == 0:
        scores = rows
    else:
        noise = noise_rows([(seed, sample, first_step + t) for t in range(n)], rows.shape[1])
        scores = rows / temperature + noise
    scores = np.where(np.isnan(scores), -np.inf, scores)
    best = np.max(scores, axis=1)
    chosen = scores[np.arange(n), toks]
    gap = best - chosen
    top2 = np.partition(scores, -2, axis=1)[:, -2:] if rows.shape[1] > 1 else None
    near = int(np.count_nonzero(top2[:, 1] - top2[:, 0] <= tolerance)) if top2 is not None else 0
    off = gap > 0
    bad = gap > tolerance
    bad_idx = np.flatnonzero(bad)
    return SamplingCheck(
        ok=not bool(bad.any()),
        n_tokens=n,
        mismatches=int(bad.sum()),
        tolerated=int(np.count_nonzero(off & ~bad)),
        near_ties=near,
        first_mismatch=int(bad_idx[0]) if bad_idx.size else None,
        max_gap=float(np.nan_to_num(gap.max(), posinf=1e30)),
    )
