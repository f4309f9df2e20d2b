"""What each role's processes cost a machine: resident memory and CPU of the main process and of
its children (the compute child), and which heavy packages the main process loaded.

    .venv/bin/python bench/nodes.py [--json PATH] [--window 10]

Runs ``swarm-node up --workers 1 --no-cheater`` (bootstrap peer with the dashboard, trainer,
validator, one worker: the embedded model on CPU), waits until each process has done real work
(the validator judged, the worker submitted, the trainer published v2), then samples every
process for ``--window`` seconds: RSS at the end, CPU % over the window (of one core). The
swarm keeps training meanwhile, so the children's CPU is work, and the main processes' CPU is
what networking, gossip, SHARDCAST and the ledger cost next to it. ``idle`` is a bootstrap peer
with nothing to do but the DHT and gossip heartbeats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from node import admin
from swarm.process import child_pids

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("bootstrap", "worker-0", "validator", "trainer")
UP = [sys.executable, "-m", "cli.app", "up", "--workers", "1", "--no-cheater"]
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGESIZE")


def worked(name: str, st: dict[str, Any] | None) -> bool:
    if st is None:
        return False
    role = st.get("role_status", {})
    if name == "validator":
        return bool(role.get("validator", {}).get("judged"))
    if name == "worker-0":
        return bool(role.get("worker", {}).get("submitted"))
    if name == "trainer":
        return (st.get("policy_version") or 0) >= 2
    return True


def children(pid: int) -> list[int]:
    """Every descendant of ``pid``."""
    direct = child_pids(pid)
    return direct + [d for c in direct for d in children(c)]


def sample(pid: int) -> tuple[float, float]:
    """(RSS MiB, CPU seconds) of one process; zeros when it is gone."""
    try:
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return rss, (int(fields[11]) + int(fields[12])) / TICK


def measure(pids: dict[str, int], window: float) -> dict[str, dict[str, Any]]:
    kids = {name: children(pid) for name, pid in pids.items()}
    before = {
        name: (sample(pid)[1], sum(sample(k)[1] for k in kids[name])) for name, pid in pids.items()
    }
    time.sleep(window)
    out: dict[str, dict[str, Any]] = {}
    for name, pid in pids.items():
        rss, cpu = sample(pid)
        child = [sample(k) for k in kids[name]]
        out[name] = {
            "main_rss_mib": round(rss, 1),
            "main_cpu_pct": round(100 * (cpu - before[name][0]) / window, 1),
            "children": len(child),
            "children_rss_mib": round(sum(c[0] for c in child), 1),
            "children_cpu_pct": round(
                100 * (sum(c[1] for c in child) - before[name][1]) / window, 1
            ),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="RSS and CPU of each role's processes.")
    parser.add_argument("--json", default=None)
    parser.add_argument("--window", type=float, default=10.0)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="swarm-nodes-")) / "up"
    proc = subprocess.Popen(
        [*UP, "--versions", "1000", "--minutes", "5", "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        seen: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(seen) < len(NAMES):
            for name in NAMES:
                st = admin.read_status(out / "homes" / name)
                if name not in seen and worked(name, st):
                    assert st is not None
                    seen[name] = st
            time.sleep(1)
        pids = {name: st["process"]["pid"] for name, st in seen.items()}
        figures = measure(pids, args.window)
        for name, st in seen.items():
            figures[name]["heavy_modules"] = (admin.read_status(out / "homes" / name) or st)[
                "process"
            ]["heavy_modules"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    result = {"roles": figures, "window_s": args.window, "load_average": os.getloadavg()}
    table = Table(title="bench/nodes.py: each role's processes (swarm-node up, CPU)")
    for col in (
        "process",
        "main RSS MiB",
        "main CPU %",
        "children",
        "children RSS MiB",
        "children CPU %",
        "heavy modules in main",
    ):
        table.add_column(col)
    for name, f in figures.items():
        table.add_row(
            name,
            str(f["main_rss_mib"]),
            str(f["main_cpu_pct"]),
            str(f["children"]),
            str(f["children_rss_mib"]),
            str(f["children_cpu_pct"]),
            ", ".join(f["heavy_modules"]) or "none",
        )
    Console().print(table)
    print(f"load average {result['load_average']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
