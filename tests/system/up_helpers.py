"""What the tests of `swarm-node up` share: waiting with a deadline, no process left, the
dashboard served while the swarm runs."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def no_swarm_left(out: Path) -> bool:
    """No process but this one names ``out`` on its command line."""
    mine = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    return not [p for p in mine if int(p) != os.getpid()]


def check_dashboard(out: Path) -> None:
    """The bootstrap peer of `up` serves the run's dashboard on 127.0.0.1 while it runs."""
    import httpx

    log = (out / "logs" / "bootstrap.log").read_text()
    url = next(line.split()[1] for line in log.splitlines() if line.startswith("dashboard http"))
    assert url.startswith("http://127.0.0.1:")
    status = httpx.get(url + "api/v1/status", timeout=10).json()
    assert status["node"]["role"] == "bootstrap"
    assert status["run"]["name"] == "local demo" and len(status["run"]["run_id"]) == 32
    assert httpx.get(url + "api/v1/contributors", timeout=10).status_code == 200
