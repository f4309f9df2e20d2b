"""The held-out evaluation a validator owes the run: evaluate, sign, store, gossip.

Decisions this module owns (the record and the due rules: ``swarm.messages.evaluation``; the
sampling and scoring: ``node.rl.evaluation``; storage: ``swarm.ledger.evaluations``):

- **Which versions.** Every version announced from the one known when the evaluator starts (or
  the last due one before it) onwards, that ``eval_due`` at the run's cadence and whose
  ``eval_validator`` is this node. Versions announced while the node was away are not caught up
  (their weights are usually pruned by then): a gap in the curve, not a stall.
- **Once per version, across restarts.** A version whose record is in the node's store (its own,
  or another's that gossip brought) is never evaluated again.
- **One engine, one user at a time.** The evaluator is handed ``on_version(version, work)``: the
  validator's judge lock and engine (``Validator.on_version``), so judging and evaluation never
  interleave and the version is loaded once for both. ``hold(version)`` makes sure the weights
  are here (fetched when missing, bounded by ``HOLD_TIMEOUT_S``); a version it cannot hold (or
  whose evaluation failed) is counted in ``missed`` and tried again ``RETRIES`` times,
  ``RETRY_S`` apart, between newer versions: a fetch that timed out on a busy machine costs a
  late point on the curve, not a lost one.
- **Costs.** One batch of ``eval_size`` items per due version, one completion each (0.1 s for 32
  items on the embedded model, one CPU thread).

Cancellation leaves nothing half-done: a record is signed and stored before it is gossiped, and
an evaluation cancelled before that is redone on the next start.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from node.compute.engine import Engine
from node.rl.evaluation import evaluate, evaluation_record
from node.run import TaskSource
from swarm.errors import SwarmError
from swarm.identity import NodeKey
from swarm.ledger.evaluations import EvaluationStore
from swarm.messages import (
    Evaluation,
    PolicyAnnouncement,
    RunParams,
    Signed,
    eval_due,
    eval_seed,
    eval_validator,
    sign,
)
from swarm.net.records import wall_clock_ms

log = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 60.0
"""How long the evaluator waits for a due version's weights before it counts it missed."""

RETRY_S = 30.0
"""How long after a missed evaluation it is tried again (the weights' holders may be busy)."""
RETRIES = 3
"""Tries after the first before a due version is given up (``EvaluatorStats.given_up``)."""

OnVersion = Callable[[int, Callable[[Engine], list[int]]], Awaitable[list[int] | None]]


class PolicyWatch(Protocol):
    """What the evaluator reads of the node's policy tracker."""

    @property
    def version(self) -> int | None: ...

    async def wait_for(self, version: int) -> Signed[PolicyAnnouncement]: ...


@dataclass
class EvaluatorStats:
    evaluated: int = 0
    missed: int = 0
    """Failed tries of due versions: weights not held, or the engine failed (``last_error``)."""
    given_up: int = 0
    """Due versions left unevaluated after ``RETRIES`` more tries."""
    seconds: float = 0.0
    """Time spent evaluating, weights loading included."""
    last_error: str = ""


class Evaluator:
    """Evaluates the versions this validator is due for (see the module docstring)."""

    def __init__(
        self,
        *,
        run_id: str,
        key: NodeKey,
        params: RunParams,
        validators: Sequence[str],
        source: TaskSource,
        item_ids: Sequence[int],
        store: EvaluationStore,
        policy: PolicyWatch,
        on_version: OnVersion,
        hold: Callable[[int], Awaitable[bool]],
        publish: Callable[[Signed[Any]], Awaitable[None]],
    ) -> None:
        self.run_id = run_id
        self.key = key
        self.params = params
        self.validators = tuple(validators)
        self.source = source
        self.item_ids = list(item_ids)
        self.store = store
        self.policy = policy
        self.on_version = on_version
        self.hold = hold
        self.publish = publish
        self.stats = EvaluatorStats()

    def due_here(self, version: int) -> bool:
        """Whether this node owes ``version``'s evaluation."""
        return (
            bool(self.item_ids)
            and eval_due(version, self.params.eval_every)
            and eval_validator(self.run_id, version, self.validators) == self.key.peer_id
        )

    async def run(self) -> None:
        """Follow the announced versions and evaluate the due ones (until cancelled); a missed
        one is tried again ``RETRY_S`` later, at most ``RETRIES`` times."""
        if not self.item_ids or self.params.eval_every <= 0:
            return  # evaluation off (or a source too small to hold items out)
        known = self.policy.version
        every = self.params.eval_every
        wanted = 0 if known is None else known - known % every
        retries: dict[int, int] = {}  # missed version -> tries left
        while True:
            newest = None
            with trio.move_on_after(RETRY_S if retries else math.inf):
                newest = (await self.policy.wait_for(wanted)).message.version
            due = sorted(retries)
            if newest is not None:
                due += [v for v in range(wanted, newest + 1) if self.due_here(v)]
                wanted = newest + 1
            for version in due:
                left = retries.pop(version, RETRIES + 1) - 1
                if self.store.has(version) or await self.evaluate(version) is not None:
                    continue
                if left > 0:
                    retries[version] = left
                else:
                    self.stats.given_up += 1
                    log.warning(
                        "policy v%d given up: not evaluated in %d tries", version, RETRIES + 1
                    )

    async def evaluate(self, version: int) -> Signed[Evaluation] | None:
        """Evaluate ``version``, sign, store and gossip the record; None when it could not."""
        started = time.perf_counter()
        seed = eval_seed(self.run_id, version)
        ids = self.item_ids

        def work(engine: Engine) -> list[int]:
            return evaluate(engine, self.source, ids, self.params, seed)

        try:
            scores = await self.on_version(version, work)
            if scores is None and await self.hold(version):
                scores = await self.on_version(version, work)
        except SwarmError as exc:
            self._missed(version, f"evaluation failed: {exc}")
            return None
        finally:
            self.stats.seconds += time.perf_counter() - started
        if scores is None:
            self._missed(version, "its weights are not held here")
            return None
        record = evaluation_record(self.run_id, version, seed, ids, scores, wall_clock_ms())
        signed = sign(record, self.key)
        self.store.add(signed)
        self.stats.evaluated += 1
        log.info(
            "evaluated policy v%d on %d held-out items: mean %.3f",
            version,
            len(ids),
            record.mean_score,
        )
        try:
            await self.publish(signed)
        except SwarmError as exc:
            log.warning("could not gossip the evaluation of v%d: %s", version, exc)
        return signed

    def _missed(self, version: int, why: str) -> None:
        self.stats.missed += 1
        self.stats.last_error = f"v{version}: {why}"[:300]
        log.warning("policy v%d not evaluated (tried again in %g s): %s", version, RETRY_S, why)


def keep_evaluations(store: EvaluationStore) -> Callable[[Signed[Any]], None]:
    """A ledger-gossip handler that stores every Evaluation the gate accepted (every node runs
    one); a conflicting second record of a version is kept aside by the store and logged."""

    def keep(signed: Signed[Any]) -> None:
        if not isinstance(signed.message, Evaluation):
            return
        try:
            if store.add(signed) == "conflict":
                log.warning(
                    "a second evaluation of v%d from %s kept aside (the first one stays)",
                    signed.message.version,
                    signed.signer[-8:],
                )
        except SwarmError as exc:
            log.warning("evaluation of v%d not stored: %s", signed.message.version, exc)

    return keep
