"""The ``vllm`` engine (GPU, optional extra ``gpu``): a whole submission in one vllm batch.

Written against vllm's V1 engine (the ``gpu`` extra pins ``vllm>=0.11,<0.34``), import-guarded:
without vllm the constructor raises :class:`EngineError` naming the extra, and ``join --engine
vllm`` refuses earlier (:mod:`node.compute.devices`). **Not measured here**: the machines this
was written on have no vllm (and the lent GPU machine cannot install it); the torch engine on
CUDA is what ``bench/gpu_check.py`` measures, and the batch math below is tested without vllm
(``tests/unit/test_vllm_sampling.py``). Decisions:

- Sampling: the run's seeded sampler of :mod:`swarm.sampling` (``gumbel-2``, or ``gumbel-1``
  for old runs; :meth:`VllmEngine.generate` takes its name), so the torch validator reproduces
  every token. One batch-level logits processor (``SeededGumbel`` of :func:`seeded_gumbel_class`,
  a subclass of vllm V1's ``vllm.v1.sample.logits_processor.LogitsProcessor``) holds a
  :class:`node.compute.vllm_sampling.SeededBatch`: ``update_state`` follows vllm's persistent
  batch (``BatchUpdate``: removed, added, moved) and keeps the seeded rows' request keys on the
  device; ``apply`` computes ``argmax(logits / T + g(seed, sample, step))`` for every seeded
  row of the ``[num_reqs, vocab]`` logits in one pass on the GPU, a row's step being the length
  of its output token list, and masks every other token of those rows to ``-inf``; vllm then
  runs greedily (``temperature=0``). Rows without our ``extra_args`` are untouched. The
  processor declares ``is_argmax_invariant() = False``, so vllm applies it before its greedy
  pick (the sampler applies non-argmax-invariant processors even when every request is
  greedy). No per-row device sync: the old per-request adapter (``AdapterLogitsProcessor``)
  copied each row to the CPU (issue 24: ~1.5 s per decode step at 256 running requests).
- vllm 0.32 made a new model runner (MRV2) the default; it falls back to the V1 runner when
  custom logits processors are loaded, and later versions give MRV2 its own processor
  interface and refuse V1-interface processors (vllm PRs #47585, #56497). We always select the
  V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``, set even over the caller's environment), whose
  interface this uses.
- Stop set: ``SamplingParams(stop_token_ids=sorted(info.stop_ids))``, the model's whole stop
  set (:func:`node.model.loading.model_info`: every EOS id of ``generation_config.json`` and
  ``config.json`` plus the chat template's end-of-turn token); vllm keeps the stop token in the
  output. A sample is ``"stop"`` when it ends on any id of the set, else ``"length"``; a sample
  that ends short of ``max_tokens`` on no stop id (vllm's ``max_model_len`` cut it) raises
  :class:`EngineError` instead of going out as a claim every validator would reject.
- The whole submission goes to vllm as one ``generate`` call (vllm batches it continuously).
- Hidden states for TOPLOC: a batched prefill of prompt + tokens on the same GPU with the torch
  engine in the same dtype (:class:`node.compute.torch_engine.TorchEngine`), which is what the
  validator recomputes; vllm does not expose final hidden states of generated tokens through a
  stable API. The prefill costs one forward pass over the submission (no decode loop).
- Validator checks (``prefill``, ``verify``) run on that torch engine; the tokenizer is the
  model's own (:class:`node.model.text.ModelText`), vllm's tokenizer is not initialised.
- New policy weights load into vllm's model through ``LLM.apply_model`` (engine core kept in
  this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which also lets vllm take the processor
  class object itself) and into the torch prefill engine.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from node.compute.engine import Engine, EngineInfo, FinishReason, Generation, Prefill, PrefillStates
from node.compute.vllm_sampling import SeededBatch, SeededSpec
from node.model.loading import model_info
from node.model.text import ModelText
from swarm.errors import EngineError
from swarm.sampling import GUMBEL_2, check_sampler


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@functools.cache
def seeded_gumbel_class() -> Any:
    """vllm's batch-level processor around :class:`SeededBatch`, built once vllm is importable."""
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class SeededGumbel(LogitsProcessor):  # type: ignore[misc]
        """Masks all but the seeded Gumbel-max token of each seeded row (greedy picks it)."""

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            SeededSpec.from_extra_args(getattr(sampling_params, "extra_args", None))

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            self.batch = SeededBatch(device, pin_memory=is_pin_memory)

        def is_argmax_invariant(self) -> bool:
            return False  # it decides the argmax

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            # None: the same requests; their steps are read in apply.
            self.batch.follow(batch_update, MoveDirectionality.SWAP)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return self.batch.apply(logits)

    return SeededGumbel


def finish_reason(tokens: list[int], stop_ids: frozenset[int], max_tokens: int) -> FinishReason:
    """``"stop"`` for a sample that ends on a stop id, ``"length"`` for one of ``max_tokens``
    tokens; :class:`EngineError` for one cut short of both (no honest claim describes it)."""
    if tokens and tokens[-1] in stop_ids:
        return "stop"
    if len(tokens) == max_tokens:
        return "length"
    raise EngineError(
        f"vllm ended a sample after {len(tokens)} of {max_tokens} tokens on no stop id "
        "(prompt + max_tokens exceed the model's max_model_len?); shorten max_tokens"
    )


class VllmEngine(Engine):
    def __init__(
        self,
        path: str,
        *,
        dtype: str = "bfloat16",
        device: str = "cuda",
        chat_template: bool = False,
        gpu_memory_utilization: float = 0.6,
    ) -> None:
        if not vllm_available():
            raise EngineError(
                "the vllm engine needs the optional extra: pip install 'swarm-node[gpu]'"
            )
        if not device.startswith("cuda"):
            raise EngineError(f"the vllm engine runs on CUDA only, not {device}")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the processor has the V1 interface
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if ":" in device:  # vllm takes the device from CUDA_VISIBLE_DEVICES
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", device.split(":", 1)[1])
            device = "cuda"
        from vllm import LLM

        from node.compute.torch_engine import TorchEngine

        info = model_info(path)
        self.path = path
        self.info = EngineInfo(
            info.vocab_size, info.hidden_size, info.eos_id, info.pad_id, dtype, info.eos_ids
        )
        self.text = ModelText(path, chat_template=chat_template)
        self.llm = LLM(
            model=path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            skip_tokenizer_init=True,
            logits_processors=[seeded_gumbel_class()],
        )
        self._prefill = TorchEngine.from_dir(path, dtype=dtype, device=device)

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        temperature: float,
        max_tokens: int,
        sample_indices: list[int] | None = None,
        *,
        sampler: str = GUMBEL_2,
    ) -> list[Generation]:
        from vllm import SamplingParams

        check_sampler(sampler)
        samples = list(range(len(prompts))) if sample_indices is None else sample_indices
        stops = sorted(self.info.stop_ids)
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                stop_token_ids=stops,
                detokenize=False,
                extra_args=SeededSpec(seed, sample, float(temperature), sampler).to_extra_args(),
            )
            for seed, sample in zip(seeds, samples, strict=True)
        ]
        requests = [{"prompt_token_ids": p} for p in prompts]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        finish = [finish_reason(t, self.info.stop_ids, max_tokens) for t in tokens]
        # One batched prefill on the same GPU gives the hidden states the validator recomputes.
        states = self._prefill.prefill_stream(list(zip(prompts, tokens, strict=True)))
        return [
            Generation(toks, why, st.hidden)
            for toks, why, st in zip(tokens, finish, states, strict=True)
        ]

    def prefill(self, prompt: list[int], tokens: list[int]) -> Prefill:
        return self._prefill.prefill(prompt, tokens)

    def prefill_batch(self, items: list[tuple[list[int], list[int]]]) -> list[Prefill]:
        return self._prefill.prefill_batch(items)

    def prefill_stream(self, items: list[tuple[list[int], list[int]]]) -> Iterator[PrefillStates]:
        return self._prefill.prefill_stream(items)

    def load_weights(self, path: str) -> None:
        """A policy version: one safetensors file, or a directory of a sharded version's files
        (tensor by tensor: a sharded model of many GB never sits in memory twice)."""
        from node.model.loading import iter_weights

        self.llm.apply_model(lambda model: model.load_weights(iter_weights(Path(path))))
        self._prefill.load_weights(path)
