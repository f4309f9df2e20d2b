"""Ledger sync by range reconciliation (``swarm.ledger.sync``) between two stores, through a
direct ``ask``: replicas converge whatever each holds, every message stays under its bound, the
bytes follow the difference rather than the ledger, and what the rules refuse is never kept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.ledger import LedgerStore
from swarm.ledger.reconcile import RangeIndex, bounds, fingerprint, summarise
from swarm.ledger.sync import MAX_ANSWER, MAX_REQUEST, Ask, pull, serve
from swarm.messages import LedgerEvent, Signed, Verdict, sign
from tests.unit.test_ledger import GENESIS, OTHER_VALIDATOR, RUN, VALIDATOR, WORKERS, credit

Pair = tuple[Signed[Verdict], Signed[LedgerEvent]]
PAIRS: list[Pair] = [credit(WORKERS[i % 3], i, by=VALIDATOR) for i in range(400)]


def direct(store: LedgerStore, sizes: list[tuple[int, int]] | None = None) -> Ask:
    async def ask(body: bytes) -> bytes:
        answer = serve(store, body)
        if sizes is not None:
            sizes.append((len(body), len(answer)))
        return answer

    return ask


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[LedgerStore, LedgerStore]]:
    a = LedgerStore(tmp_path / "a.db", GENESIS)
    b = LedgerStore(tmp_path / "b.db", GENESIS)
    yield a, b
    a.close()
    b.close()


def fill(store: LedgerStore, pairs: list[Pair]) -> None:
    store.add([e for _, e in pairs], verdicts=[v for v, _ in pairs])


def test_prefix_bounds_cover_exactly_their_ids() -> None:
    assert bounds("") == (b"", None)
    assert bounds("3") == (b"\x30", b"\x40") and bounds("f") == (b"\xf0", None)
    assert bounds("3f") == (b"\x3f", b"\x40") and bounds("ff") == (b"\xff", None)
    assert bounds("abc") == (b"\xab\xc0", b"\xab\xd0")


def test_an_index_scanned_in_a_snapshot_catches_up_on_adoption(
    stores: tuple[LedgerStore, LedgerStore],
) -> None:
    a, _ = stores
    fill(a, PAIRS[:200])
    index, upto = LedgerStore.scan_index(a.path)
    fill(a, PAIRS[200:])  # stored after the snapshot
    a.adopt_index(index, upto)
    ids = [e.id for _, e in PAIRS]
    for prefix in ("", "7", "c0"):
        assert a.range_summary(prefix) == summarise(i for i in ids if i.hex().startswith(prefix))


def test_the_range_index_agrees_with_a_scan() -> None:
    ids = [e.id for _, e in PAIRS]
    index = RangeIndex(ids)
    for prefix in ("", "a", "3f", "3f0", "0000"):
        inside = [i for i in ids if i.hex().startswith(prefix)]
        assert index.summary(prefix) == summarise(inside)
    assert fingerprint(*summarise(ids)) != fingerprint(*summarise(ids[1:]))


async def test_a_replica_pulls_every_missing_event_with_its_verdict(
    stores: tuple[LedgerStore, LedgerStore],
) -> None:
    a, b = stores
    fill(a, PAIRS)
    fill(b, PAIRS[::7])
    result = await pull(b, direct(a))
    assert b.ids() == a.ids() and b.stored_balances() == a.stored_balances()
    assert result.added == len(PAIRS) - len(PAIRS[::7]) and not result.refused
    assert b.pending_count() == 0


async def test_replicas_in_sync_exchange_one_small_round_trip(
    stores: tuple[LedgerStore, LedgerStore],
) -> None:
    a, b = stores
    fill(a, PAIRS)
    fill(b, PAIRS)
    sizes: list[tuple[int, int]] = []
    result = await pull(b, direct(a, sizes))
    assert result.round_trips == 1 and result.added == 0
    assert sizes[0][0] < 64 and sizes[0][1] == 1  # an empty array: nothing differs


async def test_sync_sends_in_proportion_to_the_difference_not_the_ledger(
    stores: tuple[LedgerStore, LedgerStore],
) -> None:
    a, b = stores
    fill(a, PAIRS)
    missing = PAIRS[::100]
    fill(b, [p for p in PAIRS if p not in missing])
    sizes: list[tuple[int, int]] = []
    await pull(b, direct(a, sizes))
    assert b.ids() == a.ids()
    missing_bytes = sum(len(v.raw) + len(e.raw) for v, e in missing)
    assert sum(s + r for s, r in sizes) <= 2 * missing_bytes


async def test_every_message_stays_under_its_bound(
    stores: tuple[LedgerStore, LedgerStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    import swarm.ledger.sync as sync

    a, b = stores
    fill(a, PAIRS)
    # Shrink the bounds so that 400 events need several rounds of each kind.
    monkeypatch.setattr(sync, "MAX_RANGES", 4)
    monkeypatch.setattr(sync, "MAX_GET", 16)
    monkeypatch.setattr(sync, "ANSWER_BUDGET", 4096)
    sizes: list[tuple[int, int]] = []
    result = await pull(b, direct(a, sizes))
    assert b.ids() == a.ids() and result.added == len(PAIRS)
    assert all(s <= MAX_REQUEST and r <= MAX_ANSWER for s, r in sizes)
    assert max(r for _, r in sizes) < 4096 + 2048  # the get answers stopped near the budget


async def test_an_event_with_a_changed_amount_is_refused_and_counted(
    stores: tuple[LedgerStore, LedgerStore],
) -> None:
    a, b = stores
    verdict, _ = PAIRS[0]
    forged = sign(LedgerEvent(RUN, "credit", WORKERS[0], 50, verdict.id, 1), VALIDATOR)
    fill(a, PAIRS[1:3])
    a._db.execute(  # mallory's store holds an event no honest store would take
        "INSERT INTO events VALUES (?, 'credit', ?, 50, ?, ?, 1, 'x', 50, 1, ?)",
        (forged.id, WORKERS[0], verdict.id, VALIDATOR.peer_id, forged.raw),
    )
    a.add_verdict(verdict)
    a._index = None
    result = await pull(b, direct(a))
    assert forged.id not in b.ids() and len(b) == 2
    assert result.refused_count == 1 and "earn 2" in result.refused[0]
    assert b.balance(WORKERS[0]) == 100 + 2 * sum(
        1 for v, e in PAIRS[1:3] if e.message.peer == WORKERS[0]
    )


async def test_a_dispute_travels_with_both_of_its_verdicts(
    stores: tuple[LedgerStore, LedgerStore],
) -> None:
    from tests.unit.test_ledger import event, verdict

    a, b = stores
    accepted, credited = PAIRS[5]
    contrary = verdict(
        accepted.message.worker,
        counter=5,
        accepted=False,
        by=OTHER_VALIDATOR,
        submission=accepted.message.submission_id,
    )
    dispute = event(
        "dispute", VALIDATOR.peer_id, 0, contrary.id, by=OTHER_VALIDATOR, related=(accepted.id,)
    )
    a.add([credited, dispute], verdicts=[accepted, contrary])
    await pull(b, direct(a))
    assert b.ids() == a.ids() and b.dispute_count() == 1


@settings(max_examples=25, deadline=None)
@given(data=st.data())
async def test_after_pulling_both_ways_two_replicas_hold_the_union(data: st.DataObject) -> None:
    import tempfile

    left = data.draw(st.sets(st.integers(0, len(PAIRS) - 1), max_size=120))
    right = data.draw(st.sets(st.integers(0, len(PAIRS) - 1), max_size=120))
    with tempfile.TemporaryDirectory() as tmp:
        a = LedgerStore(Path(tmp) / "a.db", GENESIS)
        b = LedgerStore(Path(tmp) / "b.db", GENESIS)
        fill(a, [PAIRS[i] for i in sorted(left)])
        fill(b, [PAIRS[i] for i in sorted(right)])
        await pull(a, direct(b))
        await pull(b, direct(a))
        union = {PAIRS[i][1].id for i in left | right}
        assert a.ids() == b.ids() == union
        assert a.stored_balances() == b.stored_balances()
        a.close()
        b.close()


_SYNCING_REPLICA = """
import sys, time
from pathlib import Path
import trio
import swarm.ledger.sync as sync
from swarm.ledger import LedgerStore
from swarm.messages import RunGenesis, decode
genesis = decode(Path(sys.argv[3]).read_bytes(), RunGenesis)
source, replica = LedgerStore(Path(sys.argv[1]), genesis), LedgerStore(Path(sys.argv[2]), genesis)
sync.MAX_GET = 10  # many small get rounds, each its own transaction
told = False

async def ask(body: bytes) -> bytes:
    global told
    if not told and len(replica) >= 30:  # some get rounds have landed
        print("syncing", flush=True)
        told = True
    time.sleep(0.02)
    return sync.serve(source, body)

trio.run(sync.pull, replica, ask)
print("done", flush=True)
"""


async def test_a_replica_killed_mid_sync_loses_nothing_and_counts_nothing_twice(
    tmp_path: Path,
) -> None:
    import os
    import signal
    import subprocess
    import sys

    from node.run import write_genesis
    from swarm.ledger.recheck import recheck

    # Two validators credited the same 150 assignments: one credit each must count.
    twice = PAIRS[:150] + [credit(WORKERS[i % 3], i, by=OTHER_VALIDATOR) for i in range(150)]
    source = LedgerStore(tmp_path / "source.db", GENESIS)
    fill(source, twice)
    source.close()
    write_genesis(GENESIS, tmp_path / "genesis")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _SYNCING_REPLICA,
            *(str(tmp_path / n) for n in ("source.db", "replica.db", "genesis")),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "syncing"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    source = LedgerStore(tmp_path / "source.db", GENESIS)
    replica = LedgerStore(tmp_path / "replica.db", GENESIS)
    landed = len(replica)
    assert 0 < landed < len(source)  # killed in the middle
    assert replica.ids() <= source.ids()
    check = recheck(replica)
    assert not check.refused and not check.balance_errors  # whole batches, counted once
    await pull(replica, direct(source))  # the restart: sync again
    assert replica.ids() == source.ids()
    assert replica.stored_balances() == source.stored_balances()
    assert replica.balance(WORKERS[0]) == 100 + 2 * 50  # 50 assignments of worker 0, once each
    check = recheck(replica)
    assert not check.refused and not check.balance_errors
    source.close()
    replica.close()


async def test_a_peer_that_invents_differences_everywhere_is_cut_off(
    stores: tuple[LedgerStore, LedgerStore],
) -> None:
    """Mallory answers every range with a split of 16 children claiming 2**40 events each: her
    counts contradict the ones she gave for the parents, so the pull stops at once."""
    import msgpack

    from swarm.errors import PeerError

    _, b = stores
    asked: list[int] = []

    async def mallory(body: bytes) -> bytes:
        _, ranges = msgpack.unpackb(body)
        asked.append(len(ranges))
        return msgpack.packb(
            [[r[0], "split", [[2**40, bytes(12)]] * 16] for r in ranges], use_bin_type=True
        )

    with pytest.raises(PeerError, match="contradicts"):
        await pull(b, mallory)
    assert len(asked) == 2  # the root, then its 16 children: their splits do not add up
