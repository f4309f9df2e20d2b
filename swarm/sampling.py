"""Seeded Gumbel-max sampling that a validator on other hardware can check token by token.

The token at step ``t`` of sample ``j`` of a submission with seed ``s`` is::

    argmax_v  logits[v] / T + g[v],    g = gumbel(s, j, t)      (T > 0)
    argmax_v  logits[v]                                          (T == 0, greedy)

The run genesis names the generator of ``g`` (``RunParams.sampler``):

``gumbel-2`` (every run created since issue 24)
    A counter-based generator in 32-bit integer arithmetic, so CPU and CUDA draw the same bits,
    computed where the logits are, a whole batch of rows per call. ``docs/inference.md``
    ("The gumbel-2 generator") specifies it for reimplementation; in short, with ``H`` the
    32-bit mixer :func:`mix32` (Chris Wellons' ``lowbias32``) and ``^`` xor::

        s0, s1 = sha256(b"swarm-node/gumbel-2\\0" | seed u64be | sample u64be)[0:8], two u32 LE
        k0 = H(s0 ^ H(t));  k1 = H(s1 ^ H(t + 0x9E3779B9 mod 2**32))       (the row key)
        x  = H(H(v ^ k0) ^ k1)                                            (entry v of the row)
        u  = (2 * (x >> 9) + 1) * 2**-24      exactly representable in float32, in (0, 1)
        g  = -log(-log(u))                    float32

    Every integer step is exact in int64 tensors (a 32-bit product is taken with the multiplier
    written in ``(-2**31, 2**31)``, so no product leaves int64; see :func:`_mul32_`), so the
    uniforms ``u`` are the same bits on every device; only ``log`` may differ in its last ulp
    between libms, which the tie tolerance absorbs.
``gumbel-1`` (runs created before issue 24; kept so they still load and verify)
    numpy's Philox keyed by ``sha256(b"swarm-node/gumbel" | s | j | t)`` draws float64 uniforms
    on the CPU, one row at a time.

A validator recomputes the logits by prefill (possibly at another precision) and calls
:func:`check_positions` on a batch of positions (or :func:`check_sampling` on one sample). A
token that is not the argmax of the recomputed scores is tolerated only where the best score
exceeds the sampled token's score by at most ``tolerance`` (float noise between precisions);
every such position is reported, and the caller bounds how many a sample may hold
(``RunParams.max_tolerated_per_1k``), so a cheater cannot swap runner-ups at will.

numpy and torch are imported inside the functions (``swarm`` never imports them at import time).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swarm.errors import ConfigError, ProofError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

GUMBEL_1 = "gumbel-1"
GUMBEL_2 = "gumbel-2"
SAMPLERS = (GUMBEL_1, GUMBEL_2)
"""The samplers this version knows, oldest first; a genesis naming another is refused."""

DEFAULT_TIE_TOLERANCE = 0.25
"""Largest score gap (in logits/T units) between the best and the sampled token that still counts
as float noise, when nothing narrower is known (the tolerance of every pre-issue-24 run)."""


def check_sampler(name: str) -> str:
    """``name`` if this version knows the sampler, else a :class:`ConfigError` saying so."""
    if name not in SAMPLERS:
        raise ConfigError(
            f"sampler {name[:32]!r} is unknown to this swarm-node (it knows "
            f"{', '.join(SAMPLERS)}): upgrade swarm-node to work on this run"
        )
    return name


# -- gumbel-2: the integer generator --------------------------------------------------------------

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_GOLDEN = 0x9E3779B9
_DOMAIN_2 = b"swarm-node/gumbel-2\0"


def mix32(x: int) -> int:
    """The 32-bit mixer ``H`` of gumbel-2 on one Python int (Wellons' ``lowbias32``)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


@functools.lru_cache(maxsize=1 << 16)
def request_key(seed: int, sample: int) -> tuple[int, int]:
    """``(s0, s1)`` of gumbel-2 for one (seed, sample index): computed once per sample."""
    if not (0 <= seed < 1 << 64 and 0 <= sample < 1 << 64):
        raise ProofError(f"seed {seed} and sample {sample} must lie in [0, 2**64)")
    digest = hashlib.sha256(_DOMAIN_2 + seed.to_bytes(8, "big") + sample.to_bytes(8, "big"))
    d = digest.digest()
    return int.from_bytes(d[0:4], "little"), int.from_bytes(d[4:8], "little")


def request_keys(seeds: Sequence[int], samples: Sequence[int]) -> torch.Tensor:
    """:func:`request_key` of every (seed, sample) row: int64 ``[rows, 2]`` on the CPU."""
    import torch

    keys = [request_key(int(s), int(j)) for s, j in zip(seeds, samples, strict=True)]
    return torch.tensor(keys, dtype=torch.int64).reshape(-1, 2)


def _signed32(m: int) -> int:
    """``m`` (an odd u32) as the int in ``(-2**31, 2**31)`` congruent to it mod 2**32."""
    return m - (1 << 32) if m >= 1 << 31 else m


def _mul32_(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x = x * m mod 2**32`` in place, ``x`` holding u32 values in int64: with the multiplier
    in ``(-2**31, 2**31)`` the product stays inside int64 (no overflow, no undefined bits), and
    masking keeps the low 32 bits of its two's complement, the same on every device."""
    return x.mul_(_signed32(m)).bitwise_and_(MASK32)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` in place on an int64 tensor of u32 values (shifts of non-negative values)."""
    x ^= x >> 16
    _mul32_(x, _M1)
    x ^= x >> 15
    _mul32_(x, _M2)
    x ^= x >> 16
    return x


NOISE_CHUNK_ENTRIES = {"cpu": 1 << 20, "cuda": 1 << 27}
"""Entries (rows x vocab) of int64 work array per pass: small on the CPU, where a pass that fits
in cache is twice as fast, large on a GPU, where one pass over the batch is what counts."""


def _row_keys(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``[R, 2]`` row keys ``(k0, k1)`` from request keys ``[R, 2]`` and steps ``[R]`` (int64)."""
    import torch

    t = steps.bitwise_and(MASK32)
    h0 = _mix32_(t.clone())
    h1 = _mix32_((t + _GOLDEN).bitwise_and_(MASK32))
    k0 = _mix32_(keys[:, 0] ^ h0)
    k1 = _mix32_(keys[:, 1] ^ h1)
    return torch.stack([k0, k1], 1)


def _uniform_bits_into(out: torch.Tensor, vocab_ids: torch.Tensor, rk: torch.Tensor) -> None:
    """``out[r, v] = H(H(v ^ k0[r]) ^ k1[r])`` for a block of rows (int64, u32 values)."""
    out.copy_(vocab_ids[None, :])
    out ^= rk[:, 0:1]
    _mix32_(out)
    out ^= rk[:, 1:2]
    _mix32_(out)


def gumbel2_uniform_bits(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """The u32 draws ``x`` of gumbel-2, ``[R, vocab]`` int64 (for tests and the spec)."""
    import torch

    rk = _row_keys(keys.to(torch.int64), steps.to(torch.int64))
    ids = torch.arange(vocab, dtype=torch.int64, device=rk.device)
    out = torch.empty((rk.shape[0], vocab), dtype=torch.int64, device=rk.device)
    _uniform_bits_into(out, ids, rk)
    return out


def gumbel2_noise(
    keys: torch.Tensor, steps: torch.Tensor, vocab: int, *, device: Any = None
) -> torch.Tensor:
    """Gumbel noise of gumbel-2, float32 ``[R, vocab]``, for request keys ``[R, 2]`` (u32 in
    int64) and steps ``[R]``, computed on ``device`` (the keys' device by default) in passes of
    at most ``NOISE_CHUNK_ENTRIES`` entries."""
    import torch

    dev = torch.device(device) if device is not None else keys.device
    rk = _row_keys(keys.to(dev, torch.int64), steps.to(dev, torch.int64))
    rows = rk.shape[0]
    out = torch.empty((rows, vocab), dtype=torch.float32, device=dev)
    if rows == 0:
        return out
    ids = torch.arange(vocab, dtype=torch.int64, device=dev)
    per = max(1, NOISE_CHUNK_ENTRIES.get(dev.type, 1 << 24) // max(1, vocab))
    work = torch.empty((min(per, rows), vocab), dtype=torch.int64, device=dev)
    for start in range(0, rows, per):
        stop = min(rows, start + per)
        x = work[: stop - start]
        _uniform_bits_into(x, ids, rk[start:stop])
        x >>= 9
        x.mul_(2).add_(1)  # 2 * (x >> 9) + 1 < 2**24: exact in float32
        g = out[start:stop]
        g.copy_(x)
        g.mul_(2.0**-24).log_().neg_().log_().neg_()
    return out


# -- gumbel-1: numpy Philox on the CPU (runs created before issue 24) ----------------------------


def _key(seed: int, sample: int, step: int) -> list[int]:
    data = b"swarm-node/gumbel\0" + b"".join(
        int(v).to_bytes(16, "big", signed=True) for v in (seed, sample, step)
    )
    digest = hashlib.sha256(data).digest()
    return [int.from_bytes(digest[0:8], "little"), int.from_bytes(digest[8:16], "little")]


def gumbel_noise(seed: int, sample: int, step: int, vocab: int) -> npt.NDArray[np.float64]:
    """gumbel-1's noise of ``vocab`` entries for (seed, sample, step); float64."""
    import numpy as np

    if vocab <= 0:
        raise ProofError(f"vocab must be positive, got {vocab}")
    gen = np.random.Generator(np.random.Philox(key=np.array(_key(seed, sample, step), np.uint64)))
    u = gen.random(vocab)
    u = np.clip(u, np.finfo(np.float64).tiny, 1.0 - 2.0**-53)
    g: npt.NDArray[np.float64] = -np.log(-np.log(u))
    return g


PARALLEL_NOISE_ENTRIES = 1 << 20
"""gumbel-1 noise for more entries than this (rows x vocab) is drawn by a thread pool: numpy's
Philox and ``log`` release the GIL."""


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


# -- the sampler, either generator ---------------------------------------------------------------


def _as_tensor(x: Any, name: str) -> torch.Tensor:
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, np.ndarray) and x.dtype in (np.float32, np.float64):
        return torch.from_numpy(np.ascontiguousarray(x))
    try:
        return torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float64)))
    except (TypeError, ValueError) as exc:
        raise ProofError(f"{name} is not a numeric array: {exc}") from exc


def draw_noise(
    seeds: Sequence[int],
    samples: Sequence[int],
    steps: Sequence[int] | torch.Tensor,
    vocab: int,
    *,
    sampler: str = GUMBEL_2,
    device: Any = "cpu",
) -> torch.Tensor:
    """The noise rows of (seed, sample, step) triples on ``device``: float32 for gumbel-2
    (computed there), float64 for gumbel-1 (drawn on the CPU and copied)."""
    import torch

    check_sampler(sampler)
    if vocab <= 0:
        raise ProofError(f"vocab must be positive, got {vocab}")
    if sampler == GUMBEL_1:
        step_list = steps.tolist() if isinstance(steps, torch.Tensor) else list(steps)
        rows = noise_rows(list(zip(seeds, samples, step_list, strict=True)), vocab)
        return torch.from_numpy(rows).to(device)
    keys = request_keys(seeds, samples)
    steps_t = steps if isinstance(steps, torch.Tensor) else torch.tensor(list(steps))
    if steps_t.shape[0] != keys.shape[0]:
        raise ProofError(f"{steps_t.shape[0]} steps for {keys.shape[0]} (seed, sample) rows")
    return gumbel2_noise(keys.to(device), steps_t.to(device, torch.int64), vocab)


def seeded_scores(
    logits: Any,
    seeds: Sequence[int],
    samples: Sequence[int],
    steps: Sequence[int] | torch.Tensor,
    temperature: float,
    *,
    sampler: str = GUMBEL_2,
) -> torch.Tensor:
    """``logits / T + g`` of every row ``[R, vocab]`` (``logits`` when T == 0), on the logits'
    device: float32 for gumbel-2, float64 for gumbel-1 (as that sampler always did)."""
    import torch

    rows = _as_tensor(logits, "logits")
    if rows.ndim != 2:
        raise ProofError(f"logits must be [rows, vocab], got shape {tuple(rows.shape)}")
    if temperature < 0:
        raise ProofError(f"temperature must be >= 0, got {temperature}")
    wide = torch.float64 if check_sampler(sampler) == GUMBEL_1 else torch.float32
    if temperature == 0:
        return rows.to(wide)
    noise = draw_noise(seeds, samples, steps, rows.shape[1], sampler=sampler, device=rows.device)
    return torch.div(rows.to(wide), temperature).add_(noise)


def choose_tokens(
    logits: Any,
    seeds: Sequence[int],
    samples: Sequence[int],
    step: int,
    temperature: float,
    *,
    sampler: str = GUMBEL_2,
) -> torch.Tensor:
    """One sampled token per row of ``logits`` [batch, vocab], an int64 tensor on the logits'
    device (no copy to the host: the caller decides when it needs the ids)."""
    rows = _as_tensor(logits, "logits")
    if rows.ndim != 2 or rows.shape[0] != len(seeds) or len(seeds) != len(samples):
        raise ProofError(
            f"logits {tuple(rows.shape)} do not match {len(seeds)} seeds and {len(samples)} samples"
        )
    steps = [step] * len(seeds)
    return seeded_scores(rows, seeds, samples, steps, temperature, sampler=sampler).argmax(1)


class SeededRows:
    """The (seed, sample) rows of a batch that decodes together, keyed once on ``device``.

    :meth:`choose` picks each row's token of a step where the logits are: for gumbel-2 the
    request keys live on the device and the noise of the whole batch is one computation there;
    gumbel-1 (old runs) draws its noise on the CPU.
    """

    def __init__(
        self, seeds: Sequence[int], samples: Sequence[int], *, sampler: str, device: Any
    ) -> None:

        if len(seeds) != len(samples):
            raise ProofError(f"{len(seeds)} seeds for {len(samples)} samples")
        self.sampler = check_sampler(sampler)
        self.seeds, self.samples = list(seeds), list(samples)
        self._keys = request_keys(seeds, samples).to(device)

    def choose(self, logits: torch.Tensor, step: int, temperature: float) -> torch.Tensor:
        """Tokens (int64 [rows], on the logits' device) of step ``step`` for ``logits``
        [rows, vocab]: the seeded Gumbel-max choice (the argmax when T == 0)."""
        import torch

        if logits.ndim != 2 or logits.shape[0] != len(self.seeds):
            raise ProofError(f"logits {tuple(logits.shape)} for {len(self.seeds)} rows")
        if temperature < 0:
            raise ProofError(f"temperature must be >= 0, got {temperature}")
        if temperature == 0:
            return logits.argmax(1)
        if self.sampler == GUMBEL_1:
            steps = [step] * len(self.seeds)
            return seeded_scores(
                logits, self.seeds, self.samples, steps, temperature, sampler=GUMBEL_1
            ).argmax(1)
        steps_t = torch.full((len(self.seeds),), step, dtype=torch.int64, device=logits.device)
        noise = gumbel2_noise(self._keys, steps_t, logits.shape[1])
        return torch.div(logits.float(), temperature).add_(noise).argmax(1)


def sample_tokens(
    logits: Any,
    seeds: list[int],
    samples: list[int],
    step: int,
    temperature: float,
    *,
    sampler: str = GUMBEL_2,
) -> list[int]:
    """:func:`choose_tokens` as a list of ints (numpy or torch logits, any float dtype)."""
    return [
        int(t) for t in choose_tokens(logits, seeds, samples, step, temperature, sampler=sampler)
    ]


def sampling_scores(
    logits: Any, seed: int, sample: int, step: int, temperature: float, *, sampler: str = GUMBEL_2
) -> torch.Tensor:
    """``logits / T + g`` for one position, shape [vocab]."""
    row = _as_tensor(logits, "logits")
    if row.ndim != 1:
        raise ProofError(f"logits of one position must be 1-D, got shape {tuple(row.shape)}")
    return seeded_scores(row[None], [seed], [sample], [step], temperature, sampler=sampler)[0]


# -- the check -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PositionChecks:
    """Per position of a batch (tensors of shape [N] on the logits' device)."""

    gap: torch.Tensor
    """best score - the sampled token's score (0 where the token is the argmax)."""
    near: torch.Tensor
    """bool: the two best scores are within the tolerance (whatever was sampled)."""


def check_positions(
    logits: Any,
    tokens: Sequence[int] | torch.Tensor,
    seeds: Sequence[int],
    samples: Sequence[int],
    steps: Sequence[int] | torch.Tensor,
    temperature: float,
    *,
    tolerance: float,
    sampler: str = GUMBEL_2,
) -> PositionChecks:
    """The score gap and near-tie flag of every position of a batch, in one pass on the
    logits' device: row ``i`` of ``logits`` [N, vocab] produced ``tokens[i]`` at step
    ``steps[i]`` of sample ``(seeds[i], samples[i])``.

    Raises :class:`ProofError` on mismatched shapes or a token outside the vocabulary.
    """
    import torch

    rows = _as_tensor(logits, "logits")
    toks = torch.as_tensor(tokens, dtype=torch.int64).to(rows.device)
    n = toks.shape[0]
    if rows.ndim != 2 or rows.shape[0] != n:
        raise ProofError(f"logits of shape {tuple(rows.shape)} do not match {n} tokens")
    if tolerance < 0 or temperature < 0:
        raise ProofError("tolerance and temperature must be >= 0")
    if n == 0:
        empty = torch.zeros(0, device=rows.device)
        return PositionChecks(empty, empty.bool())
    if int(toks.min()) < 0 or int(toks.max()) >= rows.shape[1]:
        raise ProofError(f"a token id lies outside the vocabulary of {rows.shape[1]}")
    scores = seeded_scores(rows, seeds, samples, steps, temperature, sampler=sampler)
    scores = torch.nan_to_num(scores, nan=float("-inf"))
    if scores.shape[1] > 1:
        top2 = torch.topk(scores, 2, dim=1).values
        best, near = top2[:, 0], (top2[:, 0] - top2[:, 1]) <= tolerance
    else:
        best, near = scores[:, 0], torch.zeros(n, dtype=torch.bool, device=rows.device)
    chosen = scores.gather(1, toks[:, None])[:, 0]
    gap = torch.nan_to_num(best - chosen, nan=0.0, posinf=1e30)
    return PositionChecks(gap, near)


@dataclass(frozen=True)
class SamplingCheck:
    """One sample's sampling check, with the numbers that decided it."""

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
    tolerated_at: tuple[int, ...] = field(default=())
    """The positions (steps) of the tolerated tokens, in order: what a verdict records."""


def summarize(
    gap: npt.NDArray[np.float32] | Sequence[float],
    near: Sequence[bool] | Any,
    tolerance: float,
    *,
    first_step: int = 0,
) -> SamplingCheck:
    """One sample's :class:`SamplingCheck` from its positions' gaps and near-tie flags."""
    import numpy as np

    g = np.asarray(gap, dtype=np.float64)
    off = g > 0
    bad = g > tolerance
    bad_idx = np.flatnonzero(bad)
    tol_idx = np.flatnonzero(off & ~bad)
    return SamplingCheck(
        ok=not bool(bad.any()),
        n_tokens=int(g.shape[0]),
        mismatches=int(bad.sum()),
        tolerated=int(tol_idx.size),
        near_ties=int(np.count_nonzero(np.asarray(near))),
        first_mismatch=int(bad_idx[0]) + first_step if bad_idx.size else None,
        max_gap=float(g.max()) if g.size else 0.0,
        tolerated_at=tuple(int(i) + first_step for i in tol_idx),
    )


def check_sampling(
    logits: Any,
    tokens: list[int],
    seed: int,
    temperature: float,
    *,
    sample: int = 0,
    tolerance: float = DEFAULT_TIE_TOLERANCE,
    first_step: int = 0,
    sampler: str = GUMBEL_2,
) -> SamplingCheck:
    """Check that every token of one sample is the seeded Gumbel-max choice of ``logits``.

    ``logits`` is [n_tokens, vocab]: row ``t`` is the distribution that produced ``tokens[t]``,
    the token of step ``first_step + t``. Positions in the result count from ``first_step``.
    Raises :class:`ProofError` on mismatched shapes or a token outside the vocabulary.
    """
    n = len(tokens)
    checks = check_positions(
        logits,
        tokens,
        [seed] * n,
        [sample] * n,
        list(range(first_step, first_step + n)),
        temperature,
        tolerance=tolerance,
        sampler=sampler,
    )
    result = summarize(checks.gap.cpu().numpy(), checks.near.cpu().numpy(), tolerance)
    return result
