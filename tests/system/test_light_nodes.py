"""The light-node contract on real processes: a node's main process (bootstrap peer, inference
worker, validator; the trainer once its tokenizer lives in its child) never loads torch,
transformers, sympy/math-verify or hivemind, after it has done real work; the model lives in
the compute child (which does load torch: the check can tell the two apart).

One `swarm-node up` swarm for the module; each process says what it loaded in
`swarm-node status` (`process.heavy_modules`, from `sys.modules`), read over its admin socket.
The module's last test then stops that swarm as a user does: its dashboard answers while it
runs, Ctrl-C stops every process and still leaves a readable (partial) summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from node import admin
from swarm.process import child_pids
from tests.system.up_helpers import check_dashboard, no_swarm_left, wait_for

UP = [sys.executable, "-m", "cli.app", "up"]


def _worked(name: str, status: dict[str, Any] | None) -> bool:
    """The process has done what loads its lazy imports: judged, generated, trained."""
    if status is None:
        return False
    role = status.get("role_status", {})
    if name == "validator":
        return bool(role.get("validator", {}).get("judged"))
    if name == "worker-0":
        return bool(role.get("worker", {}).get("submitted"))
    if name == "trainer":
        return (status.get("policy_version") or 0) >= 2
    return True


@dataclass
class UpSwarm:
    proc: subprocess.Popen[bytes]
    out: Path
    seen: dict[str, dict[str, Any]]
    """Each process's status once it had done real work, and its compute children's maps."""


@pytest.fixture(scope="module")
def up_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpSwarm]:
    out = tmp_path_factory.mktemp("light") / "up"
    proc = subprocess.Popen(
        [
            *UP,
            "--workers",
            "1",
            "--no-cheater",
            "--versions",
            "100",
            "--minutes",
            "10",  # stopped by the last test's Ctrl-C long before
            "--out",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(out.parent / "up.stderr").open("wb"),  # a pipe nobody reads could fill up
        start_new_session=True,
    )
    names = ("bootstrap", "trainer", "validator", "worker-0")
    try:
        seen: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(seen) < len(names):
            for name in names:
                status = admin.read_status(out / "homes" / name)
                if name not in seen and _worked(name, status):
                    assert status is not None
                    seen[name] = status
            time.sleep(1)
        missing = set(names) - set(seen)
        assert not missing, f"no work seen from {missing} within 240 s"
        for status in seen.values():  # the compute children, while they still run
            status["child_maps"] = [
                Path(f"/proc/{child}/maps").read_text()
                for child in child_pids(status["process"]["pid"])
                if Path(f"/proc/{child}/maps").exists()
            ]
        yield UpSwarm(proc, out, seen)
    finally:
        proc.send_signal(signal.SIGINT)  # (stopped already when the last test ran)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def swarm(up_swarm: UpSwarm) -> dict[str, dict[str, Any]]:
    return up_swarm.seen


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "bootstrap",
        "worker-0",
        "validator",
        "trainer",  # its prompts are tokenized in the training child
    ],
)
def test_main_process_loads_no_heavy_package(swarm: dict[str, dict[str, Any]], name: str) -> None:
    process = swarm[name]["process"]
    assert process["heavy_modules"] == [], f"{name} main process loaded {process}"
    maps = Path(f"/proc/{process['pid']}/maps")
    if maps.exists():  # the shared libraries too, not only the Python modules
        assert "libtorch" not in maps.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["worker-0", "validator"])
def test_the_model_lives_in_the_compute_child(swarm: dict[str, dict[str, Any]], name: str) -> None:
    assert any("libtorch" in maps for maps in swarm[name]["child_maps"]), (
        f"no child of {name} has torch loaded: the check above could not tell light from heavy"
    )


@pytest.mark.slow
def test_ctrl_c_stops_everything_and_leaves_a_partial_summary(up_swarm: UpSwarm) -> None:
    """Last in the module: it stops the module's swarm."""
    out, proc = up_swarm.out, up_swarm.proc
    assert (up_swarm.seen["trainer"].get("policy_version") or 0) >= 1
    check_dashboard(out)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, (out.parent / "up.stderr").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "interrupted" in summary["stopped_because"]
    wait_for(lambda: no_swarm_left(out), 30, "every child process to exit")
