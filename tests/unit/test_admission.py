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
from tests.validator_stub import GENESIS, MANIFESTS, PARAMS, RUN, VERSION, stub_validator

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
        manifest_id=MANIFESTS[VERSION],
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


def legacy_assigned() -> RolloutSubmission:
    """``assigned()`` with the prompts and seed of the assignment that ignores the manifest
    (what a worker could compute before the version existed)."""
    suite = suite_for(GENESIS.message)
    a = assign(RUN, VERSION, WORKER.peer_id, 0, n_prompts=2, suite_size=suite.size)
    sub = assigned()
    prompts = tuple(str(p) for p in a.prompt_ids)
    samples = tuple(
        dataclasses.replace(s, prompt_id=prompts[j // PARAMS.group_size], seed=a.seed)
        for j, s in enumerate(sub.samples)
    )
    return dataclasses.replace(sub, prompt_ids=prompts, samples=samples)


def first_sample(sub: RolloutSubmission, **changes: Any) -> RolloutSubmission:
    return dataclasses.replace(
        sub, samples=(dataclasses.replace(sub.samples[0], **changes), *sub.samples[1:])
    )


REFUSED: dict[str, tuple[str, Any]] = {
    "another run": ("run", lambda: assigned(run_id="cd" * 16)),
    "a version outside the window": ("window", lambda: assigned(policy_version=VERSION + 5)),
    "a counter at the quota": ("quota", lambda: assigned(counter=PARAMS.quota)),
    "a counter far past the quota": ("quota", lambda: assigned(counter=10**9)),
    "a version whose manifest is not known here": (
        "manifest",
        lambda: assigned(policy_version=VERSION - 2),
    ),
    "the assignment without the manifest id (the pre-quota rule)": (
        "assignment",
        lambda: legacy_assigned(),
    ),
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


def test_a_counter_outside_the_quota_is_refused_with_a_one_line_reason(
    validator: Validator,
) -> None:
    signed = sign(assigned(counter=PARAMS.quota), WORKER)

    async def main() -> None:
        with pytest.raises(ValidationError) as refused:
            await validator.handle(signed)
        reason = str(refused.value)
        assert "\n" not in reason and f"0..{PARAMS.quota - 1}" in reason, reason

    trio.run(main)
    assert len(validator.claims) == 0 and validator.evidence.store.usage()["objects"] == 0
    assert validator.evidence.store.get(signed.id) is None


async def test_a_worker_grinding_counters_is_refused_past_its_quota(
    validator: Validator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that makes more requests of one version than the quota, to submit the lucky
    ones: every counter of the quota is judged (once each), every one past it refused at the
    door with nothing claimed or stored."""
    judged: list[int] = []

    async def judge(submission: Signed[RolloutSubmission], work: Any) -> Judgement:
        judged.append(submission.message.counter)
        return Judgement(False, "soft", ["not the model's tokens"])

    monkeypatch.setattr(validator, "_on_engine", judge)
    quota = PARAMS.quota
    refused: list[int] = []
    for counter in range(quota + 8):
        signed = sign(assigned(counter=counter), WORKER)
        try:
            await validator.handle(signed)
        except ValidationError as exc:
            assert "refused (quota)" in str(exc)
            refused.append(counter)
            assert validator.evidence.store.get(signed.id) is None
            assert not validator.claims.of(WORKER.peer_id, VERSION, counter)
    assert judged == list(range(quota))
    assert refused == list(range(quota, quota + 8))
    assert validator.stats.refusals == {"quota": 8}
    assert len(validator.claims) == quota


async def test_a_worker_with_history_waits_behind_at_most_one_newcomer(
    validator: Validator, monkeypatch: pytest.MonkeyPatch
) -> None:
    earned = NodeKey.from_seed(hashlib.sha256(b"admission-earned").digest())
    fresh = [NodeKey.from_seed(hashlib.sha256(b"fresh %d" % i).digest()) for i in range(3)]
    monkeypatch.setattr(validator, "has_history", lambda peer: peer == earned.peer_id)
    order: list[str] = []
    release = trio.Event()

    async def judge(submission: Signed[RolloutSubmission], work: Any) -> Judgement:
        order.append(submission.signer)
        await release.wait()
        return Judgement(False, "soft", ["test"])

    monkeypatch.setattr(validator, "_on_engine", judge)
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
    ctx = JudgeContext(
        RUN, PARAMS, suite_for(GENESIS.message), VERSION, fold([], PARAMS), MANIFESTS
    )
    verdict = judge(signed, ctx, VocabOnlyEngine(), counter_seen=False)  # type: ignore[arg-type]
    assert verdict.severity == "hard" and not verdict.accepted
    assert "token id 900 outside the vocabulary (259)" in verdict.reasons[0]
