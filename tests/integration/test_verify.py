"""Detection on the embedded model: honest work passes, every listed cheat fails."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from node.compute.engine import Generation
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR, load_causal_lm
from node.model import tokenizer as tok
from node.tasks import default_suite
from node.verify import (
    DEFAULT_MODEL_SUBMISSION_MANT_ERR,
    SampleClaim,
    check_termination,
    verify_samples,
)
from swarm.toploc import build_proofs

T, MAX = 1.0, 16
N = 16
PROMPTS = [tok.encode(default_suite().task(100 + i).prompt) for i in range(N)]
SEEDS = [1000 + i for i in range(N)]


def claims_of(gens: list[Generation], prompts: list[list[int]] = PROMPTS) -> list[SampleClaim]:
    return [
        SampleClaim(p, g.tokens, s, i, g.finish_reason, build_proofs(g.hidden))
        for i, (p, g, s) in enumerate(zip(prompts, gens, SEEDS, strict=True))
    ]


@pytest.fixture(scope="module")
def fp32() -> TorchEngine:
    return TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="float32")


@pytest.fixture(scope="module")
def bf16() -> TorchEngine:
    return TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="bfloat16")


@pytest.fixture(scope="module")
def honest(fp32: TorchEngine) -> list[Generation]:
    return fp32.generate(PROMPTS, SEEDS, T, MAX)


def verify(engine: TorchEngine, claims: list[SampleClaim]) -> list[bool]:
    verdicts = verify_samples(
        engine,
        claims,
        temperature=T,
        max_tokens=MAX,
        submission_mant_err_mean=DEFAULT_MODEL_SUBMISSION_MANT_ERR,
    )
    return [v.ok for v in verdicts]


def test_honest_rerun_passes(fp32: TorchEngine, honest: list[Generation]) -> None:
    verdicts = verify_samples(fp32, claims_of(honest), temperature=T, max_tokens=MAX)
    assert all(v.ok for v in verdicts), [v.reasons for v in verdicts if not v.ok]
    assert all(c.exp_mismatches == 0 for v in verdicts for c in v.proofs)


def test_bf16_generation_passes_fp32_prefill_and_back(fp32: TorchEngine, bf16: TorchEngine) -> None:
    gens = bf16.generate(PROMPTS, SEEDS, T, MAX)
    assert all(verify(fp32, claims_of(gens)))
    assert all(verify(bf16, claims_of(fp32.generate(PROMPTS, SEEDS, T, MAX))))


@pytest.mark.parametrize("noise_seed", [1, 2])
def test_a_different_model_fails(fp32: TorchEngine, noise_seed: int) -> None:
    model = load_causal_lm(DEFAULT_MODEL_DIR)
    g = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-2 * torch.randn(p.shape, generator=g))
    other = TorchEngine(model, eos_id=tok.EOS_ID, pad_id=tok.PAD_ID)
    results = verify(fp32, claims_of(other.generate(PROMPTS, SEEDS, T, MAX)))
    assert not any(results)


def test_a_changed_prompt_fails(fp32: TorchEngine, honest: list[Generation]) -> None:
    claimed = [tok.encode(default_suite().task(500 + i).prompt) for i in range(N)]
    assert not any(verify(fp32, claims_of(honest, claimed)))


def test_one_changed_token_fails(fp32: TorchEngine, honest: list[Generation]) -> None:
    claims = []
    for c in claims_of(honest):
        tokens = list(c.tokens)
        pos = len(tokens) // 2 if len(tokens) > 1 else 0
        tokens[pos] = ord("7") if tokens[pos] != ord("7") else ord("3")
        claims.append(replace(c, tokens=tokens))
    assert not any(verify(fp32, claims))


def test_edited_tokens_with_recomputed_proofs_fail(
    fp32: TorchEngine, honest: list[Generation]
) -> None:
    claims = []
    for c in claims_of(honest):
        tokens = list(c.tokens)
        tokens[0] = ord("9") if tokens[0] != ord("9") else ord("8")
        pre = fp32.prefill(c.prompt, tokens)  # proofs that really match the edited tokens
        claims.append(replace(c, tokens=tokens, proofs=build_proofs(pre.hidden)))
    verdicts = verify_samples(fp32, claims, temperature=T, max_tokens=MAX)
    assert not any(v.ok for v in verdicts)
    assert all(v.hard and v.sampling is not None and not v.sampling.ok for v in verdicts)


@pytest.mark.parametrize("kind", ["wrong", "reused"])
def test_wrong_or_reused_seed_fails(fp32: TorchEngine, honest: list[Generation], kind: str) -> None:
    # The worker samples with other seeds than the assigned ones and claims the assigned ones.
    # Where the seed does not change the output (a confident policy) there is nothing to
    # detect and nothing gained. A sample whose tokens differ is rejected unless every token it
    # changed is a near-tie under the claimed seed (within the sampling check's float-noise
    # tolerance; docs/BENCHMARKS.md measures 0.977 detection for that reason): such escapes must
    # be rare and must have gone through the tolerance.
    used = [s + 1 for s in SEEDS] if kind == "wrong" else [SEEDS[0]] * N
    cheat = fp32.generate(PROMPTS, used, T, MAX, sample_indices=[0] * N)
    verdicts = verify_samples(
        fp32,
        claims_of(cheat),
        temperature=T,
        max_tokens=MAX,
        submission_mant_err_mean=DEFAULT_MODEL_SUBMISSION_MANT_ERR,
    )
    changed = [a.tokens != b.tokens for a, b in zip(cheat, honest, strict=True)]
    assert sum(changed) >= 3
    escaped = [v for v, ch in zip(verdicts, changed, strict=True) if ch and v.ok]
    assert all(v.sampling is not None and v.sampling.tolerated > 0 for v in escaped), escaped
    assert len(escaped) <= max(1, sum(changed) // 8), (len(escaped), sum(changed))


def test_cut_short_reported_as_finished_fails(fp32: TorchEngine, honest: list[Generation]) -> None:
    claims = []
    for c in claims_of(honest):
        full = [t for t in c.tokens if t != tok.EOS_ID]
        if len(full) < 2:
            continue  # nothing to cut
        body = full[: len(full) // 2]
        claims.append(replace(c, tokens=[*body, tok.EOS_ID], finish_reason="stop"))
        claims.append(replace(c, tokens=body, finish_reason="stop"))
    assert len(claims) >= 8
    assert not any(verify(fp32, claims))


def test_termination_rules() -> None:
    eos = tok.EOS_ID
    assert check_termination([1, eos], "stop", 4, eos) is None
    assert check_termination([1, 2, 3, 4], "length", 4, eos) is None
    assert check_termination([1, 2], "stop", 4, eos)  # no EOS
    assert check_termination([1, 2], "length", 4, eos)  # short
    assert check_termination([1, eos, 2, 3], "length", 4, eos)  # EOS inside
    assert check_termination([1, 2, 3, 4, eos], "stop", 4, eos)  # too long
    assert check_termination([], "stop", 4, eos)
    assert check_termination([1], "done", 4, eos)
