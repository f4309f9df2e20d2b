"""Seeded Gumbel-max sampling and its validator check (both samplers).

gumbel-2 is checked bit for bit against a plain-Python implementation written here from the
specification in docs/inference.md, not from the module: integers only, no torch, no numpy.
"""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import pytest
import torch

from swarm.errors import ConfigError, ProofError
from swarm.sampling import (
    GUMBEL_1,
    GUMBEL_2,
    SeededRows,
    check_sampler,
    check_sampling,
    choose_tokens,
    draw_noise,
    gumbel2_uniform_bits,
    gumbel_noise,
    request_key,
    sample_tokens,
    sampling_scores,
)

# -- the reference: docs/inference.md, "The gumbel-2 generator" ---------------------------------


def ref_h(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    x ^= x >> 16
    return x


def ref_bits(seed: int, sample: int, step: int, vocab: int) -> list[int]:
    d = hashlib.sha256(
        b"swarm-node/gumbel-2\0" + seed.to_bytes(8, "big") + sample.to_bytes(8, "big")
    ).digest()
    s0, s1 = int.from_bytes(d[0:4], "little"), int.from_bytes(d[4:8], "little")
    t = step % 2**32
    k0 = ref_h(s0 ^ ref_h(t))
    k1 = ref_h(s1 ^ ref_h((t + 0x9E3779B9) % 2**32))
    return [ref_h(ref_h(v ^ k0) ^ k1) for v in range(vocab)]


def ref_uniforms(bits: list[int]) -> list[float]:
    return [(2 * (x >> 9) + 1) / 2**24 for x in bits]


def torch_bits(seed: int, sample: int, step: int, vocab: int) -> list[int]:
    keys = torch.tensor([request_key(seed, sample)])
    return [int(x) for x in gumbel2_uniform_bits(keys, torch.tensor([step]), vocab)[0]]


def test_torch_generator_equals_the_reference_bit_for_bit_on_random_keys() -> None:
    rng = random.Random(24)
    for _ in range(40):
        seed, sample = rng.randrange(2**64), rng.randrange(2**32)
        step, vocab = rng.randrange(2**32), rng.randrange(1, 300)
        assert torch_bits(seed, sample, step, vocab) == ref_bits(seed, sample, step, vocab)


def test_uniforms_are_exact_in_float32_and_noise_is_minus_log_minus_log() -> None:
    rng = random.Random(7)
    seeds = [rng.randrange(2**63) for _ in range(6)]
    noise = draw_noise(seeds, list(range(6)), list(range(6)), 500)
    assert noise.dtype == torch.float32
    for row, seed in enumerate(seeds):
        u = ref_uniforms(ref_bits(seed, row, row, 500))
        assert all(0.0 < x < 1.0 for x in u)
        u32 = torch.tensor(u, dtype=torch.float32)
        assert torch.equal(u32.double(), torch.tensor(u, dtype=torch.float64))  # exact
        assert torch.equal(noise[row], -torch.log(-torch.log(u32)))
        expect = torch.tensor([-math.log(-math.log(x)) for x in u], dtype=torch.float64)
        assert torch.allclose(noise[row].double(), expect, rtol=0, atol=1e-5)


def test_a_batched_draw_equals_the_row_by_row_draw() -> None:
    seeds, samples, steps = [3, 3, 9, 2**63 + 5], [0, 1, 0, 7], [0, 5, 5, 31]
    batch = draw_noise(seeds, samples, steps, 1000)
    rows = [
        draw_noise([s], [j], [t], 1000)[0] for s, j, t in zip(seeds, samples, steps, strict=True)
    ]
    assert torch.equal(batch, torch.stack(rows))
    logits = torch.randn(4, 1000)
    picked = SeededRows(seeds, samples, sampler=GUMBEL_2, device="cpu").choose(logits, 5, 0.7)
    one_by_one = [
        choose_tokens(logits[i : i + 1], [seeds[i]], [samples[i]], 5, 0.7) for i in range(4)
    ]
    assert picked.tolist() == [int(t[0]) for t in one_by_one]


def test_the_cpu_pass_size_does_not_change_the_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    import swarm.sampling as sampling

    whole = draw_noise([1] * 9, list(range(9)), [4] * 9, 3000)
    monkeypatch.setitem(sampling.NOISE_CHUNK_ENTRIES, "cpu", 3000 * 2)  # two rows a pass
    assert torch.equal(draw_noise([1] * 9, list(range(9)), [4] * 9, 3000), whole)


def test_noise_is_a_pure_function_of_seed_sample_step() -> None:
    a = draw_noise([7], [1], [3], 300)
    assert torch.equal(a, draw_noise([7], [1], [3], 300))
    for other in (([7], [1], [4]), ([7], [2], [3]), ([8], [1], [3])):
        assert not torch.equal(a, draw_noise(*other, 300))


def test_noise_has_gumbel_moments() -> None:
    g = draw_noise([1] * 5, [0] * 5, list(range(5)), 20_000).double()
    assert abs(g.mean().item() - 0.5772) < 0.02
    assert abs(g.var().item() - math.pi**2 / 6) < 0.05


def test_sampling_follows_the_softmax() -> None:
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = np.log(p)[None]
    n = 20_000
    picks = [sample_tokens(logits, [s], [0], 0, 1.0)[0] for s in range(n)]
    counts = np.bincount(picks, minlength=5)
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 18.5, (counts, chi2)  # 4 degrees of freedom: p = 0.001


def test_temperature_zero_is_greedy() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 50))
    assert sample_tokens(logits, [1, 2, 3, 4], [0, 1, 2, 3], 0, 0.0) == list(logits.argmax(1))
    assert torch.equal(
        sampling_scores(logits[0], 1, 0, 0, 0.0), torch.from_numpy(logits[0]).float()
    )


def test_torch_and_numpy_logits_sample_the_same() -> None:
    logits = np.random.default_rng(1).normal(size=(3, 40)).astype(np.float32)
    a = sample_tokens(logits, [5, 6, 7], [0, 1, 2], 2, 0.8)
    assert sample_tokens(torch.from_numpy(logits), [5, 6, 7], [0, 1, 2], 2, 0.8) == a


def _generate(logits: np.ndarray, seed: int, sample: int, t: float, sampler: str) -> list[int]:
    return [
        sample_tokens(logits[i : i + 1], [seed], [sample], i, t, sampler=sampler)[0]
        for i in range(logits.shape[0])
    ]


@pytest.mark.parametrize("sampler", [GUMBEL_1, GUMBEL_2])
def test_honest_tokens_pass(sampler: str) -> None:
    logits = np.random.default_rng(2).normal(size=(40, 300)) * 3
    tokens = _generate(logits, 11, 2, 1.0, sampler)
    check = check_sampling(logits, tokens, 11, 1.0, sample=2, sampler=sampler)
    assert check.ok and check.mismatches == 0 and check.n_tokens == 40 and check.tolerated == 0


def test_the_other_sampler_does_not_verify() -> None:
    logits = np.random.default_rng(2).normal(size=(40, 300)) * 3
    tokens = _generate(logits, 11, 2, 1.0, GUMBEL_1)
    assert not check_sampling(logits, tokens, 11, 1.0, sample=2, sampler=GUMBEL_2).ok


def test_one_changed_token_fails() -> None:
    logits = np.random.default_rng(3).normal(size=(40, 300)) * 3
    tokens = _generate(logits, 11, 0, 1.0, GUMBEL_2)
    tokens[17] = (tokens[17] + 1) % 300
    check = check_sampling(logits, tokens, 11, 1.0, tolerance=1e-6)
    assert not check.ok and check.first_mismatch == 17


def test_wrong_seed_or_sample_index_fails() -> None:
    logits = np.random.default_rng(4).normal(size=(30, 300))
    tokens = _generate(logits, 11, 0, 1.0, GUMBEL_2)
    assert not check_sampling(logits, tokens, 12, 1.0).ok
    assert not check_sampling(logits, tokens, 11, 1.0, sample=1).ok


def test_near_tie_is_tolerated_counted_and_located() -> None:
    logits = np.zeros((3, 10))
    g = draw_noise([5] * 3, [0] * 3, [0, 1, 2], 10).double().numpy()
    best, second = int(np.argmax(g[1])), int(np.argsort(g[1])[-2])
    logits[1, second] += g[1, best] - g[1, second] - 1e-4  # second best now trails by 1e-4
    tokens = [int(np.argmax(g[0])), second, int(np.argmax(g[2]))]
    check = check_sampling(logits, tokens, 5, 1.0, tolerance=1e-3)
    assert check.ok and check.tolerated == 1 and check.near_ties >= 1
    assert check.tolerated_at == (1,)
    assert not check_sampling(logits, tokens, 5, 1.0, tolerance=1e-5).ok


def test_an_unknown_sampler_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"sampler 'gumbel-9' is unknown.*upgrade"):
        check_sampler("gumbel-9")
    with pytest.raises(ConfigError):
        draw_noise([1], [0], [0], 10, sampler="gumbel-9")


def test_gumbel_1_is_unchanged() -> None:
    """Old runs verify: the numpy sampler's noise for a pinned key is what it always was."""
    g = gumbel_noise(7, 1, 3, 4)
    assert np.allclose(g, [1.15908365, 0.16353173, 0.16953494, 0.95399854], atol=1e-8), g
    rows = draw_noise([7], [1], [3], 4, sampler=GUMBEL_1)
    assert rows.dtype == torch.float64 and torch.equal(rows[0], torch.from_numpy(g))


@pytest.mark.parametrize(
    ("logits", "tokens"),
    [(np.zeros((2, 5)), [1]), (np.zeros((1, 5)), [5]), (np.zeros((1, 5)), [-1]), ("x", [0])],
)
def test_bad_input_is_a_proof_error(logits: object, tokens: list[int]) -> None:
    with pytest.raises(ProofError):
        check_sampling(logits, tokens, 0, 1.0)
