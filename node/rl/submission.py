"""Turning a worker's rollout into a RolloutSubmission: tokens, seeds and TOPLOC proofs."""

from __future__ import annotations

import time

from node.rl.rollout import Rollout
from swarm.messages import RolloutSubmission, Sample
from swarm.toploc import build_proofs


def build_submission(
    rollout: Rollout, *, run_id: str, version: int, counter: int, created_at: int | None = None
) -> RolloutSubmission:
    """The submission for ``rollout`` (``counter``-th request for ``version``); unsigned."""
    ids = [str(i) for i in rollout.assignment.prompt_ids]
    samples = tuple(
        Sample(
            prompt_id=pid,
            tokens=tuple(gen.tokens),
            seed=rollout.assignment.seed,
            proofs=tuple(build_proofs(gen.hidden)) if len(gen.tokens) else (),
            finish_reason=gen.finish_reason,
        )
        for pid, group in zip(ids, rollout.generations, strict=True)
        for gen in group
    )
    return RolloutSubmission(
        run_id=run_id,
        policy_version=version,
        counter=counter,
        prompt_ids=tuple(ids),
        samples=samples,
        created_at=int(time.time() * 1000) if created_at is None else created_at,
        dtype=rollout.dtype,
    )
