"""The validator's sampling check runs in bounded memory for real vocabularies (issue 11 item 5):
chunked over positions, never holding a sample's full-vocabulary logits, and what crosses the
engine pipe is a few numbers per sample."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import msgpack
import numpy as np

from node.compute.engine import Engine, EngineInfo, Generation, Prefill, PrefillStates
from node.verify import (
    BYTES_PER_LOGIT,
    SampleClaim,
    VerifySettings,
    check_claims,
    verdict_to_wire,
)
from swarm.sampling import GUMBEL_1, GUMBEL_2, draw_noise
from swarm.toploc import build_proofs

VOCAB = 151_936  # Qwen2's vocabulary
HIDDEN = 64
TOKENS = 256
SAMPLES = 2
CHUNK_BYTES = 64 * 1024 * 1024


class FakeStates(PrefillStates):
    """Zero logits made on demand (what a large-vocab LM head would hand out chunk by chunk)."""

    def __init__(self, hidden: np.ndarray, asked: list[int]) -> None:
        self.hidden = hidden
        self._asked = asked

    def logits(self, start: int, stop: int) -> np.ndarray:
        self._asked.append(stop - start)
        return np.zeros((stop - start, VOCAB), np.float32)


class LargeVocabPrefill(Engine):
    """A fake engine with a 150k vocabulary whose prefill streams states, for the memory bound."""

    def __init__(self, hidden: list[np.ndarray]) -> None:
        self.info = EngineInfo(VOCAB, HIDDEN, eos_id=0, pad_id=0, dtype="float32")
        self.hidden = hidden
        self.asked: list[int] = []

    def prefill_stream(self, items: list[tuple[list[int], list[int]]]) -> Iterator[PrefillStates]:
        for i, _ in enumerate(items):
            yield FakeStates(self.hidden[i], self.asked)

    def generate(self, *args: object, **kwargs: object) -> list[Generation]:
        raise NotImplementedError

    def prefill(self, prompt: list[int], tokens: list[int]) -> Prefill:
        raise NotImplementedError

    def load_weights(self, path: str) -> None:
        raise NotImplementedError


def honest_claims(engine: LargeVocabPrefill, sampler: str) -> list[SampleClaim]:
    """Tokens that seeded Gumbel-max picks from zero logits; proofs of the fake hidden states."""
    claims = []
    for j in range(SAMPLES):
        noise = draw_noise([9] * TOKENS, [j] * TOKENS, range(TOKENS), VOCAB, sampler=sampler)
        tokens = [int(t) for t in noise.argmax(1)]
        proofs = build_proofs(engine.hidden[j])
        claims.append(SampleClaim([1, 2, 3], tokens, 9, j, "length", proofs))
    return claims


def make_engine() -> LargeVocabPrefill:
    rng = np.random.default_rng(0)
    floats = [rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32) for _ in range(SAMPLES)]
    return LargeVocabPrefill([(f.view(np.uint32) >> 16).astype(np.uint16) for f in floats])


def test_gumbel_2_checks_a_150k_vocabulary_in_chunks_of_positions() -> None:
    """The noise and scores are torch tensors (tracemalloc does not see them): what bounds the
    memory is that logits are asked for ``rows_per_chunk`` positions at a time, across
    samples, and that only a few numbers per sample come back."""
    engine = make_engine()
    claims = honest_claims(engine, GUMBEL_2)
    settings = VerifySettings(temperature=1.0, max_tokens=TOKENS, chunk_bytes=CHUNK_BYTES)
    rows = settings.rows_per_chunk(VOCAB)
    verdicts = check_claims(engine, claims, settings)
    assert [v.ok for v in verdicts] == [True, True], [v.reasons for v in verdicts]
    assert max(engine.asked) == rows and sum(engine.asked) == SAMPLES * TOKENS
    frame = msgpack.packb([verdict_to_wire(v) for v in verdicts], use_bin_type=True)
    assert len(frame) < 300 * SAMPLES


def test_sampling_check_peak_memory_stays_within_the_chunk_budget() -> None:
    """gumbel-1 (old runs) draws its noise with numpy, whose arrays tracemalloc counts."""
    engine = make_engine()
    claims = honest_claims(engine, GUMBEL_1)
    settings = VerifySettings(
        temperature=1.0, max_tokens=TOKENS, chunk_bytes=CHUNK_BYTES, sampler=GUMBEL_1
    )
    rows = settings.rows_per_chunk(VOCAB)
    assert rows == CHUNK_BYTES // (VOCAB * BYTES_PER_LOGIT) == 7  # > 1M entries: thread pool

    tracemalloc.start()
    try:
        verdicts = check_claims(engine, claims, settings)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert [v.ok for v in verdicts] == [True, True], [v.reasons for v in verdicts]
    assert max(engine.asked) == rows and sum(engine.asked) == SAMPLES * TOKENS
    full_logits = TOKENS * VOCAB * 4  # one sample's float32 logits, unchunked: 156 MB
    assert peak <= CHUNK_BYTES, f"peak {peak / 2**20:.1f} MiB over the 64 MiB budget"
    assert peak < full_logits / 2
    # What crosses the pipe: a few numbers per sample, whatever the vocabulary.
    frame = msgpack.packb([verdict_to_wire(v) for v in verdicts], use_bin_type=True)
    assert len(frame) < 300 * SAMPLES


def test_the_stated_bound_for_150k_vocab_and_64_by_1024_tokens() -> None:
    """docs/inference.md and node/verify.py state this arithmetic; keep them honest."""
    rows = VerifySettings(temperature=1.0, max_tokens=1024).rows_per_chunk(VOCAB)
    assert rows == 31
    assert rows * VOCAB * BYTES_PER_LOGIT <= 256 * 2**20
    assert 64 * 1024 * VOCAB * 4 // 2**30 == 37  # GiB of float32 logits, unchunked
