"""The identity and genesis commands, run as a user runs them (in-process, real files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.app import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def init(capsys: pytest.CaptureFixture[str], home: Path, *extra: str) -> str:
    code, out, err = run(capsys, "init", "--home", str(home), *extra)
    assert code == 0, err
    return out.split("peer id:")[1].split()[0]


def test_init_prints_peer_id_key_path_and_warning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run(capsys, "init", "--home", str(tmp_path))
    assert code == 0
    assert "peer id:  12D3KooW" in out and str(tmp_path / "node.key") in out
    assert "losing it loses" in err
    assert (tmp_path / "node.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "config.toml").exists()


def test_id_and_public_key_match_init(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    peer = init(capsys, tmp_path)
    assert run(capsys, "id", "--home", str(tmp_path))[1].strip() == peer
    public = run(capsys, "key", "export", "--public", "--home", str(tmp_path))[1].strip()
    from swarm.identity import peer_id_from_public

    assert peer_id_from_public(bytes.fromhex(public)) == peer


def test_home_comes_from_the_environment(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWARM_NODE_HOME", str(tmp_path / "envhome"))
    code, _, _ = run(capsys, "init")
    assert code == 0 and (tmp_path / "envhome" / "node.key").exists()


def test_second_init_refuses_and_keeps_the_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    peer = init(capsys, tmp_path)
    before = (tmp_path / "node.key").read_bytes()
    code, _, err = run(capsys, "init", "--home", str(tmp_path))
    assert code == 2 and "already exists" in err and "Traceback" not in err
    assert (tmp_path / "node.key").read_bytes() == before
    assert run(capsys, "id", "--home", str(tmp_path))[1].strip() == peer


def test_forced_init_moves_the_old_key_aside(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    init(capsys, tmp_path)
    before = (tmp_path / "node.key").read_bytes()
    new_peer = init(capsys, tmp_path, "--force", "--yes")
    kept = list(tmp_path.glob("node.key.replaced-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == before
    assert run(capsys, "id", "--home", str(tmp_path))[1].strip() == new_peer


def test_group_readable_key_is_refused_with_chmod_hint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    init(capsys, tmp_path)
    (tmp_path / "node.key").chmod(0o640)
    code, _, err = run(capsys, "id", "--home", str(tmp_path))
    assert code == 2 and f"chmod 600 {tmp_path / 'node.key'}" in err
    assert len(err.strip().splitlines()) == 1


def test_corrupt_key_is_a_clear_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    init(capsys, tmp_path)
    (tmp_path / "node.key").write_text("not a key")
    code, _, err = run(capsys, "id", "--home", str(tmp_path))
    assert code == 2 and err.startswith("error: key file") and "Traceback" not in err


def test_passphrase_from_environment(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWARM_NODE_PASSPHRASE", "s3cret")
    peer = init(capsys, tmp_path, "--passphrase")
    assert b"ENCRYPTED" in (tmp_path / "node.key").read_bytes()
    assert run(capsys, "id", "--home", str(tmp_path))[1].strip() == peer
    monkeypatch.setenv("SWARM_NODE_PASSPHRASE", "wrong")
    code, _, err = run(capsys, "id", "--home", str(tmp_path))
    assert code == 2 and "wrong passphrase" in err


def test_run_create_and_show(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    owner = init(capsys, tmp_path / "owner")
    trainer = init(capsys, tmp_path / "trainer")
    genesis = tmp_path / "run.genesis"
    code, out, err = run(
        capsys,
        "run",
        "create",
        "--home",
        str(tmp_path / "owner"),
        "--name",
        "demo",
        "--trainer",
        trainer,
        "--validator",
        owner,
        "--param",
        "async_level=1",
        "--param",
        "learning_rate=3e-4",
        "-o",
        str(genesis),
    )
    assert code == 0, err
    run_id = out.split()[1]
    code, out, _ = run(capsys, "run", "show", str(genesis), "--json")
    assert code == 0
    import json

    view = json.loads(out)
    assert view["run_id"] == run_id and len(run_id) == 32
    assert view["owner"] == owner and view["trainers"] == [trainer]
    assert view["params"]["async_level"] == 1 and view["params"]["learning_rate"] == "0.0003"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trainer", "bogus"], "is not the peer ID"),
        (["--param", "novalue"], "key=value"),
        (["--param", "group_size=1"], "group_size"),
        (["--param", "temperature=warm"], "not a valid float"),
    ],
)
def test_run_create_bad_input_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], message: str
) -> None:
    owner = init(capsys, tmp_path)
    base = ["run", "create", "--home", str(tmp_path), "--name", "x", "-o", str(tmp_path / "g")]
    if "--trainer" not in args:
        base += ["--trainer", owner]
    code, _, err = run(capsys, *base, "--validator", owner, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "g").exists()


def test_edited_genesis_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    owner = init(capsys, tmp_path)
    genesis = tmp_path / "g"
    run(
        capsys,
        "run",
        "create",
        "--home",
        str(tmp_path),
        "--name",
        "honest",
        "--trainer",
        owner,
        "--validator",
        owner,
        "-o",
        str(genesis),
    )
    data = genesis.read_bytes()
    genesis.write_bytes(data.replace(b"honest", b"hacked"))
    code, _, err = run(capsys, "run", "show", str(genesis))
    assert code == 2 and "failed verification" in err and "Traceback" not in err
    genesis.write_bytes(data[: len(data) // 2])
    code, _, err = run(capsys, "run", "show", str(genesis))
    assert code == 2 and "failed verification" in err


def test_console_script_runs_as_a_process(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("swarm-node")
    env = os.environ | {"SWARM_NODE_HOME": str(tmp_path)}
    done = subprocess.run([exe, "id"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "swarm-node init" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([exe, "init"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "12D3KooW" in done.stdout
