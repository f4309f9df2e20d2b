"""The ledger: who may sign what for how much, a fold that ignores order and duplicates and counts
one credit per assignment, a store that keeps balances incrementally, keeps batches whole and
survives kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.run import create_genesis, write_genesis
from swarm.errors import NotAuthorizedError, StorageError, ValidationError
from swarm.identity import NodeKey
from swarm.ledger import EQUIVOCATION, Balances, LedgerStore, check_event, fold
from swarm.ledger.recheck import recheck
from swarm.ledger.rules import VerdictFacts
from swarm.ledger.store import SCHEMA_VERSION
from swarm.ledger.views import read_quota_use
from swarm.messages import LedgerEvent, RunParams, Signed, Verdict, decode, run_id_of, sign

OWNER = NodeKey.from_seed(b"\x01" * 32)
VALIDATOR = NodeKey.from_seed(b"\x02" * 32)
OTHER_VALIDATOR = NodeKey.from_seed(b"\x04" * 32)
TRAINER = NodeKey.from_seed(b"\x03" * 32)
WORKERS = [NodeKey.from_seed(bytes([10 + i]) * 32).peer_id for i in range(3)]
GENESIS = create_genesis(
    OWNER,
    name="t",
    trainers=[TRAINER.peer_id],
    validators=[VALIDATOR.peer_id, OTHER_VALIDATOR.peer_id],
    params=RunParams(initial_balance=100, ban_threshold=0, slash_amount=1000),
    created_at=1,
)
RUN = run_id_of(GENESIS)


def verdict(
    worker: str,
    *,
    counter: int = 0,
    accepted: bool = True,
    samples: int = 2,
    by: NodeKey = VALIDATOR,
    version: int = 0,
    reasons: tuple[str, ...] = (),
    submission: bytes = b"",
    run: str = RUN,
) -> Signed[Verdict]:
    severity = "none" if accepted else "hard"
    sub = submission or bytes([counter % 256]) * 32
    rewards = (1,) * samples if accepted else ()
    return sign(
        Verdict(run, sub, worker, accepted, severity, reasons, rewards, 1, {}, version, counter),  # type: ignore[arg-type]
        by,
    )


def event(
    kind: str,
    peer: str,
    amount: int,
    evidence: bytes,
    *,
    by: NodeKey = VALIDATOR,
    run: str = RUN,
    at: int = 1,
    related: tuple[bytes, ...] = (),
) -> Signed[LedgerEvent]:
    return sign(
        LedgerEvent(
            run_id=run,
            event=kind,  # type: ignore[arg-type]
            peer=peer,
            amount=amount,
            evidence=evidence,
            created_at=at,
            related=related,
        ),
        by,
    )


def credit(
    worker: str, counter: int = 0, *, samples: int = 2, by: NodeKey = VALIDATOR, at: int = 1
) -> tuple[Signed[Verdict], Signed[LedgerEvent]]:
    """An accepted verdict and its credit (``credit_per_sample`` is 1 in GENESIS)."""
    v = verdict(worker, counter=counter, samples=samples, by=by)
    return v, event("credit", worker, samples, v.id, by=by, at=at)


def slash(
    worker: str, counter: int = 0, *, by: NodeKey = VALIDATOR, at: int = 1
) -> tuple[Signed[Verdict], Signed[LedgerEvent]]:
    v = verdict(worker, counter=counter, accepted=False, by=by)
    return v, event("slash", worker, 1000, v.id, by=by, at=at)


@pytest.fixture
def store(tmp_path: Path) -> LedgerStore:
    return LedgerStore(tmp_path / "ledger.db", GENESIS)


def fold_of(pairs: list[tuple[Signed[Verdict], Signed[LedgerEvent]]]) -> Balances:
    facts = {v.id: VerdictFacts.of(v) for v, _ in pairs}
    entries = [check_event(e, GENESIS, facts.get) for _, e in pairs]
    return fold(entries, GENESIS.message.params)


def test_newcomer_starts_at_the_initial_balance() -> None:
    balances = fold([], GENESIS.message.params)
    assert balances.of(WORKERS[0]) == 100 and not balances.banned(WORKERS[0])


def test_hard_slash_bans(store: LedgerStore) -> None:
    v, e = slash(WORKERS[0])
    store.add([e], verdicts=[v])
    assert store.balance(WORKERS[0]) == -900 and store.balances().banned(WORKERS[0])
    assert store.banned() == [WORKERS[0]]


def test_one_assignment_is_credited_once_whichever_validator_judged_it(store: LedgerStore) -> None:
    first = credit(WORKERS[0], counter=7, by=VALIDATOR)
    second = credit(WORKERS[0], counter=7, by=OTHER_VALIDATOR)
    again = (first[0], event("credit", WORKERS[0], 2, first[0].id, at=99))  # re-signed
    for v, e in (first, second, again):
        store.add([e], verdicts=[v])
    assert len(store) == 3 and store.balance(WORKERS[0]) == 102
    winner = min(e.id for _, e in (first, second, again))
    assert [r.id for r in store.page() if r.counted] == [winner]


def test_a_judged_cheat_and_an_equivocation_of_one_assignment_slash_once(
    store: LedgerStore,
) -> None:
    v1, e1 = slash(WORKERS[1], counter=3)
    eq = verdict(WORKERS[1], counter=3, accepted=False, by=OTHER_VALIDATOR, reasons=(EQUIVOCATION,))
    e2 = event("slash", WORKERS[1], 1000, eq.id, by=OTHER_VALIDATOR, related=(b"\x09" * 32,))
    store.add([e1, e2], verdicts=[v1, eq])
    assert store.balance(WORKERS[1]) == 100 - 1000


def test_an_equivocation_slash_must_name_the_other_submission(store: LedgerStore) -> None:
    eq = verdict(WORKERS[1], counter=3, accepted=False, reasons=(EQUIVOCATION,))
    with pytest.raises(ValidationError, match="other submission"):
        store.add([event("slash", WORKERS[1], 1000, eq.id)], verdicts=[eq])
    with pytest.raises(ValidationError, match="other submission"):
        store.add(
            [event("slash", WORKERS[1], 1000, eq.id, related=(eq.message.submission_id,))],
            verdicts=[eq],
        )


@pytest.mark.parametrize(
    ("kind", "amount", "accepted", "why"),
    [
        ("credit", 3, True, "earn 2"),
        ("credit", 0, True, "earn 2"),
        ("slash", 999, False, "slash_amount is 1000"),
        ("credit", 2, False, "rejected the work"),
        ("slash", 1000, True, "not a hard rejection"),
    ],
)
def test_an_amount_or_verdict_that_breaks_the_rules_is_refused_with_the_reason(
    store: LedgerStore, kind: str, amount: int, accepted: bool, why: str
) -> None:
    v = verdict(WORKERS[0], accepted=accepted)
    with pytest.raises(ValidationError, match=why):
        store.add([event(kind, WORKERS[0], amount, v.id)], verdicts=[v])
    assert len(store) == 0 and store.verdict_facts(v.id) is None  # nothing written


def test_an_event_signed_by_another_than_its_verdicts_signer_is_refused(
    store: LedgerStore,
) -> None:
    v = verdict(WORKERS[0])
    with pytest.raises(NotAuthorizedError, match="its verdict by someone else"):
        store.add([event("credit", WORKERS[0], 2, v.id, by=OTHER_VALIDATOR)], verdicts=[v])


def test_an_event_about_another_worker_than_its_verdict_is_refused(store: LedgerStore) -> None:
    v = verdict(WORKERS[0])
    with pytest.raises(ValidationError, match="cites a verdict about"):
        store.add([event("credit", WORKERS[1], 2, v.id)], verdicts=[v])


def test_an_event_waits_for_its_verdict_then_counts(store: LedgerStore) -> None:
    v, e = credit(WORKERS[0])
    assert store.add([e]) == []
    assert store.pending_count() == 1 and len(store) == 0
    assert store.balance(WORKERS[0]) == 100
    assert store.add_verdict(v) is True
    assert store.pending_count() == 0 and len(store) == 1
    assert store.balance(WORKERS[0]) == 102


def test_a_pending_event_with_a_wrong_amount_is_dropped_when_its_verdict_comes(
    store: LedgerStore,
) -> None:
    v = verdict(WORKERS[0])
    store.add([event("credit", WORKERS[0], 50, v.id)])
    store.add_verdict(v)
    assert store.pending_count() == 0 and len(store) == 0
    assert store.balance(WORKERS[0]) == 100
    assert store.status(WORKERS[0])["refused_pending"] == 1


def test_a_dispute_changes_no_balance_and_is_listed(store: LedgerStore) -> None:
    accepted, credited = credit(WORKERS[0], counter=1, by=VALIDATOR)
    contrary = verdict(
        WORKERS[0],
        counter=1,
        accepted=False,
        by=OTHER_VALIDATOR,
        submission=accepted.message.submission_id,
    )
    dispute = event(
        "dispute", VALIDATOR.peer_id, 0, contrary.id, by=OTHER_VALIDATOR, related=(accepted.id,)
    )
    store.add([credited, dispute], verdicts=[accepted, contrary])
    assert store.balance(WORKERS[0]) == 102 and store.balance(VALIDATOR.peer_id) == 100
    assert [d.id for d in store.disputes()] == [dispute.id] and store.dispute_count() == 1


def test_a_dispute_must_reject_another_validators_accepted_verdict(store: LedgerStore) -> None:
    accepted, _ = credit(WORKERS[0], counter=1, by=VALIDATOR)
    own = verdict(WORKERS[0], counter=1, accepted=False, by=VALIDATOR)
    with pytest.raises(ValidationError, match="its own verdict"):
        store.add(
            [event("dispute", VALIDATOR.peer_id, 0, own.id, related=(accepted.id,))],
            verdicts=[accepted, own],
        )
    other = verdict(WORKERS[0], counter=2, accepted=False, by=OTHER_VALIDATOR)
    with pytest.raises(ValidationError, match="different submissions"):
        store.add(
            [
                event(
                    "dispute",
                    VALIDATOR.peer_id,
                    0,
                    other.id,
                    by=OTHER_VALIDATOR,
                    related=(accepted.id,),
                )
            ],
            verdicts=[accepted, other],
        )


def test_grant_needs_the_run_owner(store: LedgerStore) -> None:
    store.add([event("grant", WORKERS[0], 50, b"g", by=OWNER)])
    with pytest.raises(NotAuthorizedError, match="not the run owner"):
        store.add([event("grant", WORKERS[0], 50, b"g2", by=VALIDATOR)])
    assert store.balance(WORKERS[0]) == 150


def test_credit_or_slash_by_a_non_validator_is_refused(store: LedgerStore) -> None:
    for kind in ("credit", "slash"):
        with pytest.raises(NotAuthorizedError, match="not a genesis validator"):
            store.add([event(kind, WORKERS[0], 1, b"x", by=TRAINER)])
    assert len(store) == 0


def test_event_of_another_run_is_refused(store: LedgerStore) -> None:
    with pytest.raises(ValidationError):
        store.add([event("credit", WORKERS[0], 1, b"x", run="f" * 32)])


def test_a_bad_event_keeps_the_whole_batch_out(store: LedgerStore) -> None:
    v, good = credit(WORKERS[0])
    with pytest.raises(NotAuthorizedError):
        store.add([good, event("credit", WORKERS[1], 1, b"b", by=TRAINER)], verdicts=[v])
    assert len(store) == 0


def test_add_is_idempotent(store: LedgerStore) -> None:
    v, e = credit(WORKERS[0], samples=3)
    assert store.add([e], verdicts=[v]) == [e]
    assert store.add([e], verdicts=[v]) == []
    assert len(store) == 1 and store.balances().of(WORKERS[0]) == 103


PAIRS = [
    *(
        credit(w, c, by=k, at=a)
        for w in WORKERS[:2]
        for c in range(2)
        for k in (VALIDATOR, OTHER_VALIDATOR)
        for a in (1, 2)
    ),
    *(slash(w, c, by=k) for w in WORKERS[1:] for c in (1, 5) for k in (VALIDATOR, OTHER_VALIDATOR)),
]


@given(data=st.data())
def test_any_order_and_duplication_gives_the_same_balances_and_the_store_equals_the_fold(
    data: st.DataObject,
) -> None:
    chosen = data.draw(st.lists(st.sampled_from(PAIRS), max_size=30))
    shuffled = data.draw(st.permutations(chosen))
    assert dict(fold_of(chosen).by_peer) == dict(fold_of(shuffled).by_peer)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        store = LedgerStore(Path(tmp) / "l.db", GENESIS)
        for v, e in shuffled:  # one event per batch, any order, duplicates included
            if data.draw(st.booleans()):
                store.add([e])  # the event first: it waits for its verdict
                store.add_verdict(v)
            else:
                store.add([e], verdicts=[v])
        assert store.stored_balances() == dict(fold_of(chosen).by_peer)
        check = recheck(store)
        assert not check.refused and not check.balance_errors
        store.close()


def test_the_audit_recheck_catches_a_balance_edited_in_the_file(store: LedgerStore) -> None:
    v, e = credit(WORKERS[0])
    store.add([e], verdicts=[v])
    store._db.execute("UPDATE balances SET balance = 5000")
    assert recheck(store).balance_errors


def test_replicas_converge_by_exchanging_missing_events(tmp_path: Path) -> None:
    a = LedgerStore(tmp_path / "a.db", GENESIS)
    b = LedgerStore(tmp_path / "b.db", GENESIS)
    shared, only_a, only_b = credit(WORKERS[0]), slash(WORKERS[1]), credit(WORKERS[2], samples=7)
    a.add([shared[1], only_a[1]], verdicts=[shared[0], only_a[0]])
    b.add([shared[1], only_b[1]], verdicts=[shared[0], only_b[0]])
    for src, dst in ((a, b), (b, a)):
        for eid in src.ids() - dst.ids():
            for raw, verdicts in src.with_verdicts(eid):
                dst.add([decode(raw, LedgerEvent)], [decode(r, Verdict) for r in verdicts])
    assert a.ids() == b.ids() and a.stored_balances() == b.stored_balances()
    assert a.balances().banned(WORKERS[1]) and a.balance(WORKERS[2]) == 107


def test_a_ledger_of_another_run_is_refused(tmp_path: Path) -> None:
    LedgerStore(tmp_path / "l.db", GENESIS).close()
    other = create_genesis(
        OWNER, name="other", trainers=[TRAINER.peer_id], validators=[VALIDATOR.peer_id]
    )
    with pytest.raises(StorageError, match="another run"):
        LedgerStore(tmp_path / "l.db", other)


def test_open_existing_refuses_what_is_not_a_ledger(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(StorageError):
        LedgerStore.open_existing(junk)
    with pytest.raises(StorageError):
        LedgerStore.open_existing(tmp_path / "missing.db")


_WRITER = """
import sys
from pathlib import Path
from typing import Any
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import LedgerEvent, RunGenesis, Verdict, decode, sign, run_id_of
genesis = decode(Path(sys.argv[2]).read_bytes(), RunGenesis)
store = LedgerStore(Path(sys.argv[1]), genesis)
key = NodeKey.from_seed(b"\\x02" * 32)
run, worker = run_id_of(genesis), sys.argv[3]
i = 0
while True:
    verdicts = [sign(Verdict(run, bytes(32), worker, True, "none", (), (1,), 1, {}, 0, i * 10 + j),
                     key) for j in range(10)]
    events = [sign(LedgerEvent(run, "credit", worker, 1, v.id, i), key) for v in verdicts]
    store.add(events, verdicts=verdicts)
    i += 1
    if i == 5:
        print("ready", flush=True)
"""


def test_store_survives_kill_9_with_whole_batches(tmp_path: Path) -> None:
    genesis_file = tmp_path / "g"
    write_genesis(GENESIS, genesis_file)
    db = tmp_path / "ledger.db"
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(db), str(genesis_file), WORKERS[0]],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    store = LedgerStore.open_existing(db)
    count = len(store)
    assert count >= 50 and count % 10 == 0  # only whole batches, never half of one
    assert store.balance(WORKERS[0]) == 100 + count
    assert not recheck(store).balance_errors


def _verdict(by: NodeKey, *, run: str = RUN, accepted: bool = True) -> Signed[Verdict]:
    return sign(
        Verdict(run, bytes(32), WORKERS[0], accepted, "none", (), (500_000, 0), 5, {}, 3, 7),
        by,
    )


def test_a_validators_verdict_is_kept_once_with_its_version_and_counter(tmp_path: Path) -> None:
    store = LedgerStore(tmp_path / "l.db", GENESIS)
    verdict = _verdict(VALIDATOR)
    assert store.add_verdict(verdict) is True
    assert store.add_verdict(verdict) is False
    row = store._db.execute(
        "SELECT worker, accepted, samples, reward_sum, policy_version, counter FROM verdicts"
    ).fetchall()
    assert row == [(WORKERS[0], 1, 2, 500_000, 3, 7)]


def test_a_ledger_from_before_the_version_index_gains_it_at_open(tmp_path: Path) -> None:
    """``read_quota_use`` reads the verdicts of the newest versions through ``verdicts_version``
    (no scan of every verdict); a ledger file written before the index gets it when a node
    opens it (``IF NOT EXISTS`` at open), with its layout version unchanged."""
    store = LedgerStore(tmp_path / "l.db", GENESIS)
    store.add_verdict(_verdict(VALIDATOR))
    store._db.execute("DROP INDEX verdicts_version")  # as a file written before the index
    store.close()
    store = LedgerStore(tmp_path / "l.db", GENESIS)
    indexes = {r[0] for r in store._db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "verdicts_version" in indexes
    assert dict(store._db.execute("SELECT key, value FROM meta"))["schema"] == SCHEMA_VERSION
    plans = [
        " ".join(str(r[-1]) for r in store._db.execute("EXPLAIN QUERY PLAN " + sql, args))
        for sql, args in (
            ("SELECT coalesce(max(policy_version), -1) FROM verdicts", ()),
            (
                "SELECT worker, policy_version, counter, accepted FROM verdicts"
                " WHERE policy_version > ? AND counter >= 0",
                (0,),
            ),
        )
    ]
    assert all("verdicts_version" in plan for plan in plans), plans
    store.close()
    tally = read_quota_use(tmp_path / "l.db", quota=64, keep=2)
    assert [(u.worker, u.version, u.submitted) for u in tally.rows()] == [(WORKERS[0], 3, 1)]


def test_a_verdict_from_a_non_validator_or_another_run_is_refused(tmp_path: Path) -> None:
    store = LedgerStore(tmp_path / "l.db", GENESIS)
    with pytest.raises(NotAuthorizedError):
        store.add_verdict(_verdict(TRAINER))
    with pytest.raises(ValidationError):
        store.add_verdict(_verdict(VALIDATOR, run="0" * 32))
    assert store._db.execute("SELECT count(*) FROM verdicts").fetchone() == (0,)


def test_ledger_show_pages_through_events_and_lists_disputes(
    store: LedgerStore, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from cli.app import main

    pairs = [credit(WORKERS[i % 3], i) for i in range(5)]
    accepted, _ = pairs[0]
    contrary = verdict(
        WORKERS[0],
        counter=0,
        accepted=False,
        by=OTHER_VALIDATOR,
        submission=accepted.message.submission_id,
    )
    dispute = event(
        "dispute", VALIDATOR.peer_id, 0, contrary.id, by=OTHER_VALIDATOR, related=(accepted.id,)
    )
    store.add([e for _, e in pairs] + [dispute], verdicts=[v for v, _ in pairs] + [contrary])
    db = str(store.path)

    def show(*args: str) -> dict[str, Any]:
        with pytest.raises(SystemExit) as done:
            main(["ledger", "show", "--db", db, "--json", *args])
        assert done.value.code == 0
        return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]

    first = show("--limit", "4")
    assert first["events_total"] == 6 and len(first["events"]) == 4
    assert [d["id"] for d in first["disputes"]] == [dispute.id.hex()]
    rest = show("--limit", "4", "--before", first["next_before"])
    assert len(rest["events"]) == 2 and rest["next_before"] is None
    seen = [e["id"] for e in first["events"] + rest["events"]]
    assert sorted(seen, reverse=True) == seen and len(set(seen)) == 6
    with pytest.raises(SystemExit) as bad:
        main(["ledger", "show", "--db", db, "--before", "not-hex"])
    assert bad.value.code == 2 and "not a hex event id" in capsys.readouterr().err
