"""Bounded evidence (issue 15): pinned evidence within a per-peer and a total budget, a first
slash always kept in full, repeats counted and hashed, newcomers yielding to workers with a
history past the total, summaries served and reported by the audit (which still replays every
slash it holds)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from node.audit import audit_ledger, policy_dir_source
from node.roles.evidence import summary_of
from node.roles.judge import equivocation
from node.roles.verdicts import record_judgement
from node.run import create_genesis
from swarm.errors import ConfigError
from swarm.evidence import EvidenceStore, address_of
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import RolloutSubmission, RunParams, Sample, run_id_of, sign

SLASH = 2500  # what one slash rests on at most, in these tests


def store(tmp_path: Path, peer: int = 3000, total: int = 6000) -> EvidenceStore:
    return EvidenceStore(
        tmp_path / "e.db",
        budget_bytes=10_000,
        peer_budget_bytes=peer,
        pinned_budget_bytes=total,
        slash_bytes=SLASH,
    )


def blob(tag: str, size: int) -> bytes:
    return (tag.encode() * size)[:size]


def test_budgets_smaller_than_one_slash_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must hold one slash"):
        store(tmp_path, peer=SLASH - 1)
    with pytest.raises(ConfigError, match="one peer"):
        store(tmp_path, peer=3000, total=2999)


def test_a_peer_keeps_its_first_slash_in_full_and_the_rest_is_summarized(tmp_path: Path) -> None:
    s = store(tmp_path)
    submission, verdict = blob("sub-a", 2000), blob("ver-a", 400)
    first = [
        s.put(raw, "x", pinned=True, peer="mallory", earned=False) for raw in (submission, verdict)
    ]
    assert all(s.get(i) is not None for i in first) and s.peer_bytes("mallory") == 2400
    second = s.put(blob("sub-b", 2000), "rollout-submission", pinned=True, peer="mallory")
    assert s.get(second) is None and second not in s
    summary = s.summary(second)
    assert summary is not None and summary.size == 2000 and summary.peer == "mallory"
    assert summary.id == address_of(blob("sub-b", 2000)) and "summarized" in summary.describe()
    # Another peer's budget is its own.
    other = s.put(blob("sub-c", 2000), "x", pinned=True, peer="eve", earned=False)
    assert s.get(other) is not None
    usage = s.usage()
    assert usage["pinned_bytes"] == 4400 and usage["summarized_objects"] == 1
    assert usage["summarized_bytes_dropped"] == 2000


def test_repeats_are_counted_and_store_nothing(tmp_path: Path) -> None:
    s = store(tmp_path)
    kept = s.put(blob("k", 2000), "x", pinned=True, peer="mallory")
    dropped = s.put(blob("d", 2000), "x", pinned=True, peer="mallory")
    for _ in range(5):
        s.put(blob("k", 2000), "x", pinned=True, peer="mallory")
        s.put(blob("d", 2000), "x", pinned=True, peer="mallory")
    summary = s.summary(dropped)
    assert summary is not None and summary.seen == 6
    assert s.get(kept) is not None and s.usage()["repeats"] == 10
    assert s.usage()["pinned_bytes"] == 2000 and s.usage()["summarized_objects"] == 1


def test_past_the_total_newcomers_are_summarized_and_yield_to_earned_work(tmp_path: Path) -> None:
    s = store(tmp_path, peer=3000, total=6000)
    a = s.put(blob("a", 2400), "x", pinned=True, peer="sybil-a", earned=False)
    b = s.put(blob("b", 2400), "x", pinned=True, peer="sybil-b", earned=False)
    c = s.put(blob("c", 2400), "x", pinned=True, peer="sybil-c", earned=False)
    assert a in s and b in s and c not in s and s.summary(c) is not None
    # A worker with accepted work is slashed: the newest newcomer's evidence makes room.
    d = s.put(blob("d", 2400), "x", pinned=True, peer="worker", earned=True)
    assert d in s and a in s and b not in s and s.summary(b) is not None
    assert s.usage()["pinned_bytes"] <= 6000
    # Evidence charged to nobody (a policy conflict of genesis trainers) is always kept.
    e = s.put(blob("e", 2400), "policy-conflict", pinned=True)
    assert e in s and s.summary(e) is None


def test_unpinned_evidence_pinned_later_is_charged_to_the_peer(tmp_path: Path) -> None:
    s = store(tmp_path)
    first = s.put(blob("u1", 2000), "x", pinned=False)
    second = s.put(blob("u2", 2000), "x", pinned=False)
    assert s.usage()["bytes"] == 4000
    s.put(blob("u1", 2000), "x", pinned=True, peer="mallory")
    s.put(blob("u2", 2000), "x", pinned=True, peer="mallory")  # over mallory's budget
    assert s.pinned(first) and second not in s and s.summary(second) is not None
    assert s.usage()["bytes"] == 0 and s.peer_bytes("mallory") == 2000


def test_a_store_from_before_the_budgets_opens_and_counts_its_pinned_bytes(
    tmp_path: Path,
) -> None:
    db = sqlite3.connect(tmp_path / "e.db")
    db.execute(
        "CREATE TABLE objects (id BLOB PRIMARY KEY, kind TEXT NOT NULL, size INTEGER NOT NULL,"
        " pinned INTEGER NOT NULL, raw BLOB NOT NULL)"
    )
    old = blob("old", 2000)
    db.execute("INSERT INTO objects VALUES (?, 'x', 2000, 1, ?)", (address_of(old), old))
    db.commit()
    db.close()
    s = store(tmp_path)
    assert s.get(address_of(old)) == old and s.usage()["pinned_bytes"] == 2000
    assert s.put(blob("new", 2000), "x", pinned=True, peer="p", earned=False) in s


def test_a_summary_travels_in_the_evidence_protocol_refusal() -> None:
    object_id = b"\x07" * 32
    refusal = "peer X refused /swarm-node/r/evidence/1: summarized rollout-submission 8388608 3"
    summary = summary_of(object_id, refusal)
    assert summary is not None and (summary.kind, summary.size, summary.seen) == (
        "rollout-submission",
        8388608,
        3,
    )
    assert summary_of(object_id, "peer X refused /swarm-node/r/evidence/1: not held") is None


OWNER, VALIDATOR = NodeKey.from_seed(b"\x51" * 32), NodeKey.from_seed(b"\x52" * 32)
PARAMS = RunParams(group_size=2, batch_prompts=1, max_tokens=4)


def _submission(run_id: str, key: NodeKey, created_at: int, size: int) -> object:
    sample = Sample("0", (1, 2, 3), 7, (b"p" * size,), "length")
    return sign(RolloutSubmission(run_id, 0, 0, ("0",), (sample,), created_at), key)


def test_the_audit_replays_every_held_slash_and_names_the_summarized_one(tmp_path: Path) -> None:
    """Three equivocators (no model needed to replay): the first two newcomers' evidence is
    held, the third passes the total budget and is summarized. The audit agrees with the two
    held slashes and reports the third as summarized (unchecked), naming its submission."""
    genesis = create_genesis(
        OWNER,
        name="budget",
        trainers=[OWNER.peer_id],
        validators=[VALIDATOR.peer_id],
        params=PARAMS,
        created_at=1,
    )
    run_id = run_id_of(genesis)
    ledger = LedgerStore(tmp_path / "ledger.db", genesis)
    evidence = EvidenceStore(
        tmp_path / "evidence.db",
        peer_budget_bytes=6000,
        pinned_budget_bytes=12_000,
        slash_bytes=6000,
    )
    summarized = []
    for i in range(3):
        key = NodeKey.from_seed(bytes([0x60 + i]) * 32)
        a, b = _submission(run_id, key, 1, 2000), _submission(run_id, key, 2, 2000)
        judgement = equivocation(b, a)  # type: ignore[arg-type]
        assert judgement is not None
        record_judgement(
            ledger,
            evidence,
            VALIDATOR,
            b,
            judgement,
            PARAMS,
            related=[a],
            earned=False,  # type: ignore[arg-type]
        )
        if i == 2:
            summarized.append(b.id)  # type: ignore[attr-defined]
    ledger.close()
    rows = audit_ledger(
        tmp_path / "ledger.db", policy_dir_source(None), credits=0, evidence=evidence
    )
    by_check = [
        (r.check, r.ok) for r in rows if r.check not in ("signature and rules", "fold", "sample")
    ]
    assert by_check.count(("equivocation", True)) == 2
    dropped = [r for r in rows if r.check == "evidence summarized"]
    assert len(dropped) == 1 and dropped[0].ok is None
    assert summarized[0].hex() in dropped[0].detail
    assert not [r for r in rows if r.ok is False]
