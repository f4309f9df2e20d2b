"""Held-out evaluation of one policy version: sample, score, and replay one item alone.

Decisions this module owns (the message and who evaluates when: ``swarm.messages.evaluation``):

- **One completion per item**, sampled with the run's seeded sampler (``params.sampler``,
  ``params.temperature``, ``params.max_tokens``) at seed ``eval_seed(run_id, version)`` and
  sample index = the item's id (``evaluate``). The draw of an item depends on nothing else, so
  ``replay_item`` regenerates it alone, the way ``swarm-node audit`` checks a sampled item.
- **Scored like training**: the item's own verifier on the decoded text minus the run's length
  penalty (``Engine.score`` with ``params.length_penalty``), so the curve reads on the same
  scale as the reward curve.
- **Millionths on the wire** (``REWARD_SCALE``, ``to_millionths``): a replay agrees when it
  rounds to the same integer. Batched generation left-pads the prompts; the seeded sampler's
  noise does not depend on the batch, but logits may move in their last bits, so a replay on
  another device or precision can in rare cases pick another token: the audit reports such a
  row as a disagreement naming the item.

Pure: no network, no storage, no locks; callers run it off the event loop (the engine blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from node.compute.engine import Engine
from node.rl.rollout import score_item
from node.run import TaskSource
from swarm.messages import REWARD_SCALE, Evaluation, RunParams


def to_millionths(score: float) -> int:
    """A score as the signed integer an ``Evaluation`` holds."""
    return round(score * REWARD_SCALE)


def evaluate(
    engine: Engine,
    source: TaskSource,
    item_ids: Sequence[int],
    params: RunParams,
    seed: int,
) -> list[int]:
    """The score (millionths) of one seeded completion per item of ``item_ids``, in order;
    the engine holds the version being evaluated."""
    ids = list(item_ids)
    if not ids:
        return []
    tasks = [source.task(i) for i in ids]
    prompts = engine.encode_prompts([t.prompt for t in tasks])
    generations = engine.generate(
        prompts,
        [seed] * len(ids),
        params.temperature,
        params.max_tokens,
        sample_indices=ids,
        sampler=params.sampler,
    )
    items = [score_item(t, g.tokens) for t, g in zip(tasks, generations, strict=True)]
    return [to_millionths(s) for s in engine.score(items, params.length_penalty)]


def replay_item(
    engine: Engine, source: TaskSource, item_id: int, params: RunParams, seed: int
) -> int:
    """Item ``item_id``'s score (millionths) regenerated alone: what ``evaluate`` gave it."""
    return evaluate(engine, source, [item_id], params, seed)[0]


def evaluation_record(
    run_id: str, version: int, seed: int, item_ids: Sequence[int], scores: Sequence[int], at: int
) -> Evaluation:
    """The unsigned ``Evaluation`` of ``scores`` (``at``: wall clock, ms)."""
    return Evaluation(
        run_id=run_id,
        version=version,
        seed=seed,
        item_ids=tuple(item_ids),
        scores=tuple(scores),
        mean=round(sum(scores) / len(scores)),
        created_at=at,
    )
