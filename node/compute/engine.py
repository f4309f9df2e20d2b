"""The engine interface: generation with proofs material, and prefill for validators.

Every engine returns hidden states as **bf16 bit patterns** (``numpy.uint16``, shape
``[n_tokens, hidden]``): row ``t`` is the final hidden state, after the last norm, at the position
whose logits produced generated token ``t``. That is what TOPLOC proofs commit to
(:mod:`swarm.toploc`), and what :meth:`Engine.prefill` recomputes for the same positions.

Sampling is the seeded Gumbel-max of :mod:`swarm.sampling`, keyed by (seed, sample index, step).

Besides generation and prefill, an engine owns everything that needs the model's files, so a
node's main process never loads torch, transformers or sympy (contract 1: the engine runs in the
compute child, :mod:`node.compute.child`):

- :meth:`Engine.encode_prompts` and :meth:`Engine.score`: the model's own tokenizer and chat
  template (:class:`node.model.text.ModelText`), and the task verifiers on decoded text.
- :meth:`Engine.verify`: the validator's sampling and TOPLOC checks, run next to the logits,
  chunked over positions (:func:`node.verify.check_claims`), so full-vocabulary logits never
  leave the engine. Engines stream their prefill through :meth:`Engine.prefill_stream`.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from swarm.errors import EngineError
from swarm.sampling import GUMBEL_2

if TYPE_CHECKING:  # numpy only in annotations: the main process never loads it (~20 MiB)
    import numpy as np

    from node.model.text import ModelText
    from node.verify import SampleClaim, SampleVerdict, VerifySettings

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


class PrefillStates:
    """One sample's recomputed states: every position's hidden bits, logits by chunk on demand.

    The default holds a :class:`Prefill`'s full logits; engines with big vocabularies return
    states that apply the LM head to the requested positions only.
    """

    def __init__(self, prefill: Prefill) -> None:
        self._prefill = prefill
        self.hidden = prefill.hidden

    def logits(self, start: int, stop: int) -> Any:
        """float32 [stop - start, vocab]: the rows of positions ``start..stop-1``, a numpy
        array or a torch tensor on the engine's device (the check runs where they are)."""
        return self._prefill.logits[start:stop]


@dataclass(frozen=True)
class ScoreItem:
    """One completion to score: its tokens and its task's answer, verifier and target length."""

    tokens: list[int]
    answer: str
    verifier: str
    target_len: int | None = None
    entry: str = ""
    """The task's item as its library gave it (JSON text), for verifiers that score against
    the whole item (``reasoning-gym``); empty for the others."""


@dataclass(frozen=True)
class EngineInfo:
    vocab_size: int
    hidden_size: int
    eos_id: int
    """The model's first EOS id (what a tokenizer appends); generation stops on any of
    :attr:`stop_ids`."""
    pad_id: int
    dtype: str
    eos_ids: tuple[int, ...] = ()
    """The model's whole stop set (:func:`node.model.loading.model_info`); empty means
    ``(eos_id,)``."""

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends a sample: both engines stop on it, the checks read it."""
        return frozenset(self.eos_ids or (self.eos_id,))


class Engine(abc.ABC):
    """A model that generates and prefills. Methods block; never call them on the event loop.

    From trio use ``await trio.to_thread.run_sync(engine.generate, ...)``; the child-process
    engine (:class:`node.compute.child.ChildEngine`) is safe to call from a worker thread, and
    its ``agenerate``/``aprefill`` helpers do exactly that.
    """

    info: EngineInfo
    text: ModelText | None = None
    """The model's tokenizer (engines that run in this process and loaded it)."""

    @abc.abstractmethod
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
        """Sample one completion per prompt with the run's seeded ``sampler``
        (:mod:`swarm.sampling`); ``sample_indices`` default to ``0..len-1``. A completion ends
        on any id of :attr:`EngineInfo.stop_ids` ("stop") or at ``max_tokens`` ("length")."""

    @abc.abstractmethod
    def prefill(self, prompt: list[int], tokens: list[int]) -> Prefill:
        """Logits and hidden states of the positions that produced ``tokens`` after ``prompt``."""

    def prefill_batch(self, items: list[tuple[list[int], list[int]]]) -> list[Prefill]:
        """:meth:`prefill` for many samples; engines batch it where they can."""
        return [self.prefill(p, t) for p, t in items]

    def prefill_stream(self, items: list[tuple[list[int], list[int]]]) -> Iterator[PrefillStates]:
        """:meth:`prefill_batch` one sample at a time, in order; engines bound the memory."""
        for pre in self.prefill_batch(items):
            yield PrefillStates(pre)

    def _need_text(self) -> ModelText:
        if self.text is None:
            raise EngineError("this engine was made without the model's tokenizer (use from_dir)")
        return self.text

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        """Task prompts as token ids: the model's tokenizer and, if the run says so, template."""
        return self._need_text().encode_prompts(texts)

    def decode(self, tokens: list[int]) -> str:
        """A completion's text up to its first EOS."""
        return self._need_text().decode(tokens)

    def score(self, items: list[ScoreItem], length_coeff: float) -> list[float]:
        """Rewards: the task's verifier on the decoded text minus the length penalty."""
        from node.tasks.rewards import length_penalty
        from node.tasks.verifiers import verify_answer

        text = self._need_text()
        return [
            verify_answer(it.verifier, it.answer, text.decode(it.tokens), it.entry)
            - length_penalty(len(it.tokens), it.target_len, length_coeff)
            for it in items
        ]

    def verify(self, claims: list[SampleClaim], settings: VerifySettings) -> list[SampleVerdict]:
        """The validator's checks, next to the logits (:func:`node.verify.check_claims`)."""
        from node.verify import check_claims

        return check_claims(self, claims, settings)

    @abc.abstractmethod
    def load_weights(self, path: str) -> None:
        """Load a new policy version from a safetensors file."""

    def close(self) -> None:  # noqa: B027 - optional hook, most engines hold nothing to free
        """Release the model (and the child process, if any)."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
