"""The validator's judgement on the embedded model: honest work is accepted with the verifier's
rewards; each cheat of the detection matrix is rejected hard; honest lateness is soft."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.roles.judge import JudgeContext, judge
from node.tasks.suite import default_suite
from swarm.assignment import assign
from swarm.identity import NodeKey
from swarm.ledger import Balances
from swarm.messages import RolloutSubmission, RunParams, Signed, sign

PARAMS = RunParams(
    group_size=4,
    batch_prompts=2,
    max_tokens=8,
    temperature=1.0,
    toploc_max_submission_mant_mean=1.2,
)
RUN = "ab" * 16
WORKER = NodeKey.from_seed(b"\x05" * 32)
SUITE = default_suite()
MANIFEST = bytes(range(32))
"""The manifest id of policy v3 (the assignment of a run with a quota mixes it)."""


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="float32")


@pytest.fixture(scope="module")
def honest(engine: TorchEngine) -> RolloutSubmission:
    a = assign(RUN, 3, WORKER.peer_id, 0, n_prompts=2, suite_size=SUITE.size, manifest_id=MANIFEST)
    return build_submission(
        generate_groups(engine, SUITE, a, PARAMS), run_id=RUN, version=3, counter=0
    )


def context(newest: int = 3, banned: bool = False) -> JudgeContext:
    by_peer = {WORKER.peer_id: PARAMS.ban_threshold - 1} if banned else {}
    balances = Balances(PARAMS.initial_balance, PARAMS.ban_threshold, by_peer)
    return JudgeContext(RUN, PARAMS, SUITE, newest, balances, {3: MANIFEST})


def resign(sub: RolloutSubmission, **changes: Any) -> Signed[RolloutSubmission]:
    return sign(dataclasses.replace(sub, **changes), WORKER)


def edit_sample(sub: RolloutSubmission, j: int, **changes: Any) -> Signed[RolloutSubmission]:
    samples = list(sub.samples)
    samples[j] = dataclasses.replace(samples[j], **changes)
    return resign(sub, samples=tuple(samples))


def test_honest_submission_is_accepted_with_verifier_rewards(
    engine: TorchEngine, honest: RolloutSubmission
) -> None:
    j = judge(sign(honest, WORKER), context(), engine, counter_seen=False)
    assert j.accepted and j.severity == "none", j.reasons
    assert len(j.rewards) == 8 and all(r in (0.0, 1.0) for r in j.rewards)
    verdict = j.verdict(sign(honest, WORKER), 0)
    assert verdict.worker == WORKER.peer_id and verdict.accepted


def test_honest_fp32_work_passes_a_bf16_validator(honest: RolloutSubmission) -> None:
    bf16 = TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="bfloat16")
    j = judge(sign(honest, WORKER), context(), bf16, counter_seen=False)
    assert j.accepted, j.reasons


CHEATS: dict[str, Callable[[RolloutSubmission], Signed[RolloutSubmission]]] = {
    "unassigned prompts": lambda s: resign(s, prompt_ids=("1", "2")),
    "wrong seed": lambda s: edit_sample(s, 0, seed=s.samples[0].seed + 1),
    "edited token": lambda s: edit_sample(
        s, 1, tokens=(s.samples[1].tokens[0] ^ 1, *s.samples[1].tokens[1:])
    ),
    "false finish": lambda s: edit_sample(
        s, 2, tokens=s.samples[2].tokens[:1], finish_reason="stop"
    ),
    "too few samples": lambda s: resign(s, samples=s.samples[:-1]),
}


@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_each_cheat_is_rejected_hard(
    engine: TorchEngine, honest: RolloutSubmission, cheat: str
) -> None:
    j = judge(CHEATS[cheat](honest), context(), engine, counter_seen=False)
    assert not j.accepted and j.severity == "hard", (cheat, j.reasons)


def test_other_weights_are_rejected_hard(honest: RolloutSubmission) -> None:
    other = TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="float32")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.abs() * 1e-2)  # relative noise 1e-2
    a = assign(RUN, 3, WORKER.peer_id, 0, n_prompts=2, suite_size=SUITE.size, manifest_id=MANIFEST)
    forged = build_submission(
        generate_groups(other, SUITE, a, PARAMS), run_id=RUN, version=3, counter=0
    )
    honest_engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="float32")
    j = judge(sign(forged, WORKER), context(), honest_engine, counter_seen=False)
    assert not j.accepted and j.severity == "hard", j.reasons


def test_replay_is_hard(engine: TorchEngine, honest: RolloutSubmission) -> None:
    j = judge(sign(honest, WORKER), context(), engine, counter_seen=True)
    assert not j.accepted and j.severity == "hard" and "replay" in j.reasons[0]


def test_version_outside_the_window_is_soft(engine: TorchEngine, honest: RolloutSubmission) -> None:
    j = judge(sign(honest, WORKER), context(newest=9), engine, counter_seen=False)
    assert not j.accepted and j.severity == "soft"


def test_banned_worker_is_refused(engine: TorchEngine, honest: RolloutSubmission) -> None:
    j = judge(sign(honest, WORKER), context(banned=True), engine, counter_seen=False)
    assert not j.accepted and "banned" in j.reasons[0]


def test_other_run_is_refused(engine: TorchEngine, honest: RolloutSubmission) -> None:
    j = judge(resign(honest, run_id="cd" * 16), context(), engine, counter_seen=False)
    assert not j.accepted and "not " + RUN in j.reasons[0]


def test_a_counter_at_the_quota_is_refused_hard_before_the_model(
    honest: RolloutSubmission,
) -> None:
    class Untouchable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the model was reached ({name}) past the quota")

    past = resign(honest, counter=PARAMS.quota)
    j = judge(past, context(), Untouchable(), counter_seen=False)  # type: ignore[arg-type]
    assert (j.accepted, j.severity, j.check) == (False, "hard", "quota")
    assert len(j.reasons) == 1 and "\n" not in j.reasons[0] and "quota=64" in j.reasons[0]


def test_work_made_for_another_manifest_is_unassigned(
    engine: TorchEngine, honest: RolloutSubmission
) -> None:
    ctx = dataclasses.replace(context(), manifests={3: bytes(32)})
    j = judge(sign(honest, WORKER), ctx, engine, counter_seen=False)
    assert (j.accepted, j.severity, j.check) == (False, "hard", "assignment"), j.reasons


def test_a_version_whose_manifest_is_unknown_is_soft(
    engine: TorchEngine, honest: RolloutSubmission
) -> None:
    ctx = dataclasses.replace(context(), manifests={})
    j = judge(sign(honest, WORKER), ctx, engine, counter_seen=False)
    assert (j.accepted, j.severity, j.check) == (False, "soft", "manifest"), j.reasons


def test_a_legacy_run_judges_the_assignment_without_the_manifest(
    engine: TorchEngine, honest: RolloutSubmission
) -> None:
    legacy = dataclasses.replace(PARAMS, quota=0)
    ctx = dataclasses.replace(context(), params=legacy, manifests={})
    a = assign(RUN, 3, WORKER.peer_id, 10**6, n_prompts=2, suite_size=SUITE.size)
    old = build_submission(
        generate_groups(engine, SUITE, a, legacy), run_id=RUN, version=3, counter=10**6
    )
    j = judge(sign(old, WORKER), ctx, engine, counter_seen=False)
    assert j.accepted, j.reasons  # no quota: any counter, and no manifest needed
    j = judge(sign(honest, WORKER), ctx, engine, counter_seen=False)
    assert (j.accepted, j.check) == (False, "assignment")
