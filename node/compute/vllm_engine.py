"""The ``vllm`` engine (GPU, optional extra ``gpu``): a whole submission in one vllm batch.

Written against vllm's V1 engine (the ``gpu`` extra pins ``vllm>=0.11,<0.34``), import-guarded:
without vllm the constructor raises :class:`EngineError` naming the extra, and ``join --engine
vllm`` refuses earlier (:mod:`node.compute.devices`). **Not measured here**: the machines this
was written on have no vllm (and the lent GPU machine cannot install it); the torch engine on
CUDA is what ``bench/gpu_check.py`` measures. Decisions:

- Sampling: seeded Gumbel-max of :mod:`swarm.sampling`, so the torch validator reproduces every
  token. A per-request logits processor (:class:`SeededGumbel`, vllm's
  ``AdapterLogitsProcessor`` wrapper of the V1 batch-level interface) computes
  ``argmax(logits / T + g(seed, sample, step))`` from the request's ``extra_args`` and masks
  every other token; vllm then runs greedily (``temperature=0``). vllm 0.32 made a new model
  runner (MRV2) with another processor interface the default; we select the V1 runner
  (``VLLM_USE_V2_MODEL_RUNNER=0``) whose interface this uses.
- The whole submission goes to vllm as one ``generate`` call (vllm batches it continuously).
- Hidden states for TOPLOC: a batched prefill of prompt + tokens on the same GPU with the torch
  engine in the same dtype (:class:`node.compute.torch_engine.TorchEngine`), which is what the
  validator recomputes; vllm does not expose final hidden states of generated tokens through a
  stable API. The prefill costs one forward pass over the submission (no decode loop).
- Validator checks (``prefill``, ``verify``) run on that torch engine; the tokenizer is the
  model's own (:class:`node.model.text.ModelText`), vllm's tokenizer is not initialised.
- New policy weights load into vllm's model through ``LLM.apply_model`` (engine core kept in
  this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and into the torch prefill engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from node.compute.engine import Engine, EngineInfo, FinishReason, Generation, Prefill, PrefillStates
from node.model.loading import model_info
from node.model.text import ModelText
from swarm.errors import EngineError
from swarm.sampling import sampling_scores

EXTRA = "swarm_gumbel"
"""Key of ``SamplingParams.extra_args`` that carries ``[seed, sample index, temperature]``."""


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _seeded_gumbel_class() -> Any:
    """vllm's per-request adapter, built only once vllm is importable."""
    import torch
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class SeededGumbel(AdapterLogitsProcessor):  # type: ignore[misc]
        """Masks all but the seeded Gumbel-max token of each step (greedy picks it)."""

        def is_argmax_invariant(self) -> bool:
            return False  # it decides the argmax

        def new_req_logits_processor(self, params: Any) -> Any:
            spec = (params.extra_args or {}).get(EXTRA)
            if spec is None:
                return None
            seed, sample, temperature = int(spec[0]), int(spec[1]), float(spec[2])

            def choose(output_ids: list[int], logits: Any) -> Any:
                scores = sampling_scores(
                    logits.float().cpu(), seed, sample, len(output_ids), temperature
                )
                keep = int(np.argmax(scores))
                masked = torch.full_like(logits, float("-inf"))
                masked[keep] = 0.0
                return masked

            return choose

    return SeededGumbel


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
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if ":" in device:  # vllm takes the device from CUDA_VISIBLE_DEVICES
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", device.split(":", 1)[1])
            device = "cuda"
        from vllm import LLM

        from node.compute.torch_engine import TorchEngine

        info = model_info(path)
        self.path = path
        self.info = EngineInfo(info.vocab_size, info.hidden_size, info.eos_id, info.pad_id, dtype)
        self.text = ModelText(path, chat_template=chat_template)
        self.llm = LLM(
            model=path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            skip_tokenizer_init=True,
            logits_processors=[_seeded_gumbel_class()],
        )
        self._prefill = TorchEngine.from_dir(path, dtype=dtype, device=device)

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        temperature: float,
        max_tokens: int,
        sample_indices: list[int] | None = None,
    ) -> list[Generation]:
        from vllm import SamplingParams

        samples = list(range(len(prompts))) if sample_indices is None else sample_indices
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                stop_token_ids=[self.info.eos_id],
                detokenize=False,
                extra_args={EXTRA: [seed, sample, float(temperature)]},
            )
            for seed, sample in zip(seeds, samples, strict=True)
        ]
        requests = [{"prompt_token_ids": p} for p in prompts]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        # One batched prefill on the same GPU gives the hidden states the validator recomputes.
        states = self._prefill.prefill_stream(list(zip(prompts, tokens, strict=True)))
        results = []
        for toks, st in zip(tokens, states, strict=True):
            finish: FinishReason = "stop" if toks and toks[-1] == self.info.eos_id else "length"
            results.append(Generation(toks, finish, st.hidden))
        return results

    def prefill(self, prompt: list[int], tokens: list[int]) -> Prefill:
        return self._prefill.prefill(prompt, tokens)

    def prefill_batch(self, items: list[tuple[list[int], list[int]]]) -> list[Prefill]:
        return self._prefill.prefill_batch(items)

    def prefill_stream(self, items: list[tuple[list[int], list[int]]]) -> Iterator[PrefillStates]:
        return self._prefill.prefill_stream(items)

    def load_weights(self, path: str) -> None:
        from safetensors.torch import load_file

        state = load_file(path)
        self.llm.apply_model(lambda model: model.load_weights(state.items()))
        self._prefill.load_weights(path)
