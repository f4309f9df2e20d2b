"""Engines on the embedded default model: torch in-process and the child-process wrapper."""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from node.compute.child import ChildEngine
from node.compute.engine import ScoreItem
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.model import tokenizer as tok
from node.tasks import default_suite
from node.verify import SampleClaim, VerifySettings
from swarm.errors import EngineError
from swarm.toploc import (
    CHUNK_SIZE,
    ProofCheck,
    ProofThresholds,
    build_proofs,
    proofs_pass,
    verify_proofs,
)

PROMPTS = [tok.encode(default_suite().task(i).prompt) for i in range(6)]
DEFAULTS = ProofThresholds()  # the run genesis defaults: <= 38 mismatches, mean 10, median 8


def checks_of(hidden: np.ndarray, claimed: np.ndarray) -> list[ProofCheck]:
    """Proofs built from ``claimed`` checked against ``hidden``: one check per chunk, never an
    empty list (on which every "all pass" would hold)."""
    checks = verify_proofs(hidden, build_proofs(claimed))
    assert len(checks) == math.ceil(len(hidden) / CHUNK_SIZE) >= 1
    return checks


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine.from_dir(DEFAULT_MODEL_DIR)


def test_generation_is_deterministic_and_well_formed(engine: TorchEngine) -> None:
    a = engine.generate(PROMPTS, list(range(6)), 1.0, 16)
    b = engine.generate(PROMPTS, list(range(6)), 1.0, 16)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    for g in a:
        assert 1 <= len(g.tokens) <= 16
        assert g.hidden.dtype == np.uint16 and g.hidden.shape == (len(g.tokens), 128)
        assert (g.finish_reason == "stop") == (g.tokens[-1] == tok.EOS_ID)


def test_batching_and_padding_do_not_change_samples(engine: TorchEngine) -> None:
    batched = engine.generate(PROMPTS, [9] * 6, 1.0, 16)
    for i, prompt in enumerate(PROMPTS):
        (alone,) = engine.generate([prompt], [9], 1.0, 16, sample_indices=[i])
        assert alone.tokens == batched[i].tokens


def test_prefill_reproduces_generation(engine: TorchEngine) -> None:
    gens = engine.generate(PROMPTS, list(range(6)), 1.0, 16)
    pres = engine.prefill_batch([(p, g.tokens) for p, g in zip(PROMPTS, gens, strict=True)])
    for g, pre in zip(gens, pres, strict=True):
        assert pre.logits.shape == (len(g.tokens), tok.VOCAB_SIZE)
        checks = checks_of(pre.hidden, g.hidden)
        assert all(c.exp_mismatches == 0 and c.mant_err_mean <= 1 for c in checks), checks


def test_proofs_of_other_hidden_states_fail_the_thresholds(engine: TorchEngine) -> None:
    """The control that makes the passing checks above mean something: the same tokens after
    another prompt give other hidden states, and their proofs fail the default thresholds."""
    (g,) = engine.generate(PROMPTS[:1], [3], 1.0, 40)
    honest = engine.prefill(PROMPTS[0], g.tokens)
    elsewhere = engine.prefill(PROMPTS[1], g.tokens)
    assert proofs_pass(checks_of(honest.hidden, g.hidden), DEFAULTS)
    assert not proofs_pass(checks_of(honest.hidden, elsewhere.hidden), DEFAULTS)


def test_hidden_is_post_norm_it_feeds_the_lm_head(engine: TorchEngine) -> None:
    prompt, tokens = PROMPTS[0], [ord("1"), ord("2"), tok.EOS_ID]
    pre = engine.prefill(prompt, tokens)
    with torch.no_grad():
        out = engine.model(torch.tensor([prompt + tokens[:-1]]), output_hidden_states=True)
    ref_logits = out.logits[0, len(prompt) - 1 :].float().numpy()
    assert np.allclose(pre.logits, ref_logits, atol=1e-5)
    last = out.hidden_states[-1][0, len(prompt) - 1 :].to(torch.bfloat16)
    assert np.array_equal(pre.hidden, last.view(torch.int16).numpy().view(np.uint16))


def test_load_weights_switches_policy(engine: TorchEngine, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    noisy = {k: (v * 1.5).contiguous() for k, v in original.items()}
    save_file(noisy, str(tmp_path / "v1.safetensors"))
    save_file(original, str(tmp_path / "v0.safetensors"))
    before = engine.prefill(PROMPTS[0], [1, 2]).logits
    engine.load_weights(str(tmp_path / "v1.safetensors"))
    assert not np.allclose(engine.prefill(PROMPTS[0], [1, 2]).logits, before)
    engine.load_weights(str(tmp_path / "v0.safetensors"))
    assert np.array_equal(engine.prefill(PROMPTS[0], [1, 2]).logits, before)


@pytest.fixture(scope="module")
def child() -> Iterator[ChildEngine]:
    eng = ChildEngine(DEFAULT_MODEL_DIR, threads=1)
    yield eng
    eng.close()


@pytest.mark.slow
def test_child_generates_what_the_in_process_engine_does(
    child: ChildEngine, engine: TorchEngine
) -> None:
    here = engine.generate(PROMPTS[:3], [1, 2, 3], 1.0, 12)
    there = child.generate(PROMPTS[:3], [1, 2, 3], 1.0, 12)
    assert [g.tokens for g in there] == [g.tokens for g in here]
    # The child runs one thread, this process more: float reductions may round differently in
    # the last bit, so the hidden states agree as TOPLOC sees them, not bit for bit.
    for a, b in zip(here, there, strict=True):
        assert proofs_pass(checks_of(b.hidden, a.hidden), DEFAULTS)
    pre = child.prefill(PROMPTS[0], there[0].tokens)
    mine = engine.prefill(PROMPTS[0], here[0].tokens)
    assert proofs_pass(checks_of(pre.hidden, mine.hidden), DEFAULTS)


@pytest.mark.slow
async def test_child_is_usable_from_trio(child: ChildEngine) -> None:
    gens = await child.agenerate(PROMPTS[:2], [1, 2], 0.0, 8)
    assert len(gens) == 2
    pres = await child.aprefill_batch([(PROMPTS[0], gens[0].tokens)])
    assert pres[0].hidden.shape[0] == len(gens[0].tokens)


@pytest.mark.slow
def test_child_errors_are_engine_errors_and_it_stays_up(child: ChildEngine) -> None:
    with pytest.raises(EngineError, match="failed"):
        child.generate([[]], [1], 1.0, 4)
    assert len(child.generate(PROMPTS[:1], [1], 1.0, 4)) == 1


@pytest.mark.slow
def test_child_crash_is_a_clear_error_and_restart_recovers(child: ChildEngine) -> None:
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(EngineError, match="restart"):
        child.generate(PROMPTS[:1], [1], 1.0, 4)
    child.restart()
    assert len(child.generate(PROMPTS[:1], [1], 1.0, 4)[0].tokens) >= 1


@pytest.mark.slow
def test_child_on_a_bad_model_dir_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"config\.json"):
        ChildEngine(tmp_path)


@pytest.mark.slow
def test_child_tokenizes_scores_and_verifies_like_the_in_process_engine(
    child: ChildEngine, engine: TorchEngine
) -> None:
    texts = [default_suite().task(i).prompt for i in range(3)]
    assert child.encode_prompts(texts) == engine.encode_prompts(texts) == PROMPTS[:3]
    task = default_suite().task(0)
    items = [
        ScoreItem([*tok.encode(task.answer, bos=False), tok.EOS_ID], task.answer, "exact"),
        ScoreItem([*b"0.50", tok.EOS_ID], "\\boxed{1/2}", "math", target_len=2),
        ScoreItem([tok.EOS_ID], task.answer, "exact"),
    ]
    assert child.score(items, 0.1) == engine.score(items, 0.1) == [1.0, pytest.approx(0.7), 0.0]
    gens = engine.generate(PROMPTS[:2], [5, 5], 1.0, 12, sample_indices=[0, 1])
    claims = [
        SampleClaim(p, g.tokens, 5, j, g.finish_reason, build_proofs(g.hidden))
        for j, (p, g) in enumerate(zip(PROMPTS[:2], gens, strict=True))
    ]
    forged = SampleClaim(PROMPTS[0], [*gens[0].tokens], 5, 1, gens[0].finish_reason, [])
    settings = VerifySettings(temperature=1.0, max_tokens=12)
    there = child.verify([*claims, forged], settings)
    assert [v.ok for v in there] == [True, True, False]
    assert [v.ok for v in engine.verify([*claims, forged], settings)] == [True, True, False]


@pytest.mark.slow
def test_child_runs_a_hugging_face_model_with_its_chat_template(hf_model_dir: Path) -> None:
    with ChildEngine(hf_model_dir, threads=1, chat_template=True) as eng:
        (prompt,) = eng.encode_prompts(["rev:abc="])
        assert eng.info.eos_id == 2 and eng.info.vocab_size == 512
        (gen,) = eng.generate([prompt], [3], 1.0, 20)
        claim = SampleClaim(prompt, gen.tokens, 3, 0, gen.finish_reason, build_proofs(gen.hidden))
        (verdict,) = eng.verify([claim], VerifySettings(temperature=1.0, max_tokens=20))
        assert verdict.ok, verdict.reasons
        assert isinstance(eng.decode(gen.tokens), str)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_engine_on_cuda_in_bf16_is_verified_on_the_cpu(hf_model_dir: Path) -> None:
    gpu = TorchEngine.from_dir(hf_model_dir, dtype="bfloat16", device="cuda")
    cpu = TorchEngine.from_dir(hf_model_dir, dtype="float32")
    prompts = gpu.encode_prompts(["rev:abc=", "sort:zyx="] * 4)
    gens = gpu.generate(prompts, [1] * 8, 1.0, 40)
    claims = [
        SampleClaim(p, g.tokens, 1, j, g.finish_reason, build_proofs(g.hidden))
        for j, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]
    assert all(v.ok for v in cpu.verify(claims, VerifySettings(temperature=1.0, max_tokens=40)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vllm_engine_matches_torch_sampling() -> None:
    from node.compute.vllm_engine import VllmEngine, vllm_available
    from swarm.sampling import check_sampling

    if not vllm_available():
        pytest.skip("vllm (extra 'gpu') not installed")
    eng = VllmEngine(str(DEFAULT_MODEL_DIR))
    gens = eng.generate(PROMPTS, list(range(6)), 1.0, 16)
    for i, (p, g) in enumerate(zip(PROMPTS, gens, strict=True)):
        pre = eng.prefill(p, g.tokens)
        assert check_sampling(pre.logits, g.tokens, i, 1.0, sample=i).ok
        checks = checks_of(pre.hidden, g.hidden)
        assert proofs_pass(checks, DEFAULTS), checks


def test_streamed_prefill_in_micro_batches_matches_the_batched_prefill(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import node.compute.torch_engine as te

    gens = engine.generate(PROMPTS, list(range(6)), 1.0, 10)
    items = [(p, g.tokens) for p, g in zip(PROMPTS, gens, strict=True)]
    whole = engine.prefill_batch(items)
    monkeypatch.setattr(te, "PREFILL_TOKENS", 24)  # one or two samples per forward
    for pre, states in zip(whole, engine.prefill_stream(items), strict=True):
        assert proofs_pass(checks_of(states.hidden, pre.hidden), DEFAULTS)
        n = len(pre.logits)
        rows = np.concatenate([states.logits(a, min(n, a + 3)) for a in range(0, n, 3)])
        assert np.allclose(rows, pre.logits, atol=1e-4)


def test_chunked_sampling_check_finds_a_late_forged_token_at_its_position(
    engine: TorchEngine,
) -> None:
    (gen,) = engine.generate(PROMPTS[:1], [4], 1.0, 12, sample_indices=[0])
    tokens = list(gen.tokens)
    k = len(tokens) - 2  # a wrong byte past the first chunks, before the final EOS
    assert k >= 4 and tokens[k] < 256
    tokens[k] = (tokens[k] + 1) % 256
    claim = SampleClaim(PROMPTS[0], tokens, 4, 0, gen.finish_reason, build_proofs(gen.hidden))
    one_row = 56 * engine.info.vocab_size  # chunks of one position
    verdicts = [
        engine.verify([claim], VerifySettings(1.0, 12, chunk_bytes=size))[0]
        for size in (one_row, 3 * one_row, 1 << 28)
    ]
    for v in verdicts:
        assert v.sampling is not None and not v.ok and v.hard
    assert {v.sampling.first_mismatch for v in verdicts if v.sampling} == {k}
    assert len({(v.sampling.mismatches, v.sampling.near_ties) for v in verdicts if v.sampling}) == 1
