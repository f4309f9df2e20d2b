"""The seeded Gumbel-max choice over a whole vllm batch, without vllm (so it is testable here).

:class:`node.compute.vllm_engine` wraps :class:`SeededBatch` in vllm's batch-level
``LogitsProcessor``; everything that decides a token lives here. Decisions:

- A request is ours when its ``SamplingParams.extra_args`` carry :data:`EXTRA`:
  ``[seed, sample index, temperature, sampler]`` (:class:`SeededSpec`). Rows without it are
  left exactly as vllm gave them.
- State follows vllm's persistent batch (:meth:`SeededBatch.update`: removed, then added, then
  moved, the order ``BatchUpdate`` prescribes). Each change rebuilds, once per change and not
  once per step, the device tensors of the seeded rows: row indices and gumbel-2 request keys
  (:func:`swarm.sampling.request_key`, computed once per sample), grouped by (sampler,
  temperature) (:class:`SeededGroup`); the host-to-device copies are asynchronous from pinned
  memory where vllm says pinning works.
- A row's step is the length of the request's output token list, which vllm hands over by
  reference and extends every step (under async scheduling with ``-1`` placeholders, whose
  count is still right; only the length is read).
- :meth:`SeededBatch.apply` makes one call per group over the batch (one group in practice:
  one ``generate`` call has one temperature and sampler): gumbel-2 noise
  (:func:`swarm.sampling.gumbel2_noise`) on the logits' device, ``logits / T + g`` the way
  :func:`swarm.sampling.seeded_scores` computes it (the same float32 operations, so the same
  bits as the torch engine on that device), argmax, then every entry of the row but the chosen
  one set to ``-inf`` and the chosen one to 0, so vllm's greedy pick (``temperature=0``) takes
  it. The only host-to-device traffic per step is the steps vector; nothing is read back, so a
  step costs the GPU no synchronisation (the old per-request adapter copied each row to the
  CPU: one sync per row per step).
- ``gumbel-1`` rows (runs created before issue 24) take the CPU path of that sampler: the
  group's rows are copied to the host once per step (one sync per step, not per row).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.errors import ConfigError, EngineError
from swarm.sampling import (
    GUMBEL_1,
    GUMBEL_2,
    check_sampler,
    gumbel2_noise,
    request_key,
    seeded_scores,
)

EXTRA = "swarm_gumbel"
"""Key of ``SamplingParams.extra_args`` that carries ``[seed, sample, temperature, sampler]``."""


@dataclass(frozen=True)
class SeededSpec:
    """What one request asks of the sampler."""

    seed: int
    sample: int
    temperature: float
    sampler: str = GUMBEL_2

    def to_extra_args(self) -> dict[str, Any]:
        return {EXTRA: [self.seed, self.sample, self.temperature, self.sampler]}

    @classmethod
    def from_extra_args(cls, extra: Mapping[str, Any] | None) -> SeededSpec | None:
        """The spec in ``extra_args``, None when the request is not ours; ``ValueError`` (what
        vllm's ``validate_params`` expects) when it is ours but malformed."""
        spec = (extra or {}).get(EXTRA)
        if spec is None:
            return None
        try:
            seed, sample, temperature, sampler = spec
            out = cls(int(seed), int(sample), float(temperature), check_sampler(str(sampler)))
        except (TypeError, ValueError, ConfigError) as exc:
            raise ValueError(f"malformed {EXTRA} extra_args {spec!r}: {exc}") from exc
        if not (0 <= out.seed < 1 << 64 and 0 <= out.sample < 1 << 64) or out.temperature < 0:
            raise ValueError(f"{EXTRA}: seed and sample must lie in [0, 2**64), T >= 0: {spec!r}")
        return out


@dataclass(frozen=True)
class SeededGroup:
    """The rows of a batch that share one sampler and temperature, ready on the device."""

    sampler: str
    temperature: float
    slots: tuple[int, ...]
    """Row indices in the batch, in the order of the tensors below (host copy)."""
    rows: torch.Tensor
    """int64 [R] row indices, on the logits' device."""
    keys: torch.Tensor
    """int64 [R, 2] gumbel-2 request keys ``(s0, s1)`` on the device (unused for gumbel-1)."""
    seeds: tuple[int, ...]
    samples: tuple[int, ...]


def seeded_choice(logits: torch.Tensor, group: SeededGroup, steps: torch.Tensor) -> torch.Tensor:
    """The seeded Gumbel-max token of every row of ``group``: int64 [R] on the logits' device.

    ``steps`` (int64 [R]; on the logits' device for gumbel-2, on the host for gumbel-1) is each
    row's step. For gumbel-2 this is one pass on the device that reads nothing back, and it
    computes what :func:`swarm.sampling.seeded_scores` computes row by row.
    """
    sub = logits.index_select(0, group.rows)
    if group.temperature == 0:
        return sub.to(torch.float32 if group.sampler == GUMBEL_2 else torch.float64).argmax(1)
    if group.sampler == GUMBEL_2:
        noise = gumbel2_noise(group.keys, steps, logits.shape[1])
        # ``sub`` is a fresh copy: dividing in place is ``torch.div(rows, T)`` of seeded_scores.
        return sub.to(torch.float32).div_(group.temperature).add_(noise).argmax(1)
    host = seeded_scores(
        sub.to("cpu"), group.seeds, group.samples, steps.to("cpu"), group.temperature,
        sampler=GUMBEL_1,
    )  # fmt: skip
    return host.argmax(1).to(logits.device, non_blocking=True)


def keep_only(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Set every entry of ``rows`` to ``-inf`` but ``tokens`` (one per row), which become 0."""
    logits.index_fill_(0, rows, float("-inf"))
    logits.index_put_((rows, tokens), torch.zeros((), dtype=logits.dtype, device=logits.device))
    return logits


@dataclass
class _Request:
    spec: SeededSpec
    output_ids: Sequence[int]
    """vllm's running list of the request's output tokens (a reference: it grows)."""


class SeededBatch:
    """vllm's persistent batch as the seeded sampler sees it; no vllm needed.

    :meth:`update` takes what vllm's ``BatchUpdate`` says, :meth:`apply` the batch's logits.
    """

    def __init__(self, device: torch.device | str, *, pin_memory: bool = False) -> None:
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.requests: dict[int, _Request] = {}
        self.groups: list[SeededGroup] = []

    def update(
        self,
        removed: Sequence[int] = (),
        added: Sequence[tuple[int, SeededSpec | None, Sequence[int]]] = (),
        moved: Sequence[tuple[int, int, bool]] = (),
    ) -> None:
        """Follow one batch change: ``removed`` slots, then ``added`` ``(slot, spec or None,
        output ids)`` (an add replaces whatever held the slot), then ``moved`` ``(a, b,
        swap)``: a swap exchanges a and b, a one-way move puts a's request at b and empties a."""
        changed = False
        for slot in removed:
            changed |= self.requests.pop(slot, None) is not None
        for slot, spec, output_ids in added:
            old = self.requests.pop(slot, None)
            if spec is not None:
                self.requests[slot] = _Request(spec, output_ids)
            changed |= spec is not None or old is not None
        for a, b, swap in moved:
            ra, rb = self.requests.pop(a, None), self.requests.pop(b, None)
            if ra is not None:
                self.requests[b] = ra
            if swap and rb is not None:
                self.requests[a] = rb
            changed |= ra is not None or rb is not None
        if changed:
            self._rebuild()

    def follow(self, batch_update: Any, swap: Any) -> None:
        """:meth:`update` from a vllm ``BatchUpdate`` (read by its fields ``removed``, ``added``
        of ``(index, params, prompt ids, output ids)`` and ``moved`` of ``(a, b,
        directionality)``); ``swap`` is vllm's ``MoveDirectionality.SWAP``. None: no change."""
        if batch_update is None:
            return
        added = [
            (a[0], SeededSpec.from_extra_args(getattr(a[1], "extra_args", None)), a[-1])
            for a in batch_update.added
        ]
        moved = [(a, b, d == swap) for a, b, d in batch_update.moved]
        self.update(batch_update.removed, added, moved)

    def _to_device(self, data: list[Any], dtype: torch.dtype) -> torch.Tensor:
        pin = self.pin_memory and self.device.type == "cuda"
        host = torch.tensor(data, dtype=dtype, pin_memory=pin)
        return host.to(self.device, non_blocking=pin)

    def _rebuild(self) -> None:
        by_kind: dict[tuple[str, float], list[int]] = {}
        for slot in sorted(self.requests):
            spec = self.requests[slot].spec
            by_kind.setdefault((spec.sampler, spec.temperature), []).append(slot)
        groups = []
        for (sampler, temperature), slots in by_kind.items():
            specs = [self.requests[s].spec for s in slots]
            keys = [request_key(p.seed, p.sample) if sampler == GUMBEL_2 else (0, 0) for p in specs]
            groups.append(
                SeededGroup(
                    sampler,
                    temperature,
                    tuple(slots),
                    self._to_device(slots, torch.int64),
                    self._to_device(keys, torch.int64).reshape(-1, 2),
                    tuple(p.seed for p in specs),
                    tuple(p.sample for p in specs),
                )
            )
        self.groups = groups

    def steps(self, group: SeededGroup) -> torch.Tensor:
        """Each row's step (its output length so far), int64 [R]: on the device for gumbel-2,
        on the host for gumbel-1 (whose noise is drawn there)."""
        lengths = [len(self.requests[s].output_ids) for s in group.slots]
        if group.sampler == GUMBEL_1:
            return torch.tensor(lengths, dtype=torch.int64)
        return self._to_device(lengths, torch.int64)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask the seeded rows of ``logits`` [batch, vocab] to their seeded choice, in place."""
        if not self.groups:
            return logits
        if max(self.requests) >= logits.shape[0]:
            raise EngineError(
                f"seeded row {max(self.requests)} outside a batch of {logits.shape[0]} logits rows"
            )
        for group in self.groups:
            tokens = seeded_choice(logits, group, self.steps(group))
            keep_only(logits, group.rows, tokens)
        return logits
