"""Where the test suite's time and CPU go: a pytest plugin that writes, per test, its wall
time, its start and end, its worker, and the machine-wide busy CPU seconds around it
(``/proc/stat``: every process, so nothing else should run); then a report of the totals.

    PYTHONPATH=bench SUITE_CPU_OUT=/tmp/suite.jsonl .venv/bin/python -m pytest -q -p suite_cpu
    .venv/bin/python bench/suite_cpu.py /tmp/suite.jsonl [--json PATH]

The report: tests, wall seconds summed, busy core-seconds summed, the lower bound that puts on
a run on ``--cores`` cores (busy / cores: no schedule beats it), each worker's last end (a
balanced split ends them together), and the modules with the most wall time. Under
pytest-xdist each worker writes its own lines (``-p`` reaches the workers); the busy figure
then counts both workers' tests twice where they overlap, so take it from a one-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

OUT = os.environ.get("SUITE_CPU_OUT", "suite_cpu.jsonl")
_HZ = os.sysconf("SC_CLK_TCK")


def _busy_s() -> float:
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _HZ  # less idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start, busy = time.time(), _busy_s()
    yield
    end = time.time()
    row = {
        "id": item.nodeid,
        "start": start,
        "end": end,
        "wall": end - start,
        "busy": _busy_s() - busy,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with open(OUT, "a") as out:
        out.write(json.dumps(row) + "\n")


def report(rows: list[dict[str, Any]], cores: int) -> dict[str, Any]:
    t0 = min(r["start"] for r in rows)
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        module = modules[r["id"].split("::")[0]]
        module[0] += r["wall"]
        module[1] += r["busy"]
    busy = sum(r["busy"] for r in rows)
    return {
        "tests": len(rows),
        "wall_s": round(sum(r["wall"] for r in rows), 1),
        "busy_core_s": round(busy, 1),
        "lower_bound_s": round(busy / cores, 1),
        "cores": cores,
        "worker_last_end_s": {
            w: round(max(r["end"] for r in rows if r["worker"] == w) - t0, 1)
            for w in sorted({r["worker"] for r in rows})
        },
        "modules": [
            {"module": m, "wall_s": round(w, 1), "busy_core_s": round(b, 1)}
            for m, (w, b) in sorted(modules.items(), key=lambda kv: -kv[1][0])
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=Path, help="the plugin's JSON lines")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{args.rows}: no rows (run pytest with -p suite_cpu first)")
    out = report(rows, args.cores)
    print(f"{'tests':<32}{out['tests']:>10}")
    print(f"{'wall s (summed)':<32}{out['wall_s']:>10}")
    print(f"{'busy core-s (machine)':<32}{out['busy_core_s']:>10}")
    print(f"{'lower bound on ' + str(args.cores) + ' cores, s':<32}{out['lower_bound_s']:>10}")
    for worker, end in out["worker_last_end_s"].items():
        print(f"{'last end, ' + worker:<32}{end:>10}")
    print(f"\n{'module':<64}{'wall s':>8}{'busy':>8}")
    for m in out["modules"][: args.top]:
        print(f"{m['module']:<64}{m['wall_s']:>8}{m['busy_core_s']:>8}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
