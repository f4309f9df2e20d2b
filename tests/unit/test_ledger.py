"""The ledger: who may sign what, a fold that ignores order and duplicates, a store that keeps
batches whole and survives kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.run import create_genesis, write_genesis
from swarm.errors import NotAuthorizedError, StorageError, ValidationError
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore, fold
from swarm.messages import LedgerEvent, RunParams, Signed, Verdict, run_id_of, sign

OWNER = NodeKey.from_seed(b"\x01" * 32)
VALIDATOR = NodeKey.from_seed(b"\x02" * 32)
TRAINER = NodeKey.from_seed(b"\x03" * 32)
WORKERS = [NodeKey.from_seed(bytes([10 + i]) * 32).peer_id for i in range(3)]
GENESIS = create_genesis(
    OWNER,
    name="t",
    trainers=[TRAINER.peer_id],
    validators=[VALIDATOR.peer_id],
    params=RunParams(initial_balance=100, ban_threshold=0, slash_amount=1000),
    created_at=1,
)
RUN = run_id_of(GENESIS)


def event(
    kind: str,
    peer: str,
    amount: int,
    evidence: bytes,
    *,
    by: NodeKey = VALIDATOR,
    run: str = RUN,
    at: int = 1,
) -> Signed[LedgerEvent]:
    return sign(
        LedgerEvent(
            run_id=run,
            event=kind,
            peer=peer,
            amount=amount,  # type: ignore[arg-type]
            evidence=evidence,
            created_at=at,
        ),
        by,
    )


@pytest.fixture
def store(tmp_path: Path) -> LedgerStore:
    return LedgerStore(tmp_path / "ledger.db", GENESIS)


def test_newcomer_starts_at_the_initial_balance() -> None:
    balances = fold([], GENESIS.message.params)
    assert balances.of(WORKERS[0]) == 100 and not balances.banned(WORKERS[0])


def test_hard_slash_bans() -> None:
    balances = fold([event("slash", WORKERS[0], 1000, b"e1")], GENESIS.message.params)
    assert balances.of(WORKERS[0]) == -900 and balances.banned(WORKERS[0])


def test_same_evidence_counts_once_even_when_signed_twice() -> None:
    twice = [
        event("credit", WORKERS[0], 5, b"v1", at=1),
        event("credit", WORKERS[0], 5, b"v1", at=2),
    ]
    assert twice[0].id != twice[1].id
    assert fold(twice, GENESIS.message.params).of(WORKERS[0]) == 105


@given(
    spec=st.lists(
        st.tuples(
            st.sampled_from(["credit", "slash"]),
            st.sampled_from(WORKERS),
            st.integers(0, 50),
            st.binary(min_size=1, max_size=2),
        ),
        max_size=12,
    ),
    data=st.data(),
)
def test_fold_ignores_order(spec: list[tuple[str, str, int, bytes]], data: st.DataObject) -> None:
    events = [event(k, p, a, e, at=i) for i, (k, p, a, e) in enumerate(spec)]
    shuffled = data.draw(st.permutations(events))
    params = GENESIS.message.params
    assert fold(events, params) == fold(shuffled, params)


def test_grant_needs_the_run_owner(store: LedgerStore) -> None:
    store.add([event("grant", WORKERS[0], 50, b"g", by=OWNER)])
    with pytest.raises(NotAuthorizedError, match="not the run owner"):
        store.add([event("grant", WORKERS[0], 50, b"g2", by=VALIDATOR)])


def test_credit_or_slash_by_a_non_validator_is_refused(store: LedgerStore) -> None:
    for kind in ("credit", "slash"):
        with pytest.raises(NotAuthorizedError, match="not a genesis validator"):
            store.add([event(kind, WORKERS[0], 1, b"x", by=TRAINER)])
    assert len(store) == 0


def test_event_of_another_run_is_refused(store: LedgerStore) -> None:
    with pytest.raises(ValidationError):
        store.add([event("credit", WORKERS[0], 1, b"x", run="f" * 32)])


def test_a_bad_event_keeps_the_whole_batch_out(store: LedgerStore) -> None:
    good = event("credit", WORKERS[0], 1, b"a")
    with pytest.raises(NotAuthorizedError):
        store.add([good, event("credit", WORKERS[1], 1, b"b", by=TRAINER)])
    assert len(store) == 0


def test_add_is_idempotent(store: LedgerStore) -> None:
    e = event("credit", WORKERS[0], 3, b"a")
    assert store.add([e]) == [e]
    assert store.add([e]) == []
    assert len(store) == 1 and store.balances().of(WORKERS[0]) == 103


def test_replicas_converge_by_exchanging_missing_events(tmp_path: Path) -> None:
    a = LedgerStore(tmp_path / "a.db", GENESIS)
    b = LedgerStore(tmp_path / "b.db", GENESIS)
    a.add([event("credit", WORKERS[0], 2, b"1"), event("slash", WORKERS[1], 1000, b"2")])
    b.add([event("credit", WORKERS[0], 2, b"1"), event("credit", WORKERS[2], 7, b"3")])
    from swarm.messages import decode

    b.add(decode(r, LedgerEvent) for r in a.raw_events(a.ids() - b.ids()))
    a.add(decode(r, LedgerEvent) for r in b.raw_events(b.ids() - a.ids()))
    assert a.ids() == b.ids() and a.balances() == b.balances()
    assert a.balances().banned(WORKERS[1])


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
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.messages import LedgerEvent, RunGenesis, decode, sign, run_id_of
genesis = decode(Path(sys.argv[2]).read_bytes(), RunGenesis)
store = LedgerStore(Path(sys.argv[1]), genesis)
key = NodeKey.from_seed(b"\\x02" * 32)
i = 0
while True:
    batch = [sign(LedgerEvent(run_id=run_id_of(genesis), event="credit", peer=sys.argv[3],
                              amount=1, evidence=f"{i}-{j}".encode(), created_at=i), key)
             for j in range(10)]
    store.add(batch)
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
    assert store.balances().of(WORKERS[0]) == 100 + count


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


def test_a_verdict_from_a_non_validator_or_another_run_is_refused(tmp_path: Path) -> None:
    store = LedgerStore(tmp_path / "l.db", GENESIS)
    with pytest.raises(NotAuthorizedError):
        store.add_verdict(_verdict(TRAINER))
    with pytest.raises(ValidationError):
        store.add_verdict(_verdict(VALIDATOR, run="0" * 32))
    assert store._db.execute("SELECT count(*) FROM verdicts").fetchone() == (0,)
