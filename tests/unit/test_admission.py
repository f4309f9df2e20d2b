"""Cheap before dear (issue 15): the validator refuses what its precheck decides before it takes
the judge lock, claims the assignment, stores anything or reaches the engine.

The validator here is real (``tests.validator_stub``); its engine fails the test if touched.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from node.roles.judge import JudgeContext, Judgement, judge
from node.roles.validator import Validator
from node.run import suite_for
from swarm.assignment import assign
from swarm.errors import ValidationError
from swarm.identity import NodeKey
from swarm.ledger import fold
from swarm.messages import RolloutSubmission, Sample, Signed, sign
from swarm.toploc import proof_size
from tests.validator_stub import GENESIS, PARAMS, RUN, VERSION, stub_validator

WORKER = NodeKey.from_seed(hashlib.sha256(b"admission-worker").digest())


class UntouchableEngine:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the engine was reached ({name}) by work the precheck refuses")


@pytest.fixture
def validator(tmp_path: Path) -> Validator:
    return stub_validator(tmp_path, UntouchableEngine())  # type: ignore[arg-type]


def assigned(key: NodeKey = WORKER, counter: int = 0, **changes: Any) -> RolloutSubmission:
    """A well-formed submission of ``key``'s assignment (its tokens are not the model's)."""
    suite = suite_for(GENESIS.message)
    a = assign(
        RUN,
        VERSION,
        key.peer_id,
        counter,
        n_prompts=2,
        suite_size=suite.size,
        excluded=suite.excluded,
    )
    proof = b"\x00" * proof_size()
    samples = tuple(
        Sample(str(p), (1, 2, 3), a.seed, (proof,), "stop")
        for p in a.prompt_ids
        for _ in range(PARAMS.group_size)
    )
    prompts = tuple(str(p) for p in a.prompt_ids)
    return dataclasses.replace(
        RolloutSubmission(RUN, VERSION, counter, prompts, samples, 1), **changes
    )


def first_sample(sub: RolloutSubmission, **changes: Any) -> RolloutSubmission:
    return dataclasses.replace(
        sub, samples=(dataclasses.replace(sub.samples[0], **changes), *sub.samples[1:])
    )


REFUSED: dict[str, tuple[str, Any]] = {
    "another run": ("run", lambda: assigned(run_id="cd" * 16)),
    "a version outside the window": ("window", lambda: assigned(policy_version=VERSION + 5)),
    "unassigned prompts": ("assignment", lambda: assigned(prompt_ids=("1", "2"))),
    "another worker's assignment": (
        "assignment",
        lambda: dataclasses.replace(assigned(NodeKey.from_seed(b"\x09" * 32)), counter=0),
    ),
    "too few samples": (
        "layout",
        lambda: dataclasses.replace(assigned(), samples=assigned().samples[:-1]),
    ),
    "a wrong seed": ("seed", lambda: first_sample(assigned(), seed=assigned().samples[0].seed + 1)),
    "more tokens than max_tokens": (
        "termination",
        lambda: first_sample(assigned(), tokens=tuple(range(9))),
    ),
    "'length' short of max_tokens": (
        "termination",
        lambda: first_sample(assigned(), finish_reason="length"),
    ),
    "missing proofs": ("termination", lambda: first_sample(assigned(), proofs=())),
    "an oversized proof": (
        "termination",
        lambda: first_sample(assigned(), proofs=(b"\x00" * (proof_size() + 2),)),
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_precheck_refuses_before_claim_storage_or_engine(validator: Validator, case: str) -> None:
    check, make = REFUSED[case]
    signed: Signed[RolloutSubmission] = sign(make(), WORKER)

    async def main() -> None:
        with pytest.raises(ValidationError, match=rf"refused \({check}\)"):
            await validator.handle(signed)

    trio.run(main)
    assert len(validator.claims) == 0
    usage = validator.evidence.store.usage()
    assert usage["objects"] == usage["pinned_objects"] == 0
    assert validator.ledger.verdict_raw(signed.id) is None
    assert validator.stats.refusals == {check: 1} and validator.stats.judged == 0


async def test_a_worker_with_history_waits_behind_at_most_one_newcomer(
    validator: Validator, monkeypatch: pytest.MonkeyPatch
) -> None:
    earned = NodeKey.from_seed(hashlib.sha256(b"admission-earned").digest())
    fresh = [NodeKey.from_seed(hashlib.sha256(b"fresh %d" % i).digest()) for i in range(3)]
    monkeypatch.setattr(validator, "has_history", lambda peer: peer == earned.peer_id)
    order: list[str] = []
    release = trio.Event()

    async def judge(submission: Signed[RolloutSubmission], ctx: Any) -> Judgement:
        order.append(submission.signer)
        await release.wait()
        return Judgement(False, "soft", ["test"])

    monkeypatch.setattr(validator, "_judge", judge)
    async with trio.open_nursery() as nursery:
        for key in fresh:  # the first is judged; the others queue behind the newcomers' slot
            nursery.start_soon(validator.handle, sign(assigned(key), key))
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(validator.handle, sign(assigned(earned), earned))
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert order == [fresh[0].peer_id, earned.peer_id, fresh[1].peer_id, fresh[2].peer_id]


class VocabOnlyEngine:
    """Knows its vocabulary size; any prefill fails the test."""

    info = SimpleNamespace(vocab_size=259)

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the engine was reached ({name}) by a token outside the vocabulary")


def test_a_token_outside_the_vocabulary_is_rejected_hard_before_any_prefill() -> None:
    """Found by the Sybil flood: a signed sample with token ids past the model's vocabulary made
    the prefill raise IndexError (the stream reset, the claim held no verdict). Now the judge
    rejects it hard, as a forged sample, before the engine runs."""
    signed = sign(first_sample(assigned(), tokens=(1, 2, 900)), WORKER)
    ctx = JudgeContext(RUN, PARAMS, suite_for(GENESIS.message), VERSION, fold([], PARAMS))
    verdict = judge(signed, ctx, VocabOnlyEngine(), counter_seen=False)  # type: ignore[arg-type]
    assert verdict.severity == "hard" and not verdict.accepted
    assert "token id 900 outside the vocabulary (259)" in verdict.reasons[0]
