"""Seeded Gumbel-max sampling and its validator check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.errors import ProofError
from swarm.sampling import check_sampling, gumbel_noise, sample_tokens, sampling_scores


def _generate(logits: np.ndarray, seed: int, sample: int, temperature: float) -> list[int]:
    return [
        sample_tokens(logits[t : t + 1], [seed], [sample], t, temperature)[0]
        for t in range(logits.shape[0])
    ]


def test_noise_is_a_pure_function_of_seed_sample_step() -> None:
    a = gumbel_noise(7, 1, 3, 300)
    assert np.array_equal(a, gumbel_noise(7, 1, 3, 300))
    assert not np.array_equal(a, gumbel_noise(7, 1, 4, 300))
    assert not np.array_equal(a, gumbel_noise(7, 2, 3, 300))
    assert not np.array_equal(a, gumbel_noise(8, 1, 3, 300))


def test_noise_has_gumbel_moments() -> None:
    g = np.concatenate([gumbel_noise(1, 0, t, 10_000) for t in range(5)])
    assert abs(g.mean() - 0.5772) < 0.02
    assert abs(g.var() - np.pi**2 / 6) < 0.05


def test_sampling_follows_the_softmax() -> None:
    logits = np.log(np.array([0.7, 0.2, 0.1]))
    picks = [sample_tokens(logits[None], [s], [0], 0, 1.0)[0] for s in range(3000)]
    freq = np.bincount(picks, minlength=3) / 3000
    assert np.allclose(freq, [0.7, 0.2, 0.1], atol=0.03)


def test_temperature_zero_is_greedy() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 50))
    assert sample_tokens(logits, [1, 2, 3, 4], [0, 1, 2, 3], 0, 0.0) == list(logits.argmax(1))
    assert np.array_equal(sampling_scores(logits[0], 1, 0, 0, 0.0), logits[0])


def test_torch_and_numpy_logits_sample_the_same() -> None:
    logits = np.random.default_rng(1).normal(size=(3, 40)).astype(np.float32)
    a = sample_tokens(logits, [5, 6, 7], [0, 1, 2], 2, 0.8)
    assert sample_tokens(torch.from_numpy(logits), [5, 6, 7], [0, 1, 2], 2, 0.8) == a


def test_honest_tokens_pass() -> None:
    logits = np.random.default_rng(2).normal(size=(40, 300)) * 3
    tokens = _generate(logits, 11, 2, 1.0)
    check = check_sampling(logits, tokens, 11, 1.0, sample=2)
    assert check.ok and check.mismatches == 0 and check.n_tokens == 40


def test_one_changed_token_fails() -> None:
    logits = np.random.default_rng(3).normal(size=(40, 300)) * 3
    tokens = _generate(logits, 11, 0, 1.0)
    tokens[17] = (tokens[17] + 1) % 300
    check = check_sampling(logits, tokens, 11, 1.0, tolerance=1e-6)
    assert not check.ok and check.first_mismatch == 17


def test_wrong_seed_or_sample_index_fails() -> None:
    logits = np.random.default_rng(4).normal(size=(30, 300))
    tokens = _generate(logits, 11, 0, 1.0)
    assert not check_sampling(logits, tokens, 12, 1.0).ok
    assert not check_sampling(logits, tokens, 11, 1.0, sample=1).ok


def test_near_tie_is_tolerated_and_counted() -> None:
    logits = np.zeros((1, 10))
    g = gumbel_noise(5, 0, 0, 10)
    best, second = np.argsort(g)[-1], np.argsort(g)[-2]
    gap = g[best] - g[second]
    logits[0, second] += gap - 1e-4  # second best now trails by 1e-4
    check = check_sampling(logits, [int(best)], 5, 1.0, tolerance=1e-3)
    other = check_sampling(logits, [int(second)], 5, 1.0, tolerance=1e-3)
    assert check.ok and other.ok and other.tolerated == 1 and other.near_ties == 1
    assert not check_sampling(logits, [int(second)], 5, 1.0, tolerance=1e-5).ok


@pytest.mark.parametrize(
    ("logits", "tokens"),
    [(np.zeros((2, 5)), [1]), (np.zeros((1, 5)), [5]), (np.zeros((1, 5)), [-1]), ("x", [0])],
)
def test_bad_input_is_a_proof_error(logits: object, tokens: list[int]) -> None:
    with pytest.raises(ProofError):
        check_sampling(logits, tokens, 0, 1.0)
