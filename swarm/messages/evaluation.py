"""A validator's signed evaluation of one policy version on the run's held-out split.

The genesis names the split (``RunParams.eval_size``: the source's last items, never served for
training) and the cadence (``RunParams.eval_every``: versions 0, K, 2K, ...). Each due version
has one due validator (``eval_validator``: rendezvous hashing over the genesis validators, so
every node computes the same one and a validator's absence moves only its own share). The
validator samples one completion per item with the run's seeded sampler at the seed
``eval_seed`` gives, scores it with the item's own verifier, and signs the scores: any node can
replay an item (``swarm-node audit``) and compare.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from swarm.errors import MalformedError
from swarm.messages._base import Fields, typed

MAX_EVAL_ITEMS = 4096
"""Items one evaluation may score (a genesis may not ask for more: ``RunParams``)."""


def eval_due(version: int, eval_every: int) -> bool:
    """Whether ``version`` is evaluated (0 = evaluation off)."""
    return eval_every > 0 and version >= 0 and version % eval_every == 0


def eval_validator(run_id: str, version: int, validators: Sequence[str]) -> str:
    """The genesis validator due to evaluate ``version`` (rendezvous hashing)."""
    if not validators:
        raise MalformedError("a run without validators has no evaluator")
    return min(
        validators,
        key=lambda v: hashlib.sha256(f"swarm-node/eval/{run_id}/{version}/{v}".encode()).digest(),
    )


def eval_seed(run_id: str, version: int) -> int:
    """The sampling seed of ``version``'s evaluation: fixed by the run and the version, so the
    evaluator cannot pick a lucky one and an auditor replays the same draw."""
    digest = hashlib.sha256(f"swarm-node/eval-seed/{run_id}/{version}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Signed by the due validator: the scores of ``version`` on the held-out items.

    ``scores`` are in millionths (``REWARD_SCALE``, signed payloads hold no floats), one per
    entry of ``item_ids`` in the same order; ``mean`` is their mean, rounded."""

    KIND: ClassVar[str] = "evaluation"
    MAX_BYTES: ClassVar[int] = 64 * 1024

    run_id: str
    version: int
    seed: int
    item_ids: tuple[int, ...]
    scores: tuple[int, ...]
    mean: int
    created_at: int

    def __post_init__(self) -> None:
        if not self.item_ids:
            raise MalformedError("an evaluation scores at least one item")
        if len(self.item_ids) > MAX_EVAL_ITEMS:
            raise MalformedError(f"an evaluation scores at most {MAX_EVAL_ITEMS} items")
        if len(self.scores) != len(self.item_ids):
            raise MalformedError("an evaluation gives one score per item")
        if len(set(self.item_ids)) != len(self.item_ids):
            raise MalformedError("an evaluation names an item twice")
        if self.mean != round(sum(self.scores) / len(self.scores)):
            raise MalformedError("an evaluation's mean is not the mean of its scores")

    @property
    def mean_score(self) -> float:
        from swarm.messages.rollouts import REWARD_SCALE

        return self.mean / REWARD_SCALE

    def to_wire(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "version": self.version,
            "seed": self.seed,
            "item_ids": list(self.item_ids),
            "scores": list(self.scores),
            "mean": self.mean,
            "created_at": self.created_at,
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            run_id=f.text("run_id"),
            version=f.integer("version", minimum=0),
            seed=f.integer("seed", minimum=0),
            item_ids=f.seq("item_ids", _item_id),
            scores=f.seq("scores", typed(int, "scores")),
            mean=f.integer("mean"),
            created_at=f.integer("created_at", minimum=0),
        )


def _item_id(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise MalformedError("an evaluation item id is a non-negative integer")
    return value
