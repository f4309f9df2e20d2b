"""``--http`` as a user types it: the address forms that work, and the clear errors (exit 2,
before any network use) for those that do not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from node.web.serve import parse_http
from swarm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("given", "bound"),
    [
        ("8080", ("127.0.0.1", 8080)),
        ("0", ("127.0.0.1", 0)),
        ("127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
        ("[::1]:8080", ("::1", 8080)),
        (":8080", ("127.0.0.1", 8080)),
    ],
)
def test_http_addresses_default_to_loopback(given: str, bound: tuple[str, int]) -> None:
    assert parse_http(given) == bound


@pytest.mark.parametrize("given", ["", "web", "127.0.0.1:", "1.2.3.4:99999", "8080:x", "-1"])
def test_bad_http_addresses_are_a_clear_error(given: str) -> None:
    with pytest.raises(ConfigError, match="ADDR:PORT"):
        parse_http(given)


def run(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.app", *args, "--home", str(home)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bootstrap_http_without_a_run_exits_2_saying_what_to_do(tmp_path: Path) -> None:
    assert run("init", home=tmp_path).returncode == 0
    done = run("bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--http", "0", home=tmp_path)
    assert done.returncode == 2
    assert "--run" in done.stderr and "Traceback" not in done.stderr


def test_up_refuses_a_bad_http_address_before_starting_anything(tmp_path: Path) -> None:
    out = tmp_path / "up"
    done = subprocess.run(
        [sys.executable, "-m", "cli.app", "up", "--http", "nowhere", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "ADDR:PORT" in done.stderr
    assert not out.exists()
