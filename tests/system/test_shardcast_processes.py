"""The SHARDCAST commands as separate processes on 127.0.0.1: a bootstrap peer, a trainer that
publishes and serves, a node that fetches (and a second fetch that finds it complete)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.home import NodeHome
from node.run import write_genesis
from node.shardcast import shard_root
from swarm.identity import NodeKey, write_key
from swarm.messages import run_id_of
from tests.shardcast_util import TRAINER, checkpoint, genesis

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def cli(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cli.app", *args],
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def home(tmp_path: Path, name: str, key: NodeKey) -> Path:
    path = tmp_path / name
    write_key(key, NodeHome(path).key_path)
    return path


def read_line_with(proc: subprocess.Popen[str], stream: str, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    pipe = proc.stdout if stream == "stdout" else proc.stderr
    assert pipe is not None
    while time.monotonic() < deadline:
        line = pipe.readline()
        if needle in line:
            return line.strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no line with {needle!r} from {proc.args}")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_publish_serve_and_fetch_as_processes(tmp_path: Path) -> None:
    g = genesis()
    run_file = tmp_path / "run.genesis"
    write_genesis(g, run_file)
    ckpt = checkpoint(tmp_path / "policy.safetensors", 3_000_000)
    boot = cli(
        "bootstrap", "--listen", LOOPBACK, "--home", str(home(tmp_path, "boot", NodeKey.generate()))
    )
    procs = [boot]
    try:
        addr = read_line_with(boot, "stdout", "/p2p/", 30)
        trainer = cli(
            "shardcast",
            "publish",
            str(ckpt),
            "--version",
            "1",
            "--run",
            str(run_file),
            "--shard-mib",
            "1",
            "--bootstrap",
            addr,
            "--listen",
            LOOPBACK,
            "--data-host",
            "127.0.0.1",
            "--home",
            str(home(tmp_path, "trainer", TRAINER)),
        )
        procs.append(trainer)
        read_line_with(trainer, "stderr", "serving it", 60)
        rx_home = home(tmp_path, "rx", NodeKey.generate())
        fetch = cli(
            "shardcast",
            "fetch",
            "--run",
            str(run_file),
            "--bootstrap",
            addr,
            "--listen",
            LOOPBACK,
            "--data-host",
            "127.0.0.1",
            "--home",
            str(rx_home),
        )
        procs.append(fetch)
        out, err = fetch.communicate(timeout=90)
        assert fetch.returncode == 0, err
        assert "version 1 complete" in out and "3 shards fetched" in out
        data = shard_root(rx_home, run_id_of(g)) / "v000000000001" / "data"
        assert data.read_bytes() == ckpt.read_bytes()
    finally:
        for proc in reversed(procs):
            stop(proc)
