"""The staged judgement (issue 15, cheap before dear): a slice of samples picked by the
submission's id is checked first and a hard failure there ends the judgement at the slice's
cost; anything else is checked whole. Garbage costs the slice, honest work is judged as before,
a cheat outside the slice is still caught, and an auditor agrees with verdicts made either way
(a sliced one, and one made by the whole check as before the slice existed)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from node.audit import audit_ledger, policy_dir_source
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.roles import judge as judge_module
from node.roles.judge import SLICE_SAMPLES, JudgeContext, Judgement, judge, slice_of
from node.roles.verdicts import record_judgement
from node.run import create_genesis, suite_for
from node.verify import SampleClaim, SampleVerdict, VerifySettings
from swarm.assignment import assign
from swarm.evidence import EvidenceStore
from swarm.identity import NodeKey
from swarm.ledger import Balances, LedgerStore
from swarm.messages import PolicyAnnouncement, RolloutSubmission, RunParams, Signed, run_id_of, sign
from swarm.toploc import CHUNK_SIZE, proof_size

OWNER, VALIDATOR, TRAINER = (NodeKey.from_seed(bytes([i]) * 32) for i in (21, 22, 23))
WORKERS = [NodeKey.from_seed(bytes([30 + i]) * 32) for i in range(4)]
PARAMS = RunParams(group_size=4, batch_prompts=6, max_tokens=8)  # 24 samples: 3 slices' worth
GENESIS = create_genesis(
    OWNER,
    name="slice",
    trainers=[TRAINER.peer_id],
    validators=[VALIDATOR.peer_id],
    params=PARAMS,
    created_at=1,
)
RUN = run_id_of(GENESIS)
SUITE = suite_for(GENESIS.message)
N = PARAMS.group_size * PARAMS.batch_prompts
MANIFEST = bytes([7]) * 32
ANNOUNCED = sign(PolicyAnnouncement(RUN, 0, MANIFEST, 1), TRAINER)
"""Policy v0's announcement: its manifest id is part of the assignment (the run has a quota)."""


class CountingEngine(TorchEngine):
    """The embedded model, counting the samples each ``verify`` call checks."""

    calls: list[int]

    def verify(self, claims: list[SampleClaim], settings: VerifySettings) -> list[SampleVerdict]:
        self.calls.append(len(claims))
        return super().verify(claims, settings)


@pytest.fixture(scope="module")
def engine() -> CountingEngine:
    e = CountingEngine.from_dir(DEFAULT_MODEL_DIR)
    assert isinstance(e, CountingEngine)
    e.calls = []
    return e


def work(engine: TorchEngine, key: NodeKey, counter: int = 0) -> RolloutSubmission:
    n = PARAMS.batch_prompts
    a = assign(
        RUN, 0, key.peer_id, counter, n_prompts=n, suite_size=SUITE.size, manifest_id=MANIFEST
    )
    return build_submission(
        generate_groups(engine, SUITE, a, PARAMS), run_id=RUN, version=0, counter=counter
    )


def context(store: LedgerStore | None = None) -> JudgeContext:
    balances = (
        store.balances()
        if store is not None
        else Balances(PARAMS.initial_balance, PARAMS.ban_threshold)
    )
    return JudgeContext(RUN, PARAMS, SUITE, 0, balances, {0: MANIFEST})


def garbage(sub: RolloutSubmission, seed: int = 0) -> RolloutSubmission:
    """Random tokens and proofs in every sample: passes every model-free check."""
    rng = random.Random(seed)
    n, chunks = PARAMS.max_tokens, -(-PARAMS.max_tokens // CHUNK_SIZE)
    samples = tuple(
        dataclasses.replace(
            s,
            tokens=tuple(rng.randrange(3, 256) for _ in range(n)),
            proofs=tuple(rng.randbytes(proof_size()) for _ in range(chunks)),
            finish_reason="length",
        )
        for s in sub.samples
    )
    return dataclasses.replace(sub, samples=samples)


def edited_outside_slice(sub: RolloutSubmission, key: NodeKey) -> Signed[RolloutSubmission]:
    """One edited token in one sample, re-signed until that sample is outside the slice (the
    worker cannot choose the slice: it learns it only from the signed envelope's id)."""
    for bump in range(1, 200):
        samples = list(sub.samples)
        j = bump % N
        t = samples[j].tokens
        samples[j] = dataclasses.replace(samples[j], tokens=(t[0] ^ bump, *t[1:]))
        signed = sign(dataclasses.replace(sub, samples=tuple(samples)), key)
        if j not in slice_of(signed.id, N) and t[0] ^ bump < 256:
            return signed
    raise AssertionError("no edit outside the slice in 200 tries")


def test_slice_is_the_validators_pick_and_the_same_on_every_replay() -> None:
    a, b = slice_of(b"\x01" * 32, 128), slice_of(b"\x02" * 32, 128)
    assert len(a) == len(set(a)) == SLICE_SAMPLES and a == sorted(a)
    assert all(0 <= j < 128 for j in a)
    assert a == slice_of(b"\x01" * 32, 128)  # deterministic: replays check the same samples
    assert a != b  # each submission its own slice
    assert slice_of(b"\x01" * 32, 5) == [0, 1, 2, 3, 4]  # small submissions: all of it


def test_garbage_is_rejected_hard_at_the_slices_cost(engine: CountingEngine) -> None:
    engine.calls.clear()
    signed = sign(garbage(work(engine, WORKERS[0])), WORKERS[0])
    j = judge(signed, context(), engine, counter_seen=False)
    assert not j.accepted and j.severity == "hard", j.reasons
    assert engine.calls == [SLICE_SAMPLES]  # the slice only, never the other samples
    assert j.metrics["samples"] == SLICE_SAMPLES
    assert j.metrics["slice"] == ",".join(map(str, slice_of(signed.id, N)))
    assert j.reasons and all(r.startswith("sample ") for r in j.reasons)


def test_honest_work_is_judged_whole_exactly_as_without_the_slice(
    engine: CountingEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    signed = sign(work(engine, WORKERS[1]), WORKERS[1])
    engine.calls.clear()
    staged = judge(signed, context(), engine, counter_seen=False)
    assert staged.accepted, staged.reasons
    assert engine.calls == [SLICE_SAMPLES, N - SLICE_SAMPLES]  # each sample checked once
    monkeypatch.setattr(judge_module, "slice_of", lambda _id, n: list(range(n)))
    whole = judge(signed, context(), engine, counter_seen=False)
    assert (staged.accepted, staged.rewards, staged.metrics) == (
        whole.accepted,
        whole.rewards,
        whole.metrics,
    )
    assert "slice" not in staged.metrics


def test_a_cheat_outside_the_slice_is_still_caught_by_the_whole_check(
    engine: CountingEngine,
) -> None:
    signed = edited_outside_slice(work(engine, WORKERS[2]), WORKERS[2])
    engine.calls.clear()
    j = judge(signed, context(), engine, counter_seen=False)
    assert not j.accepted and j.severity == "hard", j.reasons
    assert engine.calls == [SLICE_SAMPLES, N - SLICE_SAMPLES]
    assert j.metrics["samples"] == N and "slice" not in j.metrics


def validate(store: LedgerStore, engine: TorchEngine, sub: Signed[RolloutSubmission]) -> Judgement:
    j = judge(sub, context(store), engine, counter_seen=False)
    evidence = EvidenceStore.beside(store.path)
    evidence.put(ANNOUNCED.raw, PolicyAnnouncement.KIND, pinned=True)  # as a validator keeps it
    record_judgement(store, evidence, VALIDATOR, sub, j, PARAMS)
    evidence.close()
    return j


def test_audit_agrees_with_sliced_and_whole_check_verdicts(
    engine: CountingEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LedgerStore(tmp_path / "ledger.db", GENESIS)
    # Verdicts made as before the slice existed (the whole check)...
    with monkeypatch.context() as m:
        m.setattr(judge_module, "slice_of", lambda _id, n: list(range(n)))
        old = validate(store, engine, sign(garbage(work(engine, WORKERS[0]), 1), WORKERS[0]))
        assert old.severity == "hard" and old.metrics["samples"] == N
        assert validate(store, engine, sign(work(engine, WORKERS[3]), WORKERS[3])).accepted
    # ... and with it: a sliced slash (a whole-check one replays as the old one does).
    new = validate(store, engine, sign(garbage(work(engine, WORKERS[1]), 2), WORKERS[1]))
    assert new.severity == "hard" and new.metrics["samples"] == SLICE_SAMPLES
    store.close()

    rows = audit_ledger(tmp_path / "ledger.db", policy_dir_source(None))
    assert [r.check for r in rows].count("slash replay") == 2
    assert [r.check for r in rows].count("accept replay") == 1
    assert all(r.ok for r in rows), rows
