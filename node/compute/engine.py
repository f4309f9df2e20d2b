"""The engine interface: generation with proofs material, and prefill for validators.

Every engine returns hidden states as **bf16 bit patterns** (``numpy.uint16``, shape
``[n_tokens, hidden]``): row ``t`` is the final hidden state, after the last norm, at the position
whose logits produced generated token ``t``. That is what TOPLOC proofs commit to
(:mod:`swarm.toploc`), and what :meth:`Engine.prefill` recomputes for the same positions.

Sampling is the seeded Gumbel-max of :mod:`swarm.sampling`, keyed by (seed, sample index, step).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Generation:
    """One generated sample."""

    tokens: list[int]
    finish_reason: FinishReason
    hidden: np.ndarray
    """uint16 bf16 bit patterns, [len(tokens), hidden_size]."""


@dataclass(frozen=True)
class Prefill:
    """What a validator recomputes for (prompt, tokens)."""

    logits: np.ndarray
    """float32 [len(tokens), vocab]: row t is the distribution that produced tokens[t]."""
    hidden: np.ndarray
    """uint16 bf16 bit patterns [len(tokens), hidden_size], the same positions as ``logits``."""


@dataclass(frozen=True)
class EngineInfo:
    vocab_size: int
    hidden_size: int
    eos_id: int
    pad_id: int
    dtype: str


class Engine(abc.ABC):
    """A model that generates and prefills. Methods block; never call them on the event loop.

    From trio use ``await trio.to_thread.run_sync(engine.generate, ...)``; the child-process
    engine (:class:`node.compute.child.ChildEngine`) is safe to call from a worker thread, and
    its ``agenerate``/``aprefill`` helpers do exactly that.
    """

    info: EngineInfo

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        temperature: float,
        max_tokens: int,
        sample_indices: list[int] | None = None,
    ) -> list[Generation]:
        """Sample one completion per prompt; ``sample_indices`` default to ``0..len-1``."""

    @abc.abstractmethod
    def prefill(self, prompt: list[int], tokens: list[int]) -> Prefill:
        """Logits and hidden states of the positions that produced ``tokens`` after ``prompt``."""

    def prefill_batch(self, items: list[tuple[list[int], list[int]]]) -> list[Prefill]:
        """:meth:`prefill` for many samples; engines batch it where they can."""
        return [self.prefill(p, t) for p, t in items]

    @abc.abstractmethod
    def load_weights(self, path: str) -> None:
        """Load a new policy version from a safetensors file."""

    def close(self) -> None:  # noqa: B027 - optional hook, most engines hold nothing to free
        """Release the model (and the child process, if any)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
