"""`swarm-node shardcast publish`, as a user runs it (in-process, real files)."""

from __future__ import annotations

from pathlib import Path

import typer
from typer.testing import CliRunner

from cli import shardcast
from node.home import NodeHome
from node.run import write_genesis
from node.shardcast import shard_root
from swarm.errors import NotAuthorizedError
from swarm.identity import write_key
from swarm.messages import run_id_of
from tests.shardcast_util import MALLORY, TRAINER, checkpoint, genesis

app = typer.Typer()
shardcast.register(app)
app.command("noop", hidden=True)(lambda: None)  # keep "shardcast" a sub-command


def home_with(tmp_path: Path, key_name: str, key: object) -> Path:
    home = tmp_path / key_name
    write_key(key, NodeHome(home).key_path)  # type: ignore[arg-type]
    return home


def test_a_trainer_publishes_a_version_into_its_home(tmp_path: Path) -> None:
    g = genesis()
    write_genesis(g, tmp_path / "run.genesis")
    home = home_with(tmp_path, "trainer", TRAINER)
    ckpt = checkpoint(tmp_path / "policy.safetensors", 200_000)
    result = CliRunner().invoke(
        app,
        [
            "shardcast",
            "publish",
            str(ckpt),
            "--version",
            "3",
            "--run",
            str(tmp_path / "run.genesis"),
            "--shard-mib",
            "1",
            "--no-serve",
            "--home",
            str(home),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "version 3" in result.output and "manifest" in result.output
    data = shard_root(home, run_id_of(g)) / "v000000000003" / "data"
    assert data.read_bytes() == ckpt.read_bytes()
    assert (data.parent / "complete").exists()


def test_publish_by_a_key_that_is_not_a_trainer_is_refused(tmp_path: Path) -> None:
    g = genesis()
    write_genesis(g, tmp_path / "run.genesis")
    home = home_with(tmp_path, "mallory", MALLORY)
    ckpt = checkpoint(tmp_path / "policy.safetensors", 20_000)
    result = CliRunner().invoke(
        app,
        [
            "shardcast",
            "publish",
            str(ckpt),
            "--version",
            "1",
            "--run",
            str(tmp_path / "run.genesis"),
            "--no-serve",
            "--home",
            str(home),
        ],
    )
    assert isinstance(result.exception, NotAuthorizedError)
    assert "not a trainer" in str(result.exception)
    assert not (shard_root(home, run_id_of(g)) / "v000000000001").exists()
