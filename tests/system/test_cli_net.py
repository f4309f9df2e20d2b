"""The network commands as processes: one `swarm-node bootstrap`, three `swarm-node join`s
(trainer, validator, inference) on 127.0.0.1, then `swarm-node status --json` shows the others
by role, and Ctrl-C (SIGINT) stops every process cleanly."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
DEADLINE_S = 120.0


def swarm_node(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.app", *args]


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    out["COLUMNS"] = "200"
    out.pop("SWARM_NODE_HOME", None)
    return out


def check(*args: str) -> str:
    done = subprocess.run(
        swarm_node(*args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def init(home: Path) -> str:
    return check("init", "--home", str(home)).split("peer id:")[1].split()[0]


def start(*args: str, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        swarm_node(*args),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )


def first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first stdout line of ``proc`` within ``timeout`` seconds."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError(f"no output within {timeout} s")
    return proc.stdout.readline().strip()


def status(home: Path) -> dict[str, Any] | None:
    done = subprocess.run(
        swarm_node("status", "--json", "--home", str(home)),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        return None  # not up yet
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.slow
def test_bootstrap_and_three_joins_see_each_other_by_role_then_stop_on_ctrl_c(
    tmp_path: Path,
) -> None:
    homes = {name: tmp_path / name for name in ("owner", "boot", "trainer", "validator", "worker")}
    ids = {name: init(home) for name, home in homes.items()}
    genesis = tmp_path / "run.genesis"
    check(
        "run", "create", "--name", "system-test", "-o", str(genesis),
        "--trainer", ids["trainer"], "--validator", ids["validator"],
        "--home", str(homes["owner"]),
    )  # fmt: skip

    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        procs["boot"] = start(
            "bootstrap", "--listen", LOOPBACK, "--home", str(homes["boot"]),
            log=tmp_path / "boot.log",
        )  # fmt: skip
        boot_addr = first_line(procs["boot"], 60)
        assert boot_addr.startswith("/ip4/127.0.0.1/tcp/")
        assert boot_addr.endswith(f"/p2p/{ids['boot']}")

        roles = {"trainer": "trainer", "validator": "validator", "worker": "inference"}
        for name, role in roles.items():
            procs[name] = start(
                "join", "--role", role, "--run", str(genesis), "--bootstrap", boot_addr,
                "--listen", LOOPBACK, "--home", str(homes[name]),
                log=tmp_path / f"{name}.log",
            )  # fmt: skip

        def expected(name: str) -> dict[str, list[str]]:
            want: dict[str, list[str]] = {"trainer": [], "validator": [], "inference": []}
            for other, role in roles.items():
                if other != name:
                    want[role].append(ids[other])
            return want

        seen: dict[str, dict[str, Any] | None] = {}
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            for name, proc in procs.items():
                assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
            seen = {name: status(homes[name]) for name in roles}
            if all(s and s["peers_by_role"] == expected(n) for n, s in seen.items()):
                break
            time.sleep(1.0)
        else:
            raise AssertionError(f"peers by role never complete within {DEADLINE_S} s: {seen}")

        for name, role in roles.items():
            info = seen[name]
            assert info is not None
            assert info["role"] == role and info["peer_id"] == ids[name]
            assert info["bootstrap_connected"] == [boot_addr]
            assert all(a.startswith("/ip4/127.0.0.1/tcp/") for a in info["listen_addrs"])
        boot_status = status(homes["boot"])
        assert boot_status is not None and boot_status["role"] == "bootstrap"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        codes = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()

    logs = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
    assert codes == dict.fromkeys(procs, 0), {n: logs[n][-2000:] for n in procs}
    for name, text in logs.items():
        assert "stopped" in text and "Traceback" not in text, text[-2000:]
        assert not (homes[name] / "admin.sock").exists()
