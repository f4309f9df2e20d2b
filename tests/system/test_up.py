"""`swarm-node up` as a user runs it: a whole swarm of processes that trains, catches the
cheater, audits, and leaves a summary; a second run refuses the same --out. (Ctrl-C, which
stops every process and still leaves a readable summary, is tried on the swarm of
``test_light_nodes``: one `up` swarm fewer.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.system.up_helpers import no_swarm_left

UP = [sys.executable, "-m", "cli.app", "up"]


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
    assert no_swarm_left(out)

    before = (out / "summary.json").read_bytes()
    again = subprocess.run([*UP, "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "not empty" in again.stderr
    assert (out / "summary.json").read_bytes() == before
