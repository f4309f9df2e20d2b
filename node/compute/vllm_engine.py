"""The ``vllm`` engine (GPU, optional extra ``gpu``): generation through vllm with proofs.

vllm is imported inside :class:`VllmEngine` only; without it the constructor raises
:class:`EngineError` naming the extra to install. Two hooks make vllm produce what proofs and
validators need:

* hidden states: a forward hook on the model's final norm records its output. Requests run one
  at a time (vllm batches their tokens internally), so the prefill pass yields
  ``[prompt_len, d]`` (its last row produced token 0) and each decode step yields ``[1, d]``.
* sampling: a per-request logits processor computes the seeded Gumbel-max choice of
  :mod:`swarm.sampling` on the CPU from vllm's logits and masks every other token, and vllm runs
  greedily, so tokens are exactly those the torch engine's validator checks.

Prefill for validators stays on the torch engine (design: "prefill checks stay on the torch
engine"); :meth:`VllmEngine.prefill` delegates to a lazily built :class:`TorchEngine`.
Tested only on a GPU machine (``bench/gpu_check.py``, tests marked ``gpu``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from node.compute.engine import Engine, EngineInfo, FinishReason, Generation, Prefill
from node.model.loading import model_info
from swarm.errors import EngineError
from swarm.sampling import sampling_scores


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _find_final_norm(model: Any) -> Any:
    for path in ("model.norm", "model.final_layernorm", "transformer.ln_f"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise EngineError("cannot find the final norm of the vllm model to hook hidden states")


class VllmEngine(Engine):
    def __init__(self, path: str, *, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.5):
        try:
            from vllm import LLM
        except ImportError as exc:
            raise EngineError(
                "the vllm engine needs the optional extra: pip install 'swarm-node[gpu]'"
            ) from exc
        info = model_info(path)
        self.path = path
        self.info = EngineInfo(info.vocab_size, info.hidden_size, info.eos_id, info.pad_id, dtype)
        self.llm = LLM(
            model=path,
            dtype=dtype,
            enforce_eager=True,
            gpu_memory_utilization=gpu_memory_utilization,
            skip_tokenizer_init=True,
        )
        self._captured: list[Any] = []
        model = self._model()
        _find_final_norm(model).register_forward_hook(self._hook)
        self._torch: Any = None

    def _model(self) -> Any:
        engine = self.llm.llm_engine
        try:
            return engine.model_executor.driver_worker.model_runner.model
        except AttributeError as exc:
            raise EngineError(
                "this vllm version hides its model; use vllm 0.6-0.8 (V0 engine, "
                "VLLM_USE_V1=0) for hidden-state capture"
            ) from exc

    def _hook(self, _module: Any, _inputs: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        self._captured.append(out.detach())

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        temperature: float,
        max_tokens: int,
        sample_indices: list[int] | None = None,
    ) -> list[Generation]:
        import torch
        from vllm import SamplingParams

        samples = list(range(len(prompts))) if sample_indices is None else sample_indices
        results = []
        for prompt, seed, sample in zip(prompts, seeds, samples, strict=True):

            def choose(
                token_ids: list[int], logits: Any, seed: int = seed, sample: int = sample
            ) -> Any:
                step = len(token_ids)
                scores = sampling_scores(logits.float().cpu(), seed, sample, step, temperature)
                keep = int(np.argmax(scores))
                masked = torch.full_like(logits, float("-inf"))
                masked[keep] = 0.0
                return masked

            params = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                logits_processors=[choose],
                stop_token_ids=[self.info.eos_id],
                ignore_eos=False,
                detokenize=False,
            )
            self._captured.clear()
            out = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[
                0
            ].outputs[0]
            tokens = list(out.token_ids)
            rows = [self._captured[0][-1]] + [c[-1] for c in self._captured[1:]]
            hidden = torch.stack(rows[: len(tokens)]).to(torch.bfloat16).cpu()
            bits = hidden.contiguous().view(torch.int16).numpy().view(np.uint16)
            finish: FinishReason = "stop" if tokens and tokens[-1] == self.info.eos_id else "length"
            results.append(Generation(tokens, finish, bits))
        return results

    def _prefill_engine(self) -> Any:
        if self._torch is None:
            from node.compute.torch_engine import TorchEngine

            self._torch = TorchEngine.from_dir(self.path, dtype="float32", device="cuda")
        return self._torch

    def prefill(self, prompt: list[int], tokens: list[int]) -> Prefill:
        result: Prefill = self._prefill_engine().prefill(prompt, tokens)
        return result

    def load_weights(self, path: str) -> None:
        from safetensors.torch import load_file

        state = load_file(path)
        self._model().load_weights(state.items())
        if self._torch is not None:
            self._torch.load_weights(path)
