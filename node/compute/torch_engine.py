"""The ``torch`` engine: transformers causal LMs on CPU or GPU, batched, with a KV cache.

Generation left-pads the batch (attention mask plus explicit position ids, so padding changes
nothing), runs the decoder body to get the post-norm hidden states (``last_hidden_state`` of a
transformers decoder is after the final norm), applies the LM head itself, and picks each step's
tokens where the logits are with the run's seeded sampler (:class:`swarm.sampling.SeededRows`:
gumbel-2 noise is drawn on the device for the whole batch; only gumbel-1, the sampler of old runs,
copies logits to the CPU). A row stops on any id of the model's stop set
(:attr:`EngineInfo.stop_ids <node.compute.engine.EngineInfo.stop_ids>`). Prefill runs prompt +
tokens[:-1] in one pass.

Devices and precision: the model runs on ``device`` (``cpu``, ``cuda``, ``cuda:N``) in
``dtype`` (float32 or bfloat16); on CUDA the whole batch of a submission decodes together with the
KV cache on the GPU; what comes to the host each step is the batch's token ids (one small copy,
for the stop check), and the hidden states of the proofs once, at the end. Validator prefills
stream (:meth:`TorchEngine.prefill_stream`) in micro-batches of at most :data:`PREFILL_TOKENS`
tokens and keep each sample's post-norm hidden states on the device; the LM head runs on the
chunk of positions the sampling check asks for, and the logits stay on the device for it, so
full-vocabulary logits of a whole sample never exist at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from node.compute.engine import (
    Engine,
    EngineInfo,
    FinishReason,
    Generation,
    Prefill,
    PrefillStates,
)
from node.model.loading import load_causal_lm, load_weights_into, model_info
from node.model.text import ModelText
from swarm.errors import ConfigError, EngineError
from swarm.sampling import GUMBEL_2, SeededRows


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """bf16 bit patterns (uint16 numpy) of a float tensor, rounding to nearest even."""
    return (
        t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    )


PREFILL_TOKENS = 8192
"""Tokens (padded) per validator prefill forward; bounds the activations of one micro-batch."""


class _HeadStates(PrefillStates):
    """A sample's post-norm hidden states on the device; logits by chunk through the LM head."""

    def __init__(self, head: Any, hs: Any) -> None:
        self._head = head
        self._hs = hs
        self.hidden = bf16_bits(hs)

    def logits(self, start: int, stop: int) -> Any:
        """float32 logits of positions ``start..stop-1`` as a tensor on the model's device."""
        with torch.inference_mode():
            return self._head(self._hs[start:stop]).float()


class TorchEngine(Engine):
    """A transformers causal LM run in this process."""

    def __init__(
        self,
        model: Any,
        *,
        eos_id: int,
        pad_id: int,
        dtype: str = "float32",
        device: str = "cpu",
        text: ModelText | None = None,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        self.model = model.eval()
        self.device = device
        self.text = text
        cfg = model.config
        self.info = EngineInfo(
            int(cfg.vocab_size), int(cfg.hidden_size), eos_id, pad_id, dtype, tuple(eos_ids)
        )
        self._stops = torch.tensor(sorted(self.info.stop_ids), device=device)
        self._body = model.get_decoder()
        self._head = model.get_output_embeddings()
        params = inspect.signature(self._body.forward).parameters
        # transformers >= 5.x renamed ``past_key_values`` to ``cache``.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        chat_template: bool = False,
    ) -> TorchEngine:
        """The model of a local directory with its own tokenizer (and chat template if asked)."""
        info = model_info(path)
        text = ModelText(path, chat_template=chat_template)
        model = load_causal_lm(path, dtype=dtype, device=device)
        return cls(
            model,
            eos_id=info.eos_id,
            pad_id=info.pad_id,
            dtype=dtype,
            device=device,
            text=text,
            eos_ids=info.eos_ids,
        )

    def load_weights(self, path: str) -> None:
        load_weights_into(self.model, path)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> Any:
        kwargs = {self._cache_arg: cache}
        return self._body(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs
        )

    @torch.inference_mode()
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
        from transformers import DynamicCache

        n = len(prompts)
        samples = list(range(n)) if sample_indices is None else list(sample_indices)
        if len(seeds) != n or len(samples) != n:
            raise ConfigError("generate needs one seed and one sample index per prompt")
        if n == 0:
            return []
        if max_tokens <= 0 or any(len(p) == 0 for p in prompts):
            raise ConfigError("generate needs max_tokens > 0 and non-empty prompts")
        rows = SeededRows(seeds, samples, sampler=sampler, device=self.device)
        width = max(len(p) for p in prompts)
        pad = self.info.pad_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        picked: list[torch.Tensor] = []  # [n] token ids per step, on the device
        states: list[torch.Tensor] = []  # [n, hidden] bf16 per step, on the device
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        try:
            out = self._forward(ids, mask, pos, cache)
            for step in range(max_tokens):
                h = out.last_hidden_state[:, -1]
                nxt = rows.choose(self._head(h), step, temperature)
                picked.append(nxt)
                states.append(h.to(torch.bfloat16))
                done |= torch.isin(nxt, self._stops)
                if step == max_tokens - 1 or bool(done.all()):
                    break
                # finished rows keep decoding; their output is cut at their stop id below
                mask = torch.cat(
                    [mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], 1
                )
                pos = pos[:, -1:] + 1
                out = self._forward(nxt[:, None], mask, pos, cache)
        except RuntimeError as exc:
            raise EngineError(f"generation failed: {exc}") from exc
        tokens = torch.stack(picked, 1).cpu().tolist()
        hidden = bf16_bits(torch.stack(states, 1))  # [n, steps, hidden]
        results = []
        for i in range(n):
            row = tokens[i]
            end = next((t + 1 for t, tok in enumerate(row) if tok in self.info.stop_ids), None)
            keep = len(row) if end is None else end
            finish: FinishReason = "length" if end is None else "stop"
            results.append(Generation(row[:keep], finish, hidden[i, :keep]))
        return results

    def prefill(self, prompt: list[int], tokens: list[int]) -> Prefill:
        return self.prefill_batch([(prompt, tokens)])[0]

    def _body_states(self, items: list[tuple[list[int], list[int]]]) -> list[Any]:
        """Post-norm hidden states of the positions that produced each sample's tokens."""
        seqs = [p + t[:-1] if t else p for p, t in items]
        width = max(len(s) for s in seqs)
        pad = self.info.pad_id
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=self.device)
        mask = torch.tensor(
            [[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=self.device
        )
        h = self._body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        return [h[row, len(p) - 1 : len(p) - 1 + len(t)] for row, (p, t) in enumerate(items)]

    def prefill_stream(self, items: list[tuple[list[int], list[int]]]) -> Iterator[PrefillStates]:
        if any(len(p) == 0 for p, _ in items):
            raise ConfigError("prefill needs a non-empty prompt")
        start = 0
        while start < len(items):
            stop, width = start, 0
            while stop < len(items):
                width = max(width, len(items[stop][0]) + len(items[stop][1]))
                if stop > start and width * (stop + 1 - start) > PREFILL_TOKENS:
                    break
                stop += 1
            try:
                with torch.inference_mode():
                    states = self._body_states(items[start:stop])
            except RuntimeError as exc:
                raise EngineError(f"prefill failed: {exc}") from exc
            for hs in states:
                yield _HeadStates(self._head, hs)
            start = stop

    @torch.inference_mode()
    def prefill_batch(self, items: list[tuple[list[int], list[int]]]) -> list[Prefill]:
        if not items:
            return []
        if any(len(p) == 0 for p, _ in items):
            raise ConfigError("prefill needs a non-empty prompt")
        try:
            results = [
                Prefill(self._head(hs).float().cpu().numpy(), bf16_bits(hs))
                for hs in self._body_states(items)
            ]
        except RuntimeError as exc:
            raise EngineError(f"prefill failed: {exc}") from exc
        return results
