"""Audit replays every slash from the ledger alone and agrees with honest validators; it
disagrees, with exit 1, when a validator slashed honest work."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import pytest

from cli.app import main
from node.audit import (
    audit_bundle,
    audit_ledger,
    export_bundle,
    ledger_manifests,
    policy_dir_source,
)
from node.bundle import pack_bundle, policy_of
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.roles.judge import JudgeContext, Judgement, judge
from node.roles.verdicts import record_judgement
from node.run import create_genesis, suite_for
from swarm.assignment import assign
from swarm.evidence import EvidenceStore
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import PolicyAnnouncement, RolloutSubmission, RunParams, Signed, run_id_of, sign

OWNER, VALIDATOR, TRAINER = (NodeKey.from_seed(bytes([i]) * 32) for i in (1, 2, 3))
HONEST, CHEATER = NodeKey.from_seed(b"\x08" * 32), NodeKey.from_seed(b"\x09" * 32)
PARAMS = RunParams(group_size=4, batch_prompts=2, max_tokens=8)
GENESIS = create_genesis(
    OWNER,
    name="audit",
    trainers=[TRAINER.peer_id],
    validators=[VALIDATOR.peer_id],
    params=PARAMS,
    created_at=1,
)
RUN = run_id_of(GENESIS)
SUITE = suite_for(GENESIS.message)
MANIFEST = bytes([5]) * 32
ANNOUNCED = sign(PolicyAnnouncement(RUN, 0, MANIFEST, 1), TRAINER)
"""Policy v0's announcement: its manifest id is part of the assignment (the run has a quota)."""


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine.from_dir(DEFAULT_MODEL_DIR)


def work(engine: TorchEngine, key: NodeKey, counter: int) -> RolloutSubmission:
    a = assign(
        RUN, 0, key.peer_id, counter, n_prompts=2, suite_size=SUITE.size, manifest_id=MANIFEST
    )
    return build_submission(
        generate_groups(engine, SUITE, a, PARAMS), run_id=RUN, version=0, counter=counter
    )


def validate(store: LedgerStore, engine: TorchEngine, sub: Signed[RolloutSubmission]) -> Judgement:
    ctx = JudgeContext(RUN, PARAMS, SUITE, 0, store.balances(), {0: MANIFEST})
    j = judge(sub, ctx, engine, counter_seen=False)
    evidence = EvidenceStore.beside(store.path)
    evidence.put(ANNOUNCED.raw, PolicyAnnouncement.KIND, pinned=True)  # as a validator keeps it
    record_judgement(store, evidence, VALIDATOR, sub, j, PARAMS)
    evidence.close()
    return j


def test_audit_agrees_with_an_honest_validator_and_bundles_replay(
    engine: TorchEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = LedgerStore(tmp_path / "ledger.db", GENESIS)
    honest = sign(work(engine, HONEST, 0), HONEST)
    assert validate(store, engine, honest).accepted
    real = work(engine, CHEATER, 0)
    samples = list(real.samples)
    samples[0] = dataclasses.replace(
        samples[0], tokens=(samples[0].tokens[0] ^ 1, *samples[0].tokens[1:])
    )
    cheat = sign(dataclasses.replace(real, samples=tuple(samples)), CHEATER)
    assert validate(store, engine, cheat).severity == "hard"
    assert store.balances().banned(CHEATER.peer_id) and not store.balances().banned(HONEST.peer_id)
    store.close()

    rows = audit_ledger(tmp_path / "ledger.db", policy_dir_source(None))
    assert all(r.ok for r in rows), rows
    assert [r.check for r in rows].count("slash replay") == 1
    assert [r.check for r in rows].count("accept replay") == 1

    # An exported bundle of this quota run holds v0's announcement: it replays alone (no --db).
    bundle = tmp_path / "cheat.bundle"
    export_bundle(tmp_path / "ledger.db", cheat.id, bundle)
    assert msgpack.unpackb(bundle.read_bytes(), raw=False)["policy"] == [ANNOUNCED.raw]
    assert all(r.ok for r in audit_bundle(bundle, policy_dir_source(None)))
    export_bundle(tmp_path / "ledger.db", honest.id, tmp_path / "honest.bundle")
    assert all(r.ok for r in audit_bundle(tmp_path / "honest.bundle", policy_dir_source(None)))
    # Without the announcement the replay cannot derive the assignment: unchecked, named; the
    # evidence store beside the ledger gives the manifest id (--db).
    packed = msgpack.unpackb((tmp_path / "honest.bundle").read_bytes(), raw=False)
    without = tmp_path / "without-policy.bundle"
    without.write_bytes(
        pack_bundle(packed["genesis"], packed["submission"], packed["verdict"], packed["related"])
    )
    honest_rows = audit_bundle(without, policy_dir_source(None))
    assert [r.ok for r in honest_rows] == [None] and "v0" in honest_rows[0].detail
    manifests = ledger_manifests(tmp_path / "ledger.db")
    assert manifests(0) == MANIFEST
    assert all(r.ok for r in audit_bundle(without, policy_dir_source(None), manifests=manifests))

    with pytest.raises(SystemExit) as done:
        main(["audit", str(tmp_path / "ledger.db")])
    assert done.value.code == 0 and "audit agrees" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["audit", str(bundle)])
    assert done.value.code == 0 and "audit agrees" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["audit", str(without), "--db", str(tmp_path / "ledger.db")])
    assert done.value.code == 0 and "audit agrees" in capsys.readouterr().out

    with pytest.raises(SystemExit):
        main(["ledger", "show", "--db", str(tmp_path / "ledger.db"), "--json"])
    import json

    shown = json.loads(capsys.readouterr().out)
    assert shown["balances"][CHEATER.peer_id]["banned"] is True
    assert shown["balances"][HONEST.peer_id] == {"balance": 108, "banned": False}


def test_audit_disagrees_with_a_slash_of_honest_work(
    engine: TorchEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = LedgerStore(tmp_path / "ledger.db", GENESIS)
    honest = sign(work(engine, HONEST, 1), HONEST)
    unfair = Judgement(False, "hard", ["made up"])
    evidence = EvidenceStore.beside(store.path)
    evidence.put(ANNOUNCED.raw, PolicyAnnouncement.KIND, pinned=True)
    record_judgement(store, evidence, VALIDATOR, honest, unfair, PARAMS)
    evidence.close()
    store.close()
    rows = audit_ledger(tmp_path / "ledger.db", policy_dir_source(None))
    assert [r.ok for r in rows if r.check == "slash replay"] == [False]
    with pytest.raises(SystemExit) as done:
        main(["audit", str(tmp_path / "ledger.db")])
    assert done.value.code == 1 and "DISAGREE" in capsys.readouterr().out


def test_a_replay_without_the_manifest_id_is_unchecked_not_agreed(
    engine: TorchEngine, tmp_path: Path
) -> None:
    store = LedgerStore(tmp_path / "ledger.db", GENESIS)
    sub = sign(work(engine, HONEST, 2), HONEST)
    ctx = JudgeContext(RUN, PARAMS, SUITE, 0, store.balances(), {0: MANIFEST})
    j = judge(sub, ctx, engine, counter_seen=False)
    assert j.accepted, j.reasons
    evidence = EvidenceStore.beside(store.path)  # a store without v0's announcement
    record_judgement(store, evidence, VALIDATOR, sub, j, PARAMS)
    evidence.close()
    store.close()
    rows = audit_ledger(tmp_path / "ledger.db", policy_dir_source(None))
    replay = [r for r in rows if r.check == "accept replay"]
    assert [r.ok for r in replay] == [None] and "manifest id of policy v0" in replay[0].detail


def test_a_legacy_run_replays_the_assignment_without_a_manifest(
    engine: TorchEngine, tmp_path: Path
) -> None:
    """A genesis from before quotas (``quota`` absent reads as 0): any counter, the assignment
    without the manifest id, and an audit that needs no announcement."""
    legacy = dataclasses.replace(PARAMS, quota=0)
    genesis = create_genesis(
        OWNER,
        name="legacy",
        trainers=[TRAINER.peer_id],
        validators=[VALIDATOR.peer_id],
        params=legacy,
        created_at=1,
    )
    run = run_id_of(genesis)
    store = LedgerStore(tmp_path / "ledger.db", genesis)
    a = assign(run, 0, HONEST.peer_id, 5000, n_prompts=2, suite_size=SUITE.size)
    sub = sign(
        build_submission(
            generate_groups(engine, SUITE, a, legacy), run_id=run, version=0, counter=5000
        ),
        HONEST,
    )
    j = judge(
        sub, JudgeContext(run, legacy, SUITE, 0, store.balances()), engine, counter_seen=False
    )
    assert j.accepted, j.reasons
    evidence = EvidenceStore.beside(store.path)
    record_judgement(store, evidence, VALIDATOR, sub, j, legacy)
    evidence.close()
    store.close()
    rows = audit_ledger(tmp_path / "ledger.db", policy_dir_source(None))
    assert [r.ok for r in rows if r.check == "accept replay"] == [True], rows


def test_a_bundle_without_announcements_packs_to_the_bytes_of_before_the_policy_key() -> None:
    """Old bundles keep their exact bytes: ``policy`` is written only when there is one."""
    before = bytes.fromhex(
        "85a6666f726d6174b9737761726d2d6e6f64652f70726f6f662d62756e646c652f31a767656e65736973c4"
        "0767656e65736973aa7375626d697373696f6ec40a7375626d697373696f6ea776657264696374c40776"
        "657264696374a772656c6174656491c40772656c61746564"
    )
    args = (b"genesis", b"submission", b"verdict", [b"related"])
    assert pack_bundle(*args) == before
    assert pack_bundle(*args, policy=()) == before
    with_policy = msgpack.unpackb(pack_bundle(*args, policy=[b"announcement"]), raw=False)
    assert with_policy["policy"] == [b"announcement"]
    assert {k: v for k, v in with_policy.items() if k != "policy"} == msgpack.unpackb(
        before, raw=False
    )


def test_policy_of_keeps_the_announcement_the_audit_counts() -> None:
    """Of this run, signed by a genesis trainer, of the submission's version; none for a run
    without a quota (its bundles keep their old bytes)."""
    stranger = sign(PolicyAnnouncement(RUN, 0, bytes([6]) * 32, 1), HONEST)
    other_version = sign(PolicyAnnouncement(RUN, 1, MANIFEST, 1), TRAINER)
    held = [b"junk", stranger.raw, other_version.raw, ANNOUNCED.raw]
    assert policy_of(GENESIS, 0, held) == [ANNOUNCED.raw]
    assert policy_of(GENESIS, 2, held) == []
    legacy = create_genesis(
        OWNER,
        name="legacy",
        trainers=[TRAINER.peer_id],
        validators=[VALIDATOR.peer_id],
        params=dataclasses.replace(PARAMS, quota=0),
        created_at=1,
    )
    assert policy_of(legacy, 0, held) == []


def test_audit_of_a_missing_or_foreign_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x93\x01\x02")
    for path in (junk, tmp_path / "missing"):
        with pytest.raises(SystemExit) as done:
            main(["audit", str(path)])
        assert done.value.code == 2
        assert capsys.readouterr().err.startswith("error:")


def test_audit_from_the_swarm_needs_a_run_and_a_valid_bootstrap_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from node.run import write_genesis

    write_genesis(GENESIS, tmp_path / "run.genesis")
    for argv, said in (
        (["audit"], "name what to audit"),
        (["audit", "--run", str(tmp_path / "run.genesis")], "name what to audit"),
        (["audit", "--run", str(tmp_path / "run.genesis"), "--bootstrap", "nonsense"], "nonsense"),
    ):
        with pytest.raises(SystemExit) as done:
            main(argv)
        err = capsys.readouterr().err
        assert done.value.code == 2 and err.startswith("error:") and said in err, err
