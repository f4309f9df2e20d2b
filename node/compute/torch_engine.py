"""The ``torch`` engine: transformers causal LMs on CPU or GPU, batched, with a KV cache.

Generation left-pads the batch (attention mask plus explicit position ids, so padding changes
nothing), runs the decoder body to get the post-norm hidden states (``last_hidden_state`` of a
transformers decoder is after the final norm), applies the LM head itself, and samples on the CPU
with :func:`swarm.sampling.sample_tokens`. Prefill runs prompt + tokens[:-1] in one pass.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import torch

from node.compute.engine import Engine, EngineInfo, Generation, Prefill
from node.model.loading import load_causal_lm, load_weights_into, model_info
from swarm.errors import ConfigError, EngineError
from swarm.sampling import sample_tokens


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """bf16 bit patterns (uint16 numpy) of a float tensor, rounding to nearest even."""
    return (
        t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    )


class TorchEngine(Engine):
    """A transformers causal LM run in this process."""

    def __init__(
        self, model: Any, *, eos_id: int, pad_id: int, dtype: str = "float32", device: str = "cpu"
    ) -> None:
        self.model = model.eval()
        self.device = device
        cfg = model.config
        self.info = EngineInfo(int(cfg.vocab_size), int(cfg.hidden_size), eos_id, pad_id, dtype)
        self._body = model.get_decoder()
        self._head = model.get_output_embeddings()
        params = inspect.signature(self._body.forward).parameters
        # transformers >= 5.x renamed ``past_key_values`` to ``cache``.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_dir(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu"
    ) -> TorchEngine:
        info = model_info(path)
        model = load_causal_lm(path, dtype=dtype, device=device)
        return cls(model, eos_id=info.eos_id, pad_id=info.pad_id, dtype=dtype, device=device)

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
        width = max(len(p) for p in prompts)
        pad = self.info.pad_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        tokens: list[list[int]] = [[] for _ in range(n)]
        hidden: list[list[np.ndarray]] = [[] for _ in range(n)]
        done = [False] * n
        try:
            out = self._forward(ids, mask, pos, cache)
            for step in range(max_tokens):
                h = out.last_hidden_state[:, -1]
                logits = self._head(h).float()
                nxt = sample_tokens(logits, seeds, samples, step, temperature)
                h_bits = bf16_bits(h)
                for i in range(n):
                    if done[i]:
                        continue
                    tokens[i].append(nxt[i])
                    hidden[i].append(h_bits[i])
                    if nxt[i] == self.info.eos_id:
                        done[i] = True
                if all(done) or step == max_tokens - 1:
                    break
                feed = nxt  # finished rows keep decoding; their output is ignored
                mask = torch.cat(
                    [mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], 1
                )
                pos = pos[:, -1:] + 1
                out = self._forward(
                    torch.tensor(feed, device=self.device)[:, None], mask, pos, cache
                )
        except RuntimeError as exc:
            raise EngineError(f"generation failed: {exc}") from exc
        d = self.info.hidden_size
        return [
            Generation(
                tokens[i],
                "stop" if tokens[i] and tokens[i][-1] == self.info.eos_id else "length",
                np.stack(hidden[i]) if hidden[i] else np.zeros((0, d), np.uint16),
            )
            for i in range(n)
        ]

    def prefill(self, prompt: list[int], tokens: list[int]) -> Prefill:
        return self.prefill_batch([(prompt, tokens)])[0]

    @torch.inference_mode()
    def prefill_batch(self, items: list[tuple[list[int], list[int]]]) -> list[Prefill]:
        if not items:
            return []
        if any(len(p) == 0 for p, _ in items):
            raise ConfigError("prefill needs a non-empty prompt")
        seqs = [p + t[:-1] if t else p for p, t in items]
        width = max(len(s) for s in seqs)
        pad = self.info.pad_id
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=self.device)
        mask = torch.tensor(
            [[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=self.device
        )
        try:
            h = self._body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            results = []
            for row, (p, t) in enumerate(items):
                hs = h[row, len(p) - 1 : len(p) - 1 + len(t)]
                results.append(Prefill(self._head(hs).float().cpu().numpy(), bf16_bits(hs)))
        except RuntimeError as exc:
            raise EngineError(f"prefill failed: {exc}") from exc
        return results
