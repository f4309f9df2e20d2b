"""Asynchronous GRPO with the INTELLECT-2 recipe, on a transformers causal LM (CPU or GPU).

Per group of G samples of one prompt: advantage ``(r - mean) / (std + 1e-6)``; groups whose
advantages are all zero carry no signal and are dropped (the online filter). The loss is
token-level, summed over every completion token and divided by a fixed ``samples * max_tokens``
(so long and short completions weigh the same per token), with two-sided clipping::

    ratio = exp(logp_new - logp_old)
    loss_t = -min(min(ratio, delta) * A, clip(ratio, 1 - eps, 1 + eps) * A)

``delta`` caps the ratio where plain PPO clipping does not (negative advantages, ratio >> 1),
which INTELLECT-2 found necessary for stability. An entropy bonus is subtracted, KL is off by
default, and the gradient norm is clipped. ``logp_old`` is recomputed by the trainer with the
weights of the version that generated each sample (kept for the async window), never taken from
a worker.

Precision: the trainer keeps float32 master weights, its optimizer and the held versions in
float32; each version is *served* (published, run by workers) in the run's ``serve_dtype``
(:func:`served_weights`). ``logp_old`` of an older version's samples is recomputed with that
version as served, its held float32 snapshot rounded through ``serve_dtype`` on the device
(what generated them; the pass runs anyway, the rounding costs nothing). Samples of the current
version keep the current masters' own detached ``logp``, not a pass with the rounded weights:
measured on the embedded default model (demo parameters, bfloat16, versions 10-90 of the
in-process loop; docs/BENCHMARKS.md, "Serving dtype"), the masters and their bf16 rounding
differ by 0.0013 in a completion token's log-probability on average (largest 0.09; at most 0.5%
of a batch's tokens have a ratio off by more than 5%, none by the clip's 20%), while that extra
no-grad pass would add 0.05 s to a 0.18 s step (+28%).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.compute.groups import CollapseGuard, Group, StepStats
from node.model.loading import torch_dtype
from swarm.errors import ConfigError, StorageError
from swarm.messages import RunParams


@dataclass(frozen=True)
class GRPOConfig:
    learning_rate: float = 1e-4
    clip_epsilon: float = 0.2
    clip_delta: float = 4.0
    entropy_coef: float = 0.001
    kl_coef: float = 0.0
    max_grad_norm: float = 0.1
    max_tokens: int = 32

    @classmethod
    def from_params(cls, params: RunParams) -> GRPOConfig:
        return cls(
            learning_rate=params.learning_rate,
            clip_epsilon=params.clip_epsilon,
            clip_delta=params.clip_delta,
            entropy_coef=params.entropy_coef,
            kl_coef=params.kl_coef,
            max_grad_norm=params.max_grad_norm,
            max_tokens=params.max_tokens,
        )


GradientAverager = Callable[[list[torch.Tensor], int], int]
"""``average(grads, samples) -> group_samples``: replaces each local gradient in place by the
group's sample-weighted mean and answers how many samples the whole group trained on (0: no
step anywhere). Several trainers plug hivemind in here (``node.compute.averaging``)."""


def served_weights(weights: dict[str, torch.Tensor], serve_dtype: str) -> dict[str, torch.Tensor]:
    """``weights`` as a version is published for inference: every floating tensor cast to
    ``serve_dtype`` (round to nearest even; float32: the tensors themselves, no copy)."""
    dtype = torch_dtype(serve_dtype)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """``(r - mean) / (std + 1e-6)`` with the population std, as GRPO defines it."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + 1e-6) for r in rewards]


class GRPOTrainer:
    """Owns the policy being trained, its optimizer, and the weights of recent versions.

    ``step(groups)`` makes one optimizer step and advances ``version`` by one. Weights of the last
    ``keep_versions`` versions stay in memory (on the CPU) to recompute ``logp_old`` of samples
    made by them; samples of older versions are refused (``ConfigError``): the caller filters
    them by the async window first. ``serve_dtype``: the precision versions are served in;
    ``logp_old`` is recomputed with the held weights rounded through it (module docstring).
    """

    def __init__(
        self,
        model: Any,
        config: GRPOConfig,
        *,
        version: int = 0,
        keep_versions: int = 3,
        pad_id: int = 0,
        serve_dtype: str = "float32",
    ) -> None:
        torch_dtype(serve_dtype)  # checked now, not at the first replay
        self.model = model.train()
        self.config = config
        self.serve_dtype = serve_dtype
        self.version = version
        self.keep_versions = max(1, keep_versions)
        self.pad_id = pad_id
        self.optimizer = self._new_optimizer()
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {version: self._cpu_state()}
        self._undo_window: dict[int, dict[str, torch.Tensor]] = {}
        """The snapshots the last step moved out of the window, given back by ``undo``."""
        self._old_model: Any = None

    def _new_optimizer(self) -> torch.optim.AdamW:
        # weight_decay=0 explicitly: AdamW's default (0.01) is not part of the recipe.
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=self.config.learning_rate,
            betas=(0.9, 0.99),
            weight_decay=0.0,
        )

    def _cpu_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    @property
    def held_versions(self) -> list[int]:
        """Versions whose weights are kept to recompute ``logp_old``."""
        return sorted(self._snapshots)

    def weights(self) -> dict[str, torch.Tensor]:
        """The current policy's weights (CPU copies), e.g. for ``safetensors.torch.save_file``."""
        return self._snapshots[self.version]

    def _batch(self, prompts: list[list[int]], completions: list[list[int]]) -> tuple[Any, ...]:
        device = next(self.model.parameters()).device
        rows = [p + c for p, c in zip(prompts, completions, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        targets = torch.zeros((len(rows), width - 1), dtype=torch.bool)
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            attention[i, : len(p) + len(c)] = 1
            # logits at position k predict token k + 1: completion tokens are k + 1 >= len(p).
            targets[i, len(p) - 1 : len(p) + len(c) - 1] = True
        return ids.to(device), attention.to(device), targets.to(device)

    def _logprobs(self, model: Any, ids: Any, attention: Any) -> tuple[Any, Any]:
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def _old_logprobs(self, version: int, ids: Any, attention: Any) -> Any:
        if version not in self._snapshots:
            raise ConfigError(
                f"samples of version {version} are outside the trainer's window"
                f" (holds {sorted(self._snapshots)})"
            )
        if self._old_model is None:
            self._old_model = copy.deepcopy(self.model).eval()
        self._old_model.load_state_dict(self._snapshots[version])
        with torch.no_grad():
            if self.serve_dtype != "float32":  # the weights as served, rounded on the device
                dtype = torch_dtype(self.serve_dtype)
                for t in self._old_model.state_dict().values():
                    if t.is_floating_point():
                        t.copy_(t.to(dtype))
            return self._logprobs(self._old_model, ids, attention)[0]

    def step(
        self,
        groups: Sequence[Group],
        average: GradientAverager | None = None,
        *,
        norm_samples: int | None = None,
        grad_scale: float = 1.0,
    ) -> StepStats:
        """One optimizer step on ``groups``; returns what happened. Always advances the version
        (a batch with no signal leaves the weights unchanged but is still a step).

        Data-parallel ranks (``node.compute.fsdp``) pass ``norm_samples`` (the kept samples of
        all ranks) and ``grad_scale`` (the world size, since FSDP averages gradients), so the
        ranks' step equals one process's step on the whole batch.

        With ``average`` (several trainers), the gradient is computed even when no group here
        has signal (zeros, weight 0), replaced by the group's average before clipping, and the
        optimizer steps when the group as a whole had samples."""
        cfg = self.config
        rewards = [r for g in groups for r in g.rewards]
        kept = [g for g in groups if g.signal]
        stats: dict[str, float] = {"loss": 0.0, "grad_norm": 0.0, "clip": 0.0, "entropy": 0.0}
        samples = sum(len(g.completions) for g in kept)
        tokens = 0
        if average is not None and not kept:
            self.optimizer.zero_grad(set_to_none=False)
            grads = self._grads()
            for grad in grads:
                grad.zero_()
            if average(grads, 0) > 0:
                stats["grad_norm"] = float(
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                )
                self.optimizer.step()
        if kept:
            self.optimizer.zero_grad(set_to_none=True)
            ids, attention, mask = self._batch(
                [g.prompt for g in kept for _ in g.completions],
                [c for g in kept for c in g.completions],
            )
            advantages = torch.tensor(
                [a for g in kept for a in group_advantages(g.rewards)], device=ids.device
            ).unsqueeze(-1)
            logp, entropy = self._logprobs(self.model, ids, attention)
            old = self._old_logprobs_of(kept, ids, attention, logp)
            ratio = torch.exp(logp - old)
            surrogate = torch.minimum(
                torch.clamp(ratio, max=cfg.clip_delta) * advantages,
                torch.clamp(ratio, 1 - cfg.clip_epsilon, 1 + cfg.clip_epsilon) * advantages,
            )
            norm = (norm_samples or samples) * cfg.max_tokens
            maskf = mask.float()
            loss = -(surrogate * maskf).sum() / norm
            mean_entropy = (entropy * maskf).sum() / norm
            loss = loss - cfg.entropy_coef * mean_entropy
            (loss * grad_scale).backward()
            if average is not None:
                average(self._grads(), samples)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            tokens = int(mask.sum())
            clipped = ((ratio - 1).abs() > cfg.clip_epsilon) & mask
            stats = {
                "loss": float(loss.detach()),
                "grad_norm": float(grad_norm),
                "clip": float(clipped.sum()) / max(tokens, 1),
                "entropy": float((entropy * maskf).sum().detach()) / max(tokens, 1),
            }
        self.version += 1
        self._snapshots[self.version] = self._cpu_state()
        # Kept aside, not dropped: a step whose round is void is undone, and the version it
        # stepped from needs its whole window again (the same samples are trained once more).
        self._undo_window = {
            v: self._snapshots.pop(v) for v in sorted(self._snapshots)[: -self.keep_versions]
        }
        return StepStats(
            version=self.version,
            sampled_by=max((g.version for g in groups), default=self.version - 1),
            mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
            kept_groups=len(kept),
            total_groups=len(groups),
            samples=samples,
            tokens=tokens,
            loss=stats["loss"],
            grad_norm=stats["grad_norm"],
            clip_fraction=stats["clip"],
            entropy=stats["entropy"],
        )

    def _versions_to_replay(self, versions: set[int]) -> list[int]:
        """The older versions whose weights recompute ``logp_old`` in this step, in order.
        Data-parallel ranks (``node.compute.fsdp``) answer the same list on every rank: each
        version's forward pass is a collective there."""
        return sorted(versions - {self.version})

    def _old_logprobs_of(
        self, kept: Sequence[Group], ids: Any, attention: Any, logp: Any
    ) -> torch.Tensor:
        """``logp_old`` of every row: the current policy's own (detached) for samples it made,
        one forward pass per older version for the others."""
        old: torch.Tensor = logp.detach().clone()
        rows_of: dict[int, list[int]] = {}
        row = 0
        for g in kept:
            rows_of.setdefault(g.version, []).extend(range(row, row + len(g.completions)))
            row += len(g.completions)
        for version in self._versions_to_replay(set(rows_of)):
            # A rank with no sample of this version still runs the pass (on row 0, dropped).
            rows = rows_of.get(version) or [0]
            got = self._old_logprobs(version, ids[rows], attention[rows])
            if version in rows_of:
                old[rows] = got
        return old

    def _grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient tensor (allocated as zeros where backward left none)."""
        out = []
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Continue from another trainer's copy of ``version`` (the canonical, published one);
        the optimizer's state is kept (it saw the same averaged gradients). A copy in a lower
        precision (bfloat16) is upcast to the float32 masters (``load_state_dict`` copies into
        the float32 parameters); the training child first keeps the masters' own float32 values
        where they round to the copy's (``node.compute.train_child.keep_masters``)."""
        self._restore(version, weights)

    def undo(self, version: int) -> None:
        """Back to the held weights of ``version``, forgetting the current (newer) version: a
        step whose averaging round was void."""
        self.forget(self.version)
        self._snapshots.update(self._undo_window)  # what the undone step moved out
        self._undo_window = {}
        self._restore(version, dict(self._snapshots[version]))

    def _restore(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(weights)
        self.version = version
        self._snapshots[version] = self._cpu_state()
        for old_version in sorted(self._snapshots)[: -self.keep_versions]:
            del self._snapshots[old_version]

    def relabel(self, version: int) -> None:
        """Call the current weights ``version`` (newer than ours): a trainer whose round's
        published copy was lost republishes its own copy under a new number."""
        self.version = version
        self._snapshots[version] = self._cpu_state()
        for old_version in sorted(self._snapshots)[: -self.keep_versions]:
            del self._snapshots[old_version]

    def forget(self, version: int) -> None:
        """Drop the held weights of ``version`` (a step that was undone)."""
        self._snapshots.pop(version, None)

    def rollback(self, version: int) -> int:
        """Continue from the weights of ``version`` as a *new* version: versions only move
        forward on the network. The optimizer restarts. When ``version`` has already left the
        window, the oldest version still held (the nearest to it) is used; returns the version
        whose weights were taken."""
        if version not in self._snapshots:
            later = [v for v in self._snapshots if v > version]
            if not later:
                held = sorted(self._snapshots)
                raise ConfigError(f"version {version} is no longer held; holds {held}")
            version = min(later)
        self.model.load_state_dict(self._snapshots[version])
        self.optimizer = self._new_optimizer()
        self.version += 1
        self._snapshots[self.version] = self._cpu_state()
        return version

    def save_checkpoint(self, path: Path) -> None:
        """Model, optimizer and version, written atomically (tmp file + rename)."""
        self._save(
            path,
            {
                "version": self.version,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "snapshots": self._snapshots,
            },
        )

    @staticmethod
    def _save(path: Path, state: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        try:
            torch.save(state, tmp)
            tmp.replace(path)
        except OSError as exc:
            raise StorageError(f"cannot write trainer checkpoint {path}: {exc.strerror}") from exc

    def load_checkpoint(self, path: Path) -> None:
        state = self._read(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self._snapshots = dict(state["snapshots"])

    @staticmethod
    def _read(path: Path, *, mmap: bool = False) -> dict[str, Any]:
        try:
            state: dict[str, Any] = torch.load(
                path, map_location="cpu", weights_only=True, mmap=mmap
            )
        except (OSError, RuntimeError, ValueError) as exc:
            raise StorageError(f"cannot read trainer checkpoint {path}: {exc}") from exc
        return state


__all__ = [
    "CollapseGuard",
    "GRPOConfig",
    "GRPOTrainer",
    "Group",
    "StepStats",
    "group_advantages",
    "served_weights",
]
