"""The trainer's side of its accountability: a signed receipt for every hand-off, a signed
training record for every version, and its training states served to auditors.

Decisions this module owns:

- **Receipts** (``receipt``): the answer to ``/samples/1`` is the trainer's signed
  ``SampleReceipt`` (queued, with the sample's place in the queue, or too old), which the
  validator keeps: the coverage check rests on the trainer's own signature.
- **Records** (``publish_record``): signed after the step and gossiped on the ledger topic just
  before the version's announcement, so that whoever sees the version can find its record; kept
  in the trainer's own ``training.db`` too (gossip does not deliver a node its own messages).
  The step's numbers (``step_config``) are canonical JSON, floats as Python writes them.
- **States** (``/train-state/1``): the training child keeps the state of the last
  ``train_state_keep`` versions (``states/s<N>.safetensors``); an auditor asks for a byte range
  of one (msgpack ``[version, offset, length]``, at most ``STATE_CHUNK`` bytes) and gets
  ``{"size", "data"}``. Only this trainer holds its state, so the many-peer pull of SHARDCAST
  has nothing to gain here: a range protocol from the one holder, checked against the record's
  commitment once assembled (``node.roles.training_audit``). A version past the window is refused
  with the versions held.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack

from node.compute.groups import Group
from node.run import TaskSource
from node.runtime import Node
from swarm.errors import MalformedError, StorageError, SwarmError, ValidationError
from swarm.ledger.training import TrainingStore
from swarm.messages import (
    REWARD_SCALE,
    RolloutSubmission,
    RunParams,
    SampleReceipt,
    Signed,
    TrainingRecord,
    Verdict,
    gradient_file,
    sign,
)
from swarm.net import StreamLimits
from swarm.net.records import wall_clock_ms

log = logging.getLogger(__name__)

STATE_CHUNK = 4 * 1024 * 1024
STATE_LIMITS = StreamLimits(max_request=256, max_response=STATE_CHUNK + 1024, timeout=60.0)


def step_config(params: RunParams, state: dict[str, Any], **extra: Any) -> str:
    """The canonical JSON text of every number that decides a step (``TrainingRecord.config``)."""
    numbers: dict[str, Any] = {
        "learning_rate": params.learning_rate,
        "clip_epsilon": params.clip_epsilon,
        "clip_delta": params.clip_delta,
        "entropy_coef": params.entropy_coef,
        "kl_coef": params.kl_coef,
        "max_grad_norm": params.max_grad_norm,
        "max_tokens": params.max_tokens,
        "serve_dtype": params.serve_dtype,
        "threads": int(state.get("threads") or 0),
        "deterministic": bool(state.get("deterministic")),
        **extra,
    }
    return json.dumps(numbers, sort_keys=True, separators=(",", ":"))


def groups_of(
    submission: Signed[RolloutSubmission],
    verdict: Signed[Verdict],
    group_size: int,
    suite: TaskSource,
) -> list[Group]:
    """The GRPO groups of accepted work: the worker's tokens, the validator's rewards and the
    task's prompt *text* (the training child tokenizes it). The trainer queues them; an auditor
    rebuilds the same ones from the cited verdicts."""
    s, v, gs = submission.message, verdict.message, group_size
    if len(v.rewards) != len(s.samples) or len(s.samples) != gs * len(s.prompt_ids):
        raise ValidationError("rewards do not match the samples")
    groups = []
    for i, pid in enumerate(s.prompt_ids):
        members = s.samples[i * gs : (i + 1) * gs]
        groups.append(
            Group(
                [],
                [list(x.tokens) for x in members],
                [r / REWARD_SCALE for r in v.rewards[i * gs : (i + 1) * gs]],
                s.policy_version,
                text=suite.task(int(pid)).prompt,
            )
        )
    return groups


class TrainingLog:
    """Receipts, records and states of one trainer (see the module docstring)."""

    def __init__(self, node: Node, store: TrainingStore | None, states: Path) -> None:
        self.node = node
        self.store = store
        self.states = states
        self.records = 0

    def receipt(
        self,
        submission: Signed[RolloutSubmission],
        verdict: Signed[Verdict],
        *,
        trainer_version: int,
        seq: int | None,
    ) -> Signed[SampleReceipt]:
        return sign(
            SampleReceipt(
                run_id=self.node.run_id,
                submission_id=submission.id,
                verdict_id=verdict.id,
                worker=submission.signer,
                sample_version=submission.message.policy_version,
                trainer_version=trainer_version,
                queued=seq is not None,
                seq=seq or 0,
                created_at=wall_clock_ms(),
            ),
            self.node.key,
        )

    async def publish_record(
        self,
        params: RunParams,
        *,
        parent: int,
        min_version: int,
        cited: Sequence[tuple[bytes, int]],
        state: dict[str, Any],
        members: Sequence[bytes] = (),
        **extra: Any,
    ) -> Signed[TrainingRecord]:
        """Sign the record of the step ``parent -> parent + 1``, keep it and gossip it."""
        record = sign(
            TrainingRecord(
                run_id=self.node.run_id,
                version=parent + 1,
                parent=parent,
                min_version=min_version,
                verdicts=tuple(v for v, _ in cited),
                sample_versions=tuple(sv for _, sv in cited),
                config=step_config(params, state, **extra),
                seed=int(state.get("seed") or 0),
                state_before=bytes(state.get("before") or b""),
                state_after=bytes(state.get("after") or b""),
                weights=bytes(state.get("weights") or b""),
                created_at=wall_clock_ms(),
                members=tuple(members),
            ),
            self.node.key,
        )
        if self.store is not None:
            self.store.add(record)
        try:
            await self.node.publish_ledger(record)
        except SwarmError as exc:  # the record sync brings it to whoever gossip missed
            log.warning("training record of v%d not gossiped: %s", parent + 1, exc)
        self.records += 1
        return record

    def held_states(self) -> list[int]:
        return sorted(int(p.stem[1:]) for p in self.states.glob("s*.safetensors"))

    async def serve_state(self, peer: str, body: bytes) -> bytes:
        """A byte range of the training state of a version (``[version, offset, length]``) or,
        for a member of several trainers, of the gradient it committed for the round to a
        version (``[version, offset, length, "gradient", sha256]``, the commitment's
        ``gradient``)."""
        try:
            version, offset, length, *what = msgpack.unpackb(body, raw=False)
            if not all(type(x) is int and x >= 0 for x in (version, offset, length)):
                raise TypeError("not three non-negative integers")
            if what and (
                len(what) != 2
                or what[0] != "gradient"
                or not isinstance(what[1], bytes)
                or len(what[1]) != 32
            ):
                raise TypeError("the tail is not 'gradient' and a 32-byte sha256")
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise MalformedError(
                "a train-state request is [version, offset, length] or [version, offset, length,"
                f" 'gradient', sha256]: {exc}"
            ) from exc
        if what:
            path = self.states / gradient_file(version, what[1])
            return self._range(path, offset, length, "gradient")
        return self._range(self.states / f"s{version}.safetensors", offset, length, "state")

    def _range(self, path: Path, offset: int, length: int, what: str) -> bytes:
        version = path.stem[1:].partition("-")[0]
        try:
            with path.open("rb") as f:
                size = f.seek(0, 2)
                f.seek(offset)
                data = f.read(min(length, STATE_CHUNK))
        except FileNotFoundError:
            held = self.held_states()
            if what == "gradient" and held and int(version) > held[0]:  # kept with its state
                raise StorageError(
                    f"no gradient of the round to v{version} with that sha256 was committed here"
                ) from None
            window = f"{held[0]}..{held[-1]}" if held else "none"
            raise StorageError(
                f"the training {what} of v{version} is not held: past the trainer's retention"
                f" window (it holds the states of v{window})"
            ) from None
        except OSError as exc:
            raise StorageError(f"training {what} of v{version}: {exc.strerror}") from exc
        return bytes(msgpack.packb({"size": size, "data": data}, use_bin_type=True))

    def status(self) -> dict[str, Any]:
        held = self.held_states()
        return {"records": self.records, "states_held": [held[0], held[-1]] if held else []}
