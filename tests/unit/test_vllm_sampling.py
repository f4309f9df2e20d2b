"""The vllm engine's batch-level seeded sampler (node/compute/vllm_sampling.py), without vllm:
each seeded row of a batch keeps only the token the torch engine's sampler picks, other rows are
untouched, the state follows vllm's batch changes, and one step reads nothing back from the
device (checked on the meta device here, and with CUDA's sync checker where a GPU is)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import node.compute.vllm_sampling as vs
from node.compute.vllm_engine import finish_reason
from node.compute.vllm_sampling import EXTRA, SeededBatch, SeededSpec
from swarm.errors import EngineError
from swarm.sampling import GUMBEL_1, GUMBEL_2, choose_tokens, gumbel2_noise

VOCAB = 3001


class Direction(enum.Enum):
    """Stands in for vllm's ``MoveDirectionality``."""

    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


@dataclass
class FakeBatchUpdate:
    """The fields of vllm's ``BatchUpdate`` that the processor reads."""

    batch_size: int
    removed: list[int] = field(default_factory=list)
    added: list[tuple[int, Any, list[int] | None, list[int]]] = field(default_factory=list)
    moved: list[tuple[int, int, Direction]] = field(default_factory=list)


def params(spec: SeededSpec | None) -> Any:
    return SimpleNamespace(extra_args=None if spec is None else spec.to_extra_args())


def expected(logits: torch.Tensor, row: int, spec: SeededSpec, step: int) -> int:
    """What the torch engine's sampler picks for that row alone."""
    one = logits[row : row + 1]
    return int(
        choose_tokens(one, [spec.seed], [spec.sample], step, spec.temperature, sampler=spec.sampler)
    )


def assert_masked(
    out: torch.Tensor, before: torch.Tensor, ours: dict[int, tuple[SeededSpec, int]]
) -> None:
    for row in range(before.shape[0]):
        if row not in ours:
            assert torch.equal(out[row], before[row]), f"row {row} is not ours but changed"
            continue
        spec, step = ours[row]
        finite = torch.isfinite(out[row]).nonzero().flatten().tolist()
        assert finite == [expected(before, row, spec, step)], f"row {row}"
        assert int(out[row].argmax()) == finite[0]  # vllm's greedy pick takes it


@pytest.mark.parametrize("sampler", [GUMBEL_2, GUMBEL_1])
def test_seeded_rows_keep_only_the_torch_samplers_token_and_other_rows_are_untouched(
    sampler: str,
) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(7, VOCAB, generator=gen) * 3
    specs = {
        0: SeededSpec(11, 0, 1.0, sampler),
        2: SeededSpec(11, 1, 1.0, sampler),
        3: SeededSpec(2**64 - 1, 7, 0.7, sampler),
        5: SeededSpec(3, 2, 0.0, sampler),  # greedy row
    }
    outputs = {0: [4, 4, 4], 2: [], 3: [1] * 17, 5: [9]}
    batch = SeededBatch("cpu")
    batch.follow(
        FakeBatchUpdate(
            7,
            added=[(r, params(s), None, outputs[r]) for r, s in specs.items()]
            + [(r, params(None), None, []) for r in (1, 4, 6)],
        ),
        Direction.SWAP,
    )
    before = logits.clone()
    out = batch.apply(logits)
    assert out is logits  # in place, as vllm allows
    assert_masked(out, before, {r: (s, len(outputs[r])) for r, s in specs.items()})


def test_a_batch_of_both_samplers_picks_each_rows_token() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    specs = {0: SeededSpec(1, 0, 1.0, GUMBEL_1), 1: SeededSpec(1, 0, 1.0, GUMBEL_2)}
    specs[3] = SeededSpec(1, 1, 1.0, GUMBEL_2)
    batch = SeededBatch("cpu")
    batch.update(added=[(r, s, [0] * r) for r, s in specs.items()])
    before = logits.clone()
    assert_masked(batch.apply(logits), before, {r: (s, r) for r, s in specs.items()})


def test_state_follows_removes_adds_moves_and_swaps_and_growing_outputs() -> None:
    a, b, c, d = (SeededSpec(21, j, 1.0) for j in range(4))
    outs: dict[str, list[int]] = {"a": [], "b": [5], "c": [], "d": [1, 2]}
    batch = SeededBatch("cpu")
    batch.follow(
        FakeBatchUpdate(
            4,
            added=[
                (0, params(a), [1], outs["a"]),
                (1, params(b), [1], outs["b"]),
                (2, params(None), [1], []),
                (3, params(c), [1], outs["c"]),
            ],
        ),
        Direction.SWAP,
    )
    # c finishes (slot 3 removed), d replaces the plain request at 2, then a <-> d swap.
    batch.follow(
        FakeBatchUpdate(
            3,
            removed=[3],
            added=[(2, params(d), [1], outs["d"])],
            moved=[(0, 2, Direction.SWAP)],
        ),
        Direction.SWAP,
    )
    outs["a"].append(7)  # vllm extends the lists it handed over: the step follows
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    assert_masked(batch.apply(logits), before, {0: (d, 2), 1: (b, 1), 2: (a, 1)})
    # b finishes; a one-way move condenses the batch: slot 2 (a) -> 1, slot 2 empties.
    batch.follow(
        FakeBatchUpdate(2, removed=[1], moved=[(2, 1, Direction.UNIDIRECTIONAL)]), Direction.SWAP
    )
    assert set(batch.requests) == {0, 1}
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    assert_masked(batch.apply(logits), before, {0: (d, 2), 1: (a, 1)})
    batch.follow(None, Direction.SWAP)  # no change: state kept
    assert set(batch.requests) == {0, 1}


def test_a_plain_request_added_over_a_seeded_slot_drops_it() -> None:
    batch = SeededBatch("cpu")
    batch.update(added=[(0, SeededSpec(1, 0, 1.0), [])])
    batch.update(added=[(0, None, [])])
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    assert torch.equal(batch.apply(logits), before)


def test_one_step_is_one_noise_pass_over_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = gumbel2_noise

    def counting(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
        calls.append(tuple(keys.shape))
        return real(keys, steps, vocab)

    monkeypatch.setattr(vs, "gumbel2_noise", counting)
    batch = SeededBatch("cpu")
    batch.update(added=[(r, SeededSpec(9, r, 1.0), [0] * (r % 5)) for r in range(0, 64, 2)])
    batch.apply(torch.randn(64, 512))
    assert calls == [(32, 2)]


def test_one_step_reads_nothing_back_from_the_device() -> None:
    """On the meta device any read of a value (``.item()``, ``.tolist()``, ``.cpu()``, a
    data-dependent shape) raises: a step that runs there makes no device-to-host copy."""
    batch = SeededBatch("meta")
    batch.update(added=[(r, SeededSpec(9, r, 0.8), [0] * r) for r in (0, 1, 3, 6)])
    out = batch.apply(torch.empty(8, 151_936, device="meta"))
    assert out.shape == (8, 151_936) and out.device.type == "meta"
    with pytest.raises((RuntimeError, NotImplementedError)):
        out.sum().item()  # the meta device does refuse reads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_step_never_synchronises_and_matches_the_torch_sampler() -> None:
    logits = torch.randn(256, 151_936, device="cuda")
    specs = {r: SeededSpec(4, r, 1.0) for r in range(0, 256, 3)}
    batch = SeededBatch(torch.device("cuda"), pin_memory=True)
    batch.update(added=[(r, s, [0] * (r % 7)) for r, s in specs.items()])
    before = logits.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch.apply(logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_masked(logits, before, {r: (s, r % 7) for r, s in specs.items()})


def test_extra_args_round_trip_and_malformed_specs_are_refused() -> None:
    spec = SeededSpec(2**64 - 1, 3, 0.5, GUMBEL_1)
    assert SeededSpec.from_extra_args(spec.to_extra_args()) == spec
    assert SeededSpec.from_extra_args(None) is None
    assert SeededSpec.from_extra_args({"other": 1}) is None
    for bad in ([1, 2, 1.0], [1, 2, 1.0, "gumbel-9"], [-1, 0, 1.0, GUMBEL_2], [1, 0, -1, GUMBEL_2]):
        with pytest.raises(ValueError, match=EXTRA):
            SeededSpec.from_extra_args({EXTRA: bad})


def test_finish_reason_reads_the_whole_stop_set() -> None:
    stops = frozenset({2, 7})
    assert finish_reason([5, 7], stops, 4) == "stop"
    assert finish_reason([5, 2], stops, 2) == "stop"
    assert finish_reason([5, 6], stops, 2) == "length"
    with pytest.raises(EngineError, match="max_model_len"):
        finish_reason([5], stops, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampler", [GUMBEL_2, GUMBEL_1])
def test_vllm_engine_samples_what_the_torch_check_accepts(sampler: str) -> None:
    from node.compute.vllm_engine import VllmEngine, vllm_available
    from node.model.loading import DEFAULT_MODEL_DIR
    from swarm.sampling import check_sampling

    if not vllm_available():
        pytest.skip("vllm (extra 'gpu') not installed")
    eng = VllmEngine(str(DEFAULT_MODEL_DIR))
    prompts = eng.encode_prompts(["rev:abc=", "sort:zyx=", "add:12+7="] * 3)
    gens = eng.generate(prompts, [3] * len(prompts), 1.0, 24, sampler=sampler)
    for j, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        assert g.finish_reason == ("stop" if g.tokens[-1] in eng.info.stop_ids else "length")
        pre = eng.prefill(p, g.tokens)
        assert check_sampling(pre.logits, g.tokens, 3, 1.0, sample=j, sampler=sampler).ok
