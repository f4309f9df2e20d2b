"""The light-node contract on real processes: a node's main process (bootstrap peer, inference
worker, validator; the trainer once its tokenizer lives in its child) never loads torch,
transformers, sympy/math-verify or hivemind, after it has done real work; the model lives in
the compute child (which does load torch: the check can tell the two apart).

One `swarm-node up` swarm for the module; each process says what it loaded in
`swarm-node status` (`process.heavy_modules`, from `sys.modules`), read over its admin socket.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node import admin
from swarm.process import child_pids

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


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
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
            "4",
            "--out",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
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
        yield seen
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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
