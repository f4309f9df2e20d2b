"""The trainer's accountability without a swarm: records, receipts and disputes decode or fail
in one line; the ledger gate takes records only from genesis trainers and disputes only from
genesis validators; the store keeps the first record of a version; the skip rule and coverage
read the receipts; the queue's places never repeat; a state past the retention window is
refused with the window held; the rogue trainer's plan parses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from node.compute.groups import Group
from node.roles.cheats import trainer_cheat_by_spec
from node.roles.sample_queue import SampleQueue
from node.roles.trainer_records import TrainingLog, step_config
from node.roles.training_audit import coverage, skipped
from swarm.errors import ConfigError, MalformedError, StorageError
from swarm.identity import NodeKey
from swarm.ledger.training import TrainingStore
from swarm.messages import (
    GradientCommitment,
    RunParams,
    SampleReceipt,
    Signed,
    TrainingDispute,
    TrainingRecord,
    decode,
    gradient_file,
    sign,
    train_auditor,
)
from swarm.messages.training import audit_draw
from swarm.net.gossip import GossipStats, LedgerGate, Refused

RUN = "run-under-test"
TRAINER = NodeKey.from_seed(b"\x51" * 32)
VALIDATOR = NodeKey.from_seed(b"\x52" * 32)
OUTSIDER = NodeKey.from_seed(b"\x53" * 32)


def record(
    version: int,
    verdicts: list[bytes],
    *,
    key: NodeKey = TRAINER,
    min_version: int = 0,
    salt: int = 0,
) -> Signed[TrainingRecord]:
    return sign(
        TrainingRecord(
            run_id=RUN,
            version=version,
            parent=version - 1,
            min_version=min_version,
            verdicts=tuple(verdicts),
            sample_versions=tuple(max(0, version - 1) for _ in verdicts),
            config=step_config(RunParams(), {"threads": 1, "deterministic": True}),
            seed=7,
            state_before=b"\x01" * 32,
            state_after=b"\x02" * 32,
            weights=b"\x03" * 32,
            created_at=1 + salt,
        ),
        key,
    )


def receipt(n: int, seq: int, version: int, worker: str = "w-a") -> Signed[SampleReceipt]:
    return sign(
        SampleReceipt(
            run_id=RUN,
            submission_id=bytes([n]) * 32,
            verdict_id=bytes([100 + n]) * 32,
            worker=worker,
            sample_version=version,
            trainer_version=version,
            queued=True,
            seq=seq,
            created_at=1,
        ),
        TRAINER,
    )


def test_messages_round_trip_and_bad_ones_fail_in_one_line() -> None:
    r = record(3, [b"\x09" * 32])
    assert decode(r.raw, TrainingRecord).message == r.message
    with pytest.raises(MalformedError, match="follows its parent"):
        TrainingRecord(RUN, 3, 1, 0, (), (), "{}", 0, b"", b"", b"", 0)
    with pytest.raises(MalformedError, match="cites a verdict twice"):
        TrainingRecord(RUN, 2, 1, 0, (b"\x01" * 32,) * 2, (1, 1), "{}", 0, b"", b"", b"", 0)
    with pytest.raises(MalformedError, match="not known"):
        TrainingDispute(RUN, 2, "t", b"", "made-up", "", 0)
    x = receipt(1, 5, 2)
    assert decode(x.raw, SampleReceipt).message.seq == 5


def test_the_gate_takes_records_from_trainers_and_disputes_from_validators() -> None:
    gate = LedgerGate(
        RUN,
        (VALIDATOR.peer_id,),
        GossipStats(),
        validators=(VALIDATOR.peer_id,),
        trainers=(TRAINER.peer_id,),
    )
    gate.check(record(1, []).raw)
    with pytest.raises(Refused, match="not a genesis trainer"):
        gate.check(record(1, [], key=OUTSIDER).raw)
    dispute = TrainingDispute(RUN, 1, TRAINER.peer_id, b"", "no-record", "missing", 1)
    gate.check(sign(dispute, VALIDATOR).raw)
    with pytest.raises(Refused, match="not a genesis validator"):
        gate.check(sign(dispute, TRAINER).raw)


def test_the_store_keeps_the_first_record_of_a_version(tmp_path: Path) -> None:
    store = TrainingStore(tmp_path / "training.db")
    first, other = record(2, []), record(2, [], salt=1)
    assert store.add(first) == "stored"
    assert store.add(first) == "again"
    assert store.add(other) == "conflict"
    assert store.record(2) is not None and store.record(2).id == first.id  # type: ignore[union-attr]
    assert store.summary()["conflicts"] == 1
    store.close()


def test_a_sample_passed_over_for_a_later_one_is_skipped() -> None:
    receipts = [receipt(1, 1, 0, "w-a"), receipt(2, 2, 0, "w-b"), receipt(3, 3, 0, "w-b")]
    # v1 trains seq 2 and 3 while seq 1 (worker a, in the window) waits: skipped.
    r1 = record(1, [receipts[1].message.verdict_id, receipts[2].message.verdict_id])
    trained = set(r1.message.verdicts)
    assert [x.message.worker for x in skipped(r1, receipts, trained)] == ["w-a"]
    # Oldest first is no skip.
    honest = record(1, [receipts[0].message.verdict_id, receipts[1].message.verdict_id])
    assert skipped(honest, receipts, set(honest.message.verdicts)) == []
    # Coverage: seq 1 left the window (async level 2, newest v4) untrained.
    later = record(4, [])
    cov = coverage([r1, later], receipts, async_level=2)
    assert cov["w-a"] == {"handed": 1, "trained": 0, "left_out": 1}
    assert cov["w-b"] == {"handed": 2, "trained": 2, "left_out": 0}


def test_queue_places_never_repeat_after_a_prune(tmp_path: Path) -> None:
    queue = SampleQueue(tmp_path / "samples.db")
    group = Group([1], [[2], [3]], [1.0, 0.0], 0)
    for i in range(3):
        queue.put(bytes([i]) * 32, 0, [group], verdict_id=bytes([50 + i]) * 32, worker="w")
    assert queue.seq_of(b"\x02" * 32) == 3
    queue.prune(5, 5)  # every row of v0 goes
    queue.put(b"\x09" * 32, 5, [group], verdict_id=b"\x59" * 32, worker="w")
    assert queue.seq_of(b"\x09" * 32) == 4
    assert queue.first_worker() == "w"
    # The rogue trainer's drop-worker target: the oldest work waiting in the window, not the
    # run's first worker (whose work was trained, or left the window).
    queue.put(b"\x0a" * 32, 3, [group], verdict_id=b"\x5a" * 32, worker="w-old")
    queue.put(b"\x0b" * 32, 6, [group], verdict_id=b"\x5b" * 32, worker="w-new")
    queue.take(5, 1, 0)  # w's, the oldest, is trained
    assert queue.first_worker() == "w-old" and queue.first_worker(4) == "w-new"
    queue.close()
    # A queue from before receipts (no verdict or worker columns) opens and gains them.
    import sqlite3

    old = sqlite3.connect(tmp_path / "old.db")
    old.execute(
        "CREATE TABLE accepted (submission_id BLOB PRIMARY KEY, seq INTEGER NOT NULL,"
        " version INTEGER NOT NULL, groups BLOB NOT NULL, step INTEGER)"
    )
    old.execute("INSERT INTO accepted VALUES (?, 7, 0, ?, NULL)", (b"\x01" * 32, b"\x90"))
    old.commit()
    old.close()
    again = SampleQueue(tmp_path / "old.db")
    assert again.put(b"\x02" * 32, 0, [group], verdict_id=b"\x03" * 32, worker="w2")
    assert again.seq_of(b"\x02" * 32) == 8 and again.first_worker() == "w2"
    again.close()


async def test_a_state_past_the_retention_window_is_refused_with_the_window(
    tmp_path: Path,
) -> None:
    states = tmp_path / "states"
    states.mkdir()
    for v in (5, 6):
        (states / f"s{v}.safetensors").write_bytes(b"x" * 10)
    log = TrainingLog(SimpleNamespace(), None, states)  # type: ignore[arg-type]
    answer = msgpack.unpackb(await log.serve_state("p", msgpack.packb([6, 4, 100])))
    assert answer == {"size": 10, "data": b"x" * 6}
    with pytest.raises(
        StorageError, match=r"past the trainer's retention window \(it holds the states of v5..6\)"
    ):
        await log.serve_state("p", msgpack.packb([2, 0, 100]))
    # A group member's gradients of a round: one per commitment (its own round ran twice).
    first, second = b"\x01" * 32, b"\x02" * 32
    (states / gradient_file(6, first)).write_bytes(b"g" * 4)
    (states / gradient_file(6, second)).write_bytes(b"h" * 5)
    for sha, body in ((first, b"g" * 4), (second, b"h" * 5)):
        ask = msgpack.packb([6, 0, 100, "gradient", sha])
        assert msgpack.unpackb(await log.serve_state("p", ask)) == {"size": len(body), "data": body}
    with pytest.raises(StorageError, match="no gradient of the round to v6 with that sha256"):
        await log.serve_state("p", msgpack.packb([6, 0, 100, "gradient", b"\x03" * 32]))
    with pytest.raises(StorageError, match="training gradient of v5 is not held"):
        await log.serve_state("p", msgpack.packb([5, 0, 100, "gradient", first]))
    bad_asks = (
        ["2", 0, 100],
        [2, 0, 100, "weights", first],
        [2, 0, 100, "gradient"],
        [2, 0, 100, "gradient", b"short"],
        [2, 0],
    )
    for bad in bad_asks:
        with pytest.raises(MalformedError, match="train-state request"):
            await log.serve_state("p", msgpack.packb(bad))


def test_the_audit_draw_is_the_due_validators_own() -> None:
    validators = [VALIDATOR.peer_id, OUTSIDER.peer_id]
    due = {train_auditor(RUN, v, validators) for v in range(1, 40)}
    assert due == set(validators)  # each has a share
    draws = [
        audit_draw(VALIDATOR.signature("train-audit-draw", bytes([i]) * 32)) for i in range(200)
    ]
    assert all(0 <= d < 1 for d in draws)
    assert 0.02 < sum(d < 0.1 for d in draws) / 200 < 0.2  # about the share asked


def test_the_rogue_trainers_plan_parses_or_fails_in_one_line() -> None:
    plan: Any = trainer_cheat_by_spec("learning-rate@1,drop-worker@4")
    assert plan.at(1) == "learning-rate" and plan.at(4) == "drop-worker" and plan.at(2) is None
    assert trainer_cheat_by_spec("perturb-weights").at(9) == "perturb-weights"
    with pytest.raises(ConfigError, match="unknown trainer cheat"):
        trainer_cheat_by_spec("steal")
    with pytest.raises(ConfigError, match="number"):
        trainer_cheat_by_spec("learning-rate@x")
    for bad in ("forge-gradient*0", "forge-gradient*x", "forge-gradient@1*2"):
        with pytest.raises(ConfigError, match="a count, 1 or more"):
            trainer_cheat_by_spec(bad)
    # The first two steps that train samples of this trainer, whatever their numbers; a step
    # picked stays picked when its round is tried again, with or without samples.
    first: Any = trainer_cheat_by_spec("forge-gradient*2")
    picks = [first.pick(s, n) for s, n in ((0, 0), (1, 3), (2, 0), (1, 0), (3, 1), (4, 5))]
    assert picks == [None, "forge-gradient", None, "forge-gradient", "forge-gradient", None]
    assert first.picked == {1, 3}
    # What counts is groups with signal: equal rewards give no gradient, and a commitment of
    # no samples (the group audit's forged rounds once carried none: docs/RELIABILITY.md).
    flat, mixed = Group([], [[1], [2]], [1.0, 1.0], 0), Group([], [[1], [2]], [0.0, 1.0], 0)
    assert [g.signal for g in (flat, mixed, Group([], [[1]], [1.0], 0))] == [False, True, False]


def test_a_record_whose_numbers_are_not_the_genesis_is_wrong_params(tmp_path: Path) -> None:
    import json

    from node.model import DEFAULT_MODEL_DIR
    from node.roles.training_audit import StepAuditor
    from node.run import create_genesis
    from node.tasks.suite import default_suite

    params = RunParams(async_level=2)
    genesis = create_genesis(
        NodeKey.from_seed(b"\x54" * 32),
        name="numbers",
        trainers=[TRAINER.peer_id],
        validators=[VALIDATOR.peer_id],
        params=params,
        created_at=1,
    )
    node = SimpleNamespace(config=SimpleNamespace(genesis=genesis))

    async def no_weights(version: int) -> None:
        return None

    auditor = StepAuditor(
        node,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        default_suite(),
        DEFAULT_MODEL_DIR,
        tmp_path,
        no_weights,
        chat_template=False,
    )
    honest = record(5, [], min_version=3).message
    assert auditor.check_numbers(honest) == []
    numbers = json.loads(honest.config) | {"learning_rate": 0.5}
    forged = TrainingRecord(**{**_fields(honest), "config": json.dumps(numbers)})
    (finding,) = auditor.check_numbers(forged)
    assert finding.reason == "wrong-params" and "learning_rate=0.5" in finding.detail
    early = TrainingRecord(**{**_fields(honest), "min_version": 1})
    (finding,) = auditor.check_numbers(early)
    assert finding.reason == "outside-window" and "below v2" in finding.detail
    # A rollback cites nothing and carries the window of the step that collapsed (its parent
    # one lower): no window to be outside of. One that cites work is checked as a step.
    rolled = json.dumps(json.loads(honest.config) | {"rollback_to": 3})
    rollback = TrainingRecord(**{**_fields(honest), "min_version": 1, "config": rolled})
    assert auditor.check_numbers(rollback) == []
    citing = record(5, [b"\x01" * 32], min_version=1).message
    citing = TrainingRecord(**{**_fields(citing), "config": rolled})
    (finding,) = auditor.check_numbers(citing)
    assert finding.reason == "outside-window"


async def test_a_cited_verdict_is_unknown_only_when_every_validator_denies_it(
    tmp_path: Path,
) -> None:
    """Silence (a dropped connection, a timeout) leaves the verdict unchecked, never disputed:
    the CI run of 2026-12-06 disputed an honest step when one evidence request failed."""
    from node.model import DEFAULT_MODEL_DIR
    from node.roles.evidence import NOT_HELD, Lookup
    from node.roles.training_audit import StepAuditor
    from node.run import create_genesis
    from node.tasks.suite import default_suite

    other = NodeKey.from_seed(b"\x56" * 32)
    genesis = create_genesis(
        NodeKey.from_seed(b"\x54" * 32),
        name="cited",
        trainers=[TRAINER.peer_id],
        validators=[VALIDATOR.peer_id, other.peer_id],
        params=RunParams(),
        created_at=1,
    )
    answers: dict[str, str] = {}
    asked: list[tuple[list[str], int]] = []

    class Evidence:
        async def lookup(
            self, object_id: bytes, peers: Any, *, tries: int = 1, retry: Any = None
        ) -> Lookup:
            asked.append((list(peers), tries))
            assert list(retry) == list(peers)  # only the validators' silence is asked again
            found = Lookup()
            for peer, answer in answers.items():
                if answer == NOT_HELD:
                    found.denied.add(peer)
                else:
                    found.silent[peer] = answer
            return found

    # The auditor is one of the validators: it asks only the other one.
    node = SimpleNamespace(config=SimpleNamespace(genesis=genesis), peer_id=VALIDATOR.peer_id)
    auditor = StepAuditor(
        node,  # type: ignore[arg-type]
        Evidence(),  # type: ignore[arg-type]
        default_suite(),
        DEFAULT_MODEL_DIR,
        tmp_path,
        None,  # type: ignore[arg-type]
        chat_template=False,
    )
    cites = record(5, [b"\x09" * 32], min_version=3)
    answers[other.peer_id] = f"{other.peer_id} did not answer evidence within 30 s"
    pairs, findings, unchecked = await auditor.cited_work(cites)
    assert (pairs, findings) == ([], [])
    (why,) = unchecked
    assert "was not served" in why and "within 30 s" in why, why
    assert asked == [([other.peer_id], 3)]
    answers[other.peer_id] = NOT_HELD
    pairs, findings, unchecked = await auditor.cited_work(cites)
    assert [f.reason for f in findings] == ["unknown-verdict"] and unchecked == []


def commitment(key: NodeKey, verdicts: list[bytes], *, version: int = 5, run: str = RUN) -> bytes:
    return sign(
        GradientCommitment(
            run_id=run,
            version=version,
            samples=4 * len(verdicts),
            verdicts=tuple(verdicts),
            sample_versions=tuple(version - 1 for _ in verdicts),
            seed=7,
            threads=1,
            state_before=b"\x04" * 32,
            gradient=b"\x05" * 32,
            created_at=1,
        ),
        key,
    ).raw


def test_a_rounds_member_commitments_are_checked_against_the_genesis_and_the_record(
    tmp_path: Path,
) -> None:
    from node.roles.training_audit import StepAuditor
    from node.run import create_genesis
    from node.tasks.suite import default_suite

    other = NodeKey.from_seed(b"\x55" * 32)
    genesis = create_genesis(
        NodeKey.from_seed(b"\x54" * 32),
        name="members",
        trainers=[TRAINER.peer_id, other.peer_id],
        validators=[VALIDATOR.peer_id],
        params=RunParams(),
        created_at=1,
    )
    node = SimpleNamespace(config=SimpleNamespace(genesis=genesis))
    auditor = StepAuditor(
        node,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        default_suite(),
        tmp_path,
        tmp_path,
        None,  # type: ignore[arg-type]
        chat_template=False,
    )
    a, b = [bytes([1]) * 32], [bytes([2]) * 32, bytes([3]) * 32]

    def round_record(*members: bytes) -> Signed[TrainingRecord]:
        honest = record(5, a + b).message
        return sign(TrainingRecord(**{**_fields(honest), "members": members}), TRAINER)

    found, bad = auditor.members_of(round_record(commitment(TRAINER, a), commitment(other, b)))
    assert bad == [] and [c.signer for c in found] == [TRAINER.peer_id, other.peer_id]
    cases = {
        "no genesis trainer": (commitment(TRAINER, a), commitment(OUTSIDER, b)),
        "repeats member": (commitment(TRAINER, a), commitment(TRAINER, b)),
        "not this round's": (commitment(TRAINER, a), commitment(other, b, version=4)),
        "not the record's verdicts": (commitment(other, b), commitment(TRAINER, a)),
        "member commitment 1: ": (commitment(TRAINER, a), b"\x00garbage"),
    }
    for why, members in cases.items():
        found, (finding,) = auditor.members_of(round_record(*members))
        assert found == [] and finding.reason == "member-mismatch", finding
        assert why in finding.detail, finding.detail


def _fields(r: TrainingRecord) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}


async def test_a_round_with_a_member_that_committed_nothing_is_not_replayed(
    tmp_path: Path,
) -> None:
    from node.roles.training_audit import StepAuditor
    from node.run import create_genesis
    from node.tasks.suite import default_suite

    genesis = create_genesis(
        NodeKey.from_seed(b"\x54" * 32),
        name="uncommitted",
        trainers=[TRAINER.peer_id],
        validators=[VALIDATOR.peer_id],
        params=RunParams(),
        created_at=1,
    )
    node = SimpleNamespace(config=SimpleNamespace(genesis=genesis))
    auditor = StepAuditor(
        node,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        default_suite(),
        tmp_path,
        tmp_path / "work",
        None,  # type: ignore[arg-type]
        chat_template=False,
    )
    state = {"threads": 1, "deterministic": True}
    config = step_config(RunParams(), state, members_uncommitted=1)
    honest = record(5, [], min_version=4).message
    signed = sign(TrainingRecord(**{**_fields(honest), "config": config}), TRAINER)
    assert auditor.check_numbers(signed.message) == []
    result = await auditor.audit(signed)
    assert result.outcome == "not-replayed" and "committed no gradient" in result.detail


async def test_a_replay_stopped_by_what_may_pass_is_tried_again_and_then_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The due validator's replay met a silent trainer: it is tried again later (the audits of
    other versions go on meanwhile) and the outcome of the try that got through is kept; a
    version that never gets through is kept ``not-replayed`` after ``AUDIT_AGAIN`` more tries,
    and a reason that cannot pass (a rollback) is not tried again."""
    import trio

    from node.roles import train_audit
    from node.roles.training_audit import StepAudit

    monkeypatch.setattr(train_audit, "AGAIN_S", 0.01)
    genesis = SimpleNamespace(
        message=SimpleNamespace(
            validators=(VALIDATOR.peer_id,), params=RunParams(train_audit_share=1.0)
        )
    )
    accepted = trio.Event()
    accepted.set()

    class Policy:
        async def wait_for(self, version: int) -> None:
            await accepted.wait()

        def on_change(self, callback: object) -> None:
            pass

    node = SimpleNamespace(
        config=SimpleNamespace(genesis=genesis),
        run_id=RUN,
        peer_id=VALIDATOR.peer_id,
        key=VALIDATOR,
        policy=Policy(),
        subscribe_ledger=lambda callback: None,
    )
    silent = "trainer did not answer for the state"
    plan = {1: [True, False], 2: [True] * 9, 3: [False]}  # per try: silent (True) or not
    asked: list[int] = []

    class Auditor:
        async def audit(self, signed: Signed[TrainingRecord], pick: float) -> StepAudit:
            v = signed.message.version
            asked.append(v)
            if plan[v].pop(0):
                return StepAudit(v, "not-replayed", silent, again=True)
            if v == 3:
                return StepAudit(v, "not-replayed", "a rollback to the weights of v1")
            return StepAudit(v, "agreed")

    store = TrainingStore(tmp_path / "training.db")
    for v in (1, 2, 3):
        assert train_auditor(RUN, v, [VALIDATOR.peer_id]) == VALIDATOR.peer_id
    audits = train_audit.TrainingAudits(node, store, Auditor())  # type: ignore[arg-type]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(audits.run)
            for v in (1, 2, 3):
                signed = record(v, [], min_version=v - 1)
                store.add(signed)  # as the ledger gate does before the audit hears of it
                audits.on_gossip(signed)
            while len(store.audits()) < 3:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    outcomes = store.audits()
    assert outcomes[1] == ("agreed", "") and outcomes[3][0] == "not-replayed"
    assert outcomes[2] == ("not-replayed", silent)
    assert asked.count(1) == 2 and asked.count(3) == 1
    assert asked.count(2) == 1 + train_audit.AUDIT_AGAIN
    assert asked.index(3) < asked.index(1, 1), "v3's audit did not wait for v1's next try"
    assert audits.replayed == 1
    store.close()
