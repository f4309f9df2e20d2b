"""`swarm-node up` as a user runs it: a whole swarm of processes that trains, catches the
cheater, audits, and leaves a summary; a second run refuses the same --out; Ctrl-C stops every
process and still leaves a readable summary."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node import admin

UP = [sys.executable, "-m", "cli.app", "up"]


def _wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def _no_swarm_left(out: Path) -> bool:
    mine = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    return not [p for p in mine if int(p) != os.getpid()]


@pytest.mark.slow
@pytest.mark.timeout(600)  # up's own limit is 3 minutes, then the audit; a loaded box is slower
def test_up_trains_catches_the_cheater_and_audits(tmp_path: Path) -> None:
    out = tmp_path / "up"
    done = subprocess.run(
        [*UP, "--workers", "1", "--versions", "3", "--minutes", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["audit_ok"] is True
    assert summary["cheaters"] and set(summary["cheaters"]) <= set(summary["slashed"])
    assert set(summary["cheaters"]) <= set(summary["banned"])
    assert set(summary["honest_workers"]) <= set(summary["credited"])
    assert not set(summary["honest_workers"]) & set(summary["slashed"])
    assert summary["reward_by_version"] and summary["accepted"] >= 1
    # The held-out evaluation of v0 (due at any cadence), replayed by the audit.
    assert summary["evaluation"][0]["version"] == 0 and "eval_gain" in summary
    assert any(r["check"] == "evaluation replay" and r["ok"] for r in summary["audit"])
    assert (out / "reward_curve.png").stat().st_size > 0 and (out / "ledger.db").exists()
    assert "dashboard: http://127.0.0.1:" in done.stdout  # served by the bootstrap peer
    # Not on a terminal: one progress line per version (or per 10 s), no table redrawn.
    progress = [line for line in done.stdout.splitlines() if "processes up" in line]
    # (a line per version at most: two versions published between lines share one)
    shown = [int(m) for line in progress for m in re.findall(r"policy v(\d+),", line)]
    assert shown and max(shown) >= 3, done.stdout[-3000:]
    assert len(progress) >= 3 and "┏" not in done.stdout.split("stopped:")[0]
    for name in ("bootstrap", "trainer", "validator", "worker-0", "cheater"):
        assert (out / "logs" / f"{name}.log").exists()
    assert _no_swarm_left(out)

    before = (out / "summary.json").read_bytes()
    again = subprocess.run([*UP, "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "not empty" in again.stderr
    assert (out / "summary.json").read_bytes() == before


@pytest.mark.slow
def test_ctrl_c_stops_everything_and_leaves_a_partial_summary(tmp_path: Path) -> None:
    out = tmp_path / "up"
    proc = subprocess.Popen(
        [*UP, "--workers", "1", "--no-cheater", "--minutes", "5", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        import trio

        def trainer_has_published() -> bool:
            sock = admin.socket_path(out / "homes" / "trainer")
            try:
                status = trio.run(admin.query, sock, {"cmd": "status"})["status"]
            except Exception:
                return False
            return status.get("policy_version") is not None

        _wait_for(trainer_has_published, 180, "the trainer's first policy version")
        _check_dashboard(out)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert "interrupted" in summary["stopped_because"]
    _wait_for(lambda: _no_swarm_left(out), 30, "every child process to exit")


def _check_dashboard(out: Path) -> None:
    """The bootstrap peer of `up` serves the run's dashboard on 127.0.0.1 while it runs."""
    import httpx

    log = (out / "logs" / "bootstrap.log").read_text()
    url = next(line.split()[1] for line in log.splitlines() if line.startswith("dashboard http"))
    assert url.startswith("http://127.0.0.1:")
    status = httpx.get(url + "api/v1/status", timeout=10).json()
    assert status["node"]["role"] == "bootstrap"
    assert status["run"]["name"] == "local demo" and len(status["run"]["run_id"]) == 32
    assert httpx.get(url + "api/v1/contributors", timeout=10).status_code == 200
