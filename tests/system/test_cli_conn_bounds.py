"""`swarm-node join` refuses connection marks that cannot work, before any network use, and
says which flags (or config keys) to fix; the file's marks are read when no flag is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from node.home import NodeHome
from node.run import write_genesis
from swarm.identity import write_key
from tests.shardcast_util import genesis, key

ROOT = Path(__file__).resolve().parents[2]


def join(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    write_genesis(genesis(), tmp_path / "run.genesis")
    home = tmp_path / "worker"
    if not NodeHome(home).key_path.exists():
        write_key(key("a-worker"), NodeHome(home).key_path)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.app",
            "join",
            "--run",
            str(tmp_path / "run.genesis"),
            "--role",
            "inference",
            "--home",
            str(home),
            "--bootstrap",
            "/ip4/127.0.0.1/tcp/9/p2p/" + key("nobody").peer_id,
            *flags,
        ],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_low_mark_above_the_high_one_is_refused_naming_the_flags(tmp_path: Path) -> None:
    done = join(tmp_path, "--conn-low", "20", "--conn-high", "10")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "low 20, high 10" in done.stderr and "--conn-high" in done.stderr


def test_the_marks_come_from_config_toml_when_no_flag_is_given(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "worker")
    home.path.mkdir(parents=True)
    home.config_path.write_text("[node]\nconn_low = 0\nconn_high = 5\n")
    done = join(tmp_path)
    assert done.returncode == 2 and "got low 0, high 5" in done.stderr, done.stderr
