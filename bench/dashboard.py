"""The web dashboard's cost: API response times on a big ledger, and CPU while browsers watch.

    .venv/bin/python bench/dashboard.py [--json PATH] [--events N] [--watchers K] [--seconds S]

1. Builds a ledger of N (default 100,000) signed credit/slash events with as many signed
   verdicts (1,000 workers, 100 policy versions, 1% slashed), as a validator's would be.
2. Serves its dashboard from a child process (the same Starlette app on Hypercorn's trio worker
   that ``--http`` runs in a node) and times pages over real HTTP on 127.0.0.1:
   ``contributors_page_ms`` (50 rows sorted by balance, the per-peer aggregate recomputed, as
   after every ledger change) and ``contributors_page_cached_ms`` (the ledger unchanged);
   ``ledger_page_ms`` (50 events, first page and a page deep in the ledger by cursor);
   ``slashes_page_ms`` and ``rewards_ms``. Median of ``--repeat`` requests each.
3. The server's CPU while K (default 10) clients watch the live stream and, like the page,
   re-read status, versions, rewards, contributors, slashes, disputes and SHARDCAST on every
   update, while this process appends one verdict and event per second: ``watch_cpu_percent``
   (of one core) against ``idle_cpu_percent`` with no watcher, and their difference
   ``watch_extra_cpu_percent``.

Prints a table last and writes JSON. The server process holds only the dashboard (no swarm
traffic), so the CPU figures are the dashboard's own share of a node's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import ledger_factory as lf

WORKERS = 1000
VERSIONS = 100


def build(path: Path, events: int) -> None:
    from swarm.identity import NodeKey

    keys = [NodeKey.from_seed(i.to_bytes(4, "big") * 8) for i in range(WORKERS)]
    work = [
        lf.Work(
            keys[i % WORKERS],
            i * VERSIONS // events,
            accepted=i % 100 != 7,
            reward=(i % 10) / 10,
            reasons=("sampling: a token is not the seeded choice",),
        )
        for i in range(events)
    ]
    lf.build(path, work, evidence=False).close()


def serve(ledger: Path, port_file: Path) -> None:
    """The child: serve the dashboard of ``ledger`` on 127.0.0.1, write the URL, run forever."""
    import trio

    from node.web.queries import LedgerQueries
    from node.web.serve import serve_dashboard
    from node.web.views import HolderWatch, PolicyLog, RunView
    from swarm.messages import PolicyAnnouncement, sign

    genesis = lf.genesis()
    policy = PolicyLog()
    from swarm.messages import run_id_of

    run_id = run_id_of(genesis)
    for v in range(VERSIONS):
        policy.record(sign(PolicyAnnouncement(run_id, v, bytes(32), v), lf.TRAINER))

    class NoDHT:
        async def find_providers(self, key: str) -> list[str]:
            return []

    started = time.monotonic()
    view = RunView(
        run_id=run_id,
        genesis=genesis,
        status=lambda: {"role": "validator", "uptime_s": time.monotonic() - started},
        policy=policy,
        holders=HolderWatch(NoDHT(), "bench", run_id, lambda: []),
        queries=LedgerQueries(ledger, initial_balance=100, ban_threshold=0),
        roles=dict,
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_dashboard, view, "127.0.0.1", 0)
            port_file.write_text(url)

    trio.run(main)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_ms(client: httpx.Client, url: str, repeat: int, before: Any = None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        answer = client.get(url)
        times.append((time.perf_counter() - start) * 1000)
        answer.raise_for_status()
    return statistics.median(times)


PAGE = ["status", "versions?limit=20", "rewards?limit=200", "contributors?limit=50"]
PAGE += ["slashes?limit=50", "disputes?limit=50", "shardcast"]


def watcher(base: str, stop: threading.Event, counts: list[int]) -> None:
    """What one open page does: follow the stream, re-read every section on each update."""
    try:
        with httpx.Client(timeout=30) as client, client.stream("GET", base + "api/v1/stream") as s:
            for line in s.iter_lines():
                if stop.is_set():
                    return
                if line.startswith("data:"):
                    for path in PAGE:
                        client.get(base + "api/v1/" + path)
                    counts.append(1)
    except httpx.HTTPError:
        return  # the server stopped at the end of the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--watchers", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.port_file)
        return

    work = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    ledger = work / "ledger.db"
    t0 = time.perf_counter()
    build(ledger, args.events)
    build_s = time.perf_counter() - t0
    port_file = work / "url"
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(ledger), "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or child.poll() is not None:
                raise SystemExit("the dashboard server did not start")
            time.sleep(0.1)
        base = port_file.read_text()
        results = measure(base, ledger, child.pid, args)
    finally:
        child.terminate()
        child.wait(timeout=10)
    results |= {
        "events": args.events,
        "workers": WORKERS,
        "build_s": round(build_s, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    table = Table(title=f"dashboard on a ledger of {args.events:,} events")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in results.items():
        table.add_row(key, str(value))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def measure(base: str, ledger: Path, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    from swarm.ledger import LedgerStore
    from swarm.messages import Verdict, sign

    store = LedgerStore(ledger, lf.genesis())
    extra = [0]

    def touch() -> None:
        """A new verdict, as a validator stores one per judged submission. (Not a ledger event:
        ``LedgerStore.add`` re-folds every event today, which would time the writer, not the
        dashboard.)"""
        extra[0] += 1
        n = args.events + extra[0]
        verdict = Verdict(
            store.run_id, b"%032d" % n, "bench-peer", True, "none", (), (500_000,), n, {}, 99, n
        )
        store.add_verdict(sign(verdict, lf.VALIDATOR))

    api = base + "api/v1/"
    out: dict[str, Any] = {}
    with httpx.Client(timeout=30) as client:
        client.get(api + "contributors")  # warm caches and connections
        out["contributors_page_ms"] = round(
            median_ms(client, api + "contributors?limit=50&sort=balance", args.repeat, touch), 1
        )
        out["contributors_page_cached_ms"] = round(
            median_ms(client, api + "contributors?limit=50&sort=balance", args.repeat), 1
        )
        first = median_ms(client, api + "ledger?limit=50", args.repeat)
        deep_cursor = str(args.events // 2)
        deep = median_ms(client, api + f"ledger?limit=50&cursor={deep_cursor}", args.repeat)
        out["ledger_page_ms"] = round(max(first, deep), 1)
        out["ledger_first_page_ms"] = round(first, 1)
        out["ledger_deep_page_ms"] = round(deep, 1)
        out["slashes_page_ms"] = round(median_ms(client, api + "slashes?limit=50", args.repeat), 1)
        out["rewards_ms"] = round(median_ms(client, api + "rewards?limit=200", args.repeat), 1)

    def cpu_percent(watchers: int) -> tuple[float, int]:
        stop = threading.Event()
        counts: list[int] = []
        threads = [
            threading.Thread(target=watcher, args=(base, stop, counts), daemon=True)
            for _ in range(watchers)
        ]
        for t in threads:
            t.start()
        time.sleep(2.0)
        before, start = cpu_seconds(pid), time.monotonic()
        while time.monotonic() - start < args.seconds:
            touch()
            time.sleep(1.0)
        used = cpu_seconds(pid) - before
        elapsed = time.monotonic() - start
        stop.set()
        touch()  # wake every watcher so it sees stop
        for t in threads:
            t.join(timeout=30)
        return 100 * used / elapsed, len(counts)

    idle, _ = cpu_percent(0)
    busy, updates = cpu_percent(args.watchers)
    store.close()
    out |= {
        "watchers": args.watchers,
        "idle_cpu_percent": round(idle, 1),
        "watch_cpu_percent": round(busy, 1),
        "watch_extra_cpu_percent": round(busy - idle, 1),
        "watch_updates_delivered": updates,
    }
    return out


if __name__ == "__main__":
    main()
