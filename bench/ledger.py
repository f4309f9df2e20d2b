"""Ledger at scale: insert rate of signed events, status latency, and sync of two replicas that
differ by 1%, on a ledger of ``--events`` events (default 1,000,000).

    .venv/bin/python bench/ledger.py [--events N] [--json PATH] [--dir DIR]

How it is built. Signing a million events and their verdicts takes about a minute of CPU, and
nothing measured here reads the signatures of the base: the store verifies once, on insert, and
never again. So the base ledger is written in bulk (rows with the columns a checked insert writes
and random envelope bytes of a real event's size, one counted credit per assignment, balances to
match), and what is measured runs on top of it with real signed objects:

- ``insert_per_s``: ``--inserts`` (default 10,000) real signed credit events decoded from bytes
  (signature verified), checked against the rules and the facts of their verdict, and stored, in
  batches of 100, their verdicts already held (gossip and sync bring the verdict first); per CPU
  second of this one-threaded process, i.e. per core (a loaded machine inflates wall time;
  ``*_wall`` is the wall-clock rate). ``insert_gossip_per_s``: the same, one event per
  transaction (a gossiped event). ``insert_with_verdict_per_s``: event and verdict together (two
  signatures verified), batches of 100: the 1% that replica A holds beyond the base.
- ``status_ms``: the median of 200 calls of ``LedgerStore.status`` (what ``swarm-node status``
  reads) on the full ledger.
- ``sync_*``: replica B is a copy of the base; replica A holds the base plus 1% more real signed
  events with their verdicts; B pulls from A through ``swarm.ledger.sync`` over a direct call
  (the bytes are the messages' bytes, the same on a libp2p stream but for framing).
  ``sync_bytes_ratio`` = bytes sent both ways / bytes of the missing events and their verdicts.

On 2 shared cores (load ~9) the default run took 5 minutes, 4 of them building the base;
``--events 100000`` takes about 15 s. Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import trio
from rich.console import Console
from rich.table import Table

from node.run import create_genesis
from swarm.identity import NodeKey
from swarm.ledger import LedgerStore
from swarm.ledger.sync import pull, serve
from swarm.messages import (
    LedgerEvent,
    RunGenesis,
    RunParams,
    Signed,
    Verdict,
    decode,
    run_id_of,
    sign,
)

OWNER = NodeKey.from_seed(b"\x01" * 32)
VALIDATOR = NodeKey.from_seed(b"\x02" * 32)
WORKERS = 10_000
EVENT_BYTES = 300  # a signed credit event's envelope is ~290 bytes
VERDICT_BYTES = 420


def genesis() -> Signed[RunGenesis]:
    return create_genesis(
        OWNER,
        name="bench-ledger",
        trainers=[NodeKey.from_seed(b"\x03" * 32).peer_id],
        validators=[VALIDATOR.peer_id],
        params=RunParams(initial_balance=100, ban_threshold=0, slash_amount=1000),
        created_at=1,
    )


def worker_ids(n: int) -> list[str]:
    return [f"12D3KooWbenchworker{i:08d}" for i in range(n)]


def build_base(path: Path, g: Signed[RunGenesis], events: int) -> float:
    """Write ``events`` counted credits (1 per assignment, 2 samples each) in bulk."""
    start = time.perf_counter()
    LedgerStore(path, g).close()  # the schema and the genesis
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")
    rng = random.Random(0)
    workers = worker_ids(WORKERS)
    validator = VALIDATOR.peer_id
    db.execute("BEGIN")
    for start_i in range(0, events, 50_000):
        ev_rows, v_rows = [], []
        for i in range(start_i, min(events, start_i + 50_000)):
            worker, counter = workers[i % WORKERS], i // WORKERS
            v_raw = rng.randbytes(VERDICT_BYTES)
            e_raw = rng.randbytes(EVENT_BYTES)
            vid, eid = hashlib.sha256(v_raw).digest(), hashlib.sha256(e_raw).digest()
            v_rows.append(
                (
                    vid,
                    rng.randbytes(32),
                    worker,
                    validator,
                    1,
                    "none",
                    2,
                    1,
                    0,
                    counter,
                    0,
                    i,
                    v_raw,
                )
            )
            slot = f"credit:{worker}:0:{counter}"
            ev_rows.append((eid, "credit", worker, 2, vid, validator, i, slot, 2, 1, e_raw))
        db.executemany(f"INSERT INTO verdicts VALUES ({', '.join('?' * 13)})", v_rows)
        db.executemany(f"INSERT INTO events VALUES ({', '.join('?' * 11)})", ev_rows)
    per_worker = [events // WORKERS + (1 if w < events % WORKERS else 0) for w in range(WORKERS)]
    db.executemany(
        "INSERT INTO balances VALUES (?, ?)",
        [(w, 100 + 2 * n) for w, n in zip(workers, per_worker, strict=True) if n],
    )
    db.execute("COMMIT")
    db.close()
    return time.perf_counter() - start


def signed_credits(n: int, first_counter: int) -> list[tuple[bytes, bytes]]:
    """``n`` real (verdict, credit) envelope pairs for assignments the base does not hold."""
    run = run_id_of(genesis())
    workers = worker_ids(WORKERS)
    out = []
    for i in range(n):
        worker = workers[i % WORKERS]
        counter = first_counter + i // WORKERS
        sub = hashlib.sha256(f"{worker}/{counter}".encode()).digest()
        v = sign(Verdict(run, sub, worker, True, "none", (), (1, 0), i, {}, 0, counter), VALIDATOR)
        e = sign(LedgerEvent(run, "credit", worker, 2, v.id, i), VALIDATOR)
        out.append((v.raw, e.raw))
    return out


def insert_rate(
    store: LedgerStore, pairs: list[tuple[bytes, bytes]], batch: int
) -> tuple[float, float]:
    """Events with their verdicts: (per wall second, per CPU second of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        verdicts = [decode(v, Verdict) for v, _ in chunk]
        store.add([decode(e, LedgerEvent) for _, e in chunk], verdicts=verdicts)
    return len(pairs) / (time.perf_counter() - wall), len(pairs) / (time.process_time() - cpu)


def event_rate(
    store: LedgerStore, pairs: list[tuple[bytes, bytes]], batch: int
) -> tuple[float, float]:
    """Events only, their verdicts stored beforehand (not timed)."""
    store.add([], verdicts=[decode(v, Verdict) for v, _ in pairs])
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(pairs), batch):
        store.add([decode(e, LedgerEvent) for _, e in pairs[i : i + batch]])
    return len(pairs) / (time.perf_counter() - wall), len(pairs) / (time.process_time() - cpu)


def status_ms(store: LedgerStore, peer: str) -> float:
    store.status(peer)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        store.status(peer)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


async def sync(a: LedgerStore, b: LedgerStore) -> tuple[int, int, int, float, float]:
    """(bytes both ways, round trips, events added, seconds) of B pulling from A, and the
    seconds one replica takes to build its range index."""

    async def ask(body: bytes) -> bytes:
        return serve(a, body)

    start = time.perf_counter()
    a.range_summary("")  # build each side's range index before the clock starts: a node
    b.range_summary("")  # builds it once per process, not once per sync
    index_s = (time.perf_counter() - start) / 2
    start = time.perf_counter()
    result = await pull(b, ask)
    seconds = time.perf_counter() - start
    wire = result.bytes_sent + result.bytes_received
    return wire, result.round_trips, result.added, seconds, index_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--inserts", type=int, default=10_000)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--dir", type=Path, help="Where to build the ledgers (default: a temp dir)."
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-ledger-", dir=args.dir))
    g = genesis()
    try:
        base = workdir / "base.db"
        t0 = time.perf_counter()
        build_s = build_base(base, g, args.events)
        missing = max(1, args.events // 100)
        sign_start = time.perf_counter()
        diff = signed_credits(missing, first_counter=10**6)
        extra = signed_credits(args.inserts, first_counter=2 * 10**6)
        gossip = signed_credits(min(2_000, args.inserts), first_counter=3 * 10**6)
        sign_s = time.perf_counter() - sign_start
        shutil.copy(base, workdir / "b.db")
        a = LedgerStore(base, g)
        with_verdict = insert_rate(a, diff, 100)  # A: base + 1%, timed as inserts
        b = LedgerStore(workdir / "b.db", g)
        wire, trips, added, sync_s, index_s = trio.run(sync, a, b)
        missing_bytes = sum(len(v) + len(e) for v, e in diff)
        assert added == missing and len(a) == len(b), (added, missing, len(a), len(b))
        insert_per_s = event_rate(a, extra, 100)
        gossip_per_s = event_rate(a, gossip, 1)
        status = status_ms(a, worker_ids(1)[0])
        total_s = time.perf_counter() - t0
        a.close()
        b.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures = {
        "events": args.events,
        "insert_per_s": round(insert_per_s[1]),
        "insert_per_s_wall": round(insert_per_s[0]),
        "insert_gossip_per_s": round(gossip_per_s[1]),
        "insert_gossip_per_s_wall": round(gossip_per_s[0]),
        "insert_with_verdict_per_s": round(with_verdict[1]),
        "insert_with_verdict_per_s_wall": round(with_verdict[0]),
        "status_ms": round(status, 3),
        "sync_missing_events": missing,
        "sync_missing_bytes": missing_bytes,
        "sync_bytes": wire,
        "sync_bytes_ratio": round(wire / missing_bytes, 3),
        "sync_bytes_ratio_events_only": round(wire / sum(len(e) for _, e in diff), 3),
        "sync_round_trips": trips,
        "sync_seconds": round(sync_s, 2),
        "range_index_build_s": round(index_s, 2),
        "build_base_s": round(build_s, 1),
        "sign_s": round(sign_s, 1),
        "total_s": round(total_s, 1),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average": os.getloadavg()[0],
    }
    table = Table(title=f"ledger of {args.events:,} events (load {figures['load_average']:.2f})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("goal")
    goals = {
        "insert_per_s": ">= 5,000 per core",
        "status_ms": "<= 10",
        "sync_bytes_ratio": "<= 2",
    }
    for key, value in figures.items():
        table.add_row(
            key, f"{value:,}" if isinstance(value, int) else str(value), goals.get(key, "")
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    Console().print(table)


if __name__ == "__main__":
    main()
