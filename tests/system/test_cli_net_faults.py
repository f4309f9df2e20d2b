"""`swarm-node join` given bad input or unreachable peers: one clear line, exit code 2.

In-process (``cli.app.main``), real files; bad input must fail before any socket is opened.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import cli.net
from cli.app import main
from swarm.net import DialPolicy, Overlay
from tests.netfactory import key_named

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def node_home(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Path:
    home = tmp_path / "node"
    assert run(capsys, "init", "--home", str(home))[0] == 0
    return home


@pytest.fixture
def genesis(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Path:
    owner = tmp_path / "owner"
    assert run(capsys, "init", "--home", str(owner))[0] == 0
    path = tmp_path / "genesis.run"
    code, _, err = run(
        capsys,
        "run", "create", "--name", "faults", "-o", str(path), "--home", str(owner),
        "--trainer", key_named("t").peer_id, "--validator", key_named("v").peer_id,
    )  # fmt: skip
    assert code == 0, err
    return path


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to start a libp2p host fails the test."""

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("the network was used")

    monkeypatch.setattr(Overlay, "start", refuse)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join(
    capsys: pytest.CaptureFixture[str], home: Path, genesis: Path, *extra: str
) -> tuple[int, str, str]:
    return run(
        capsys,
        "join", "--role", "inference", "--run", str(genesis), "--home", str(home),
        "--listen", LOOPBACK, *extra,
    )  # fmt: skip


def test_join_names_each_unreachable_bootstrap_peer_and_exits_2(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    node_home: Path,
    genesis: Path,
) -> None:
    monkeypatch.setattr(cli.net, "JOIN_DIAL", DialPolicy(attempts=2, timeout=0.5, backoff=0.05))
    dead = [
        f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{key_named(f'boot-{i}').peer_id}" for i in range(2)
    ]
    code, _, err = join(capsys, node_home, genesis, "--bootstrap", dead[0], "--bootstrap", dead[1])
    assert code == 2
    line = " ".join(err.split())  # rich may wrap a long line
    assert "error: no bootstrap peer answered:" in line
    for addr in dead:
        assert f"{addr} (connection refused)" in line
    assert "--wait" in line and "Traceback" not in err
    assert not (node_home / "admin.sock").exists()  # cleaned up on the way out


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--bootstrap", "/ip4/127.0.0.1/tcp/notaport/p2p/x", "is not a valid multiaddr"),
        ("--bootstrap", "/ip4/127.0.0.1/tcp/4001", "is not a dialable peer address"),
        ("--listen", "/ip9/1.2.3.4", "is not a valid multiaddr"),
    ],
)
def test_join_refuses_a_malformed_multiaddr_before_any_network_use(
    capsys: pytest.CaptureFixture[str],
    no_network: None,
    node_home: Path,
    genesis: Path,
    flag: str,
    value: str,
    says: str,
) -> None:
    bootstrap = f"/ip4/127.0.0.1/tcp/4001/p2p/{key_named('boot').peer_id}"
    extra = (flag, value) if flag == "--bootstrap" else ("--bootstrap", bootstrap, flag, value)
    code, _, err = join(capsys, node_home, genesis, *extra)
    assert code == 2, err
    assert says in " ".join(err.split()) and "Traceback" not in err


def test_join_refuses_a_genesis_that_fails_verification_before_any_network_use(
    capsys: pytest.CaptureFixture[str], no_network: None, node_home: Path, genesis: Path
) -> None:
    data = bytearray(genesis.read_bytes())
    data[-1] ^= 0x01  # one bit of the signature
    genesis.write_bytes(bytes(data))
    bootstrap = f"/ip4/127.0.0.1/tcp/4001/p2p/{key_named('boot').peer_id}"
    code, _, err = join(capsys, node_home, genesis, "--bootstrap", bootstrap)
    assert code == 2
    line = " ".join(err.split())
    assert f"run genesis {genesis} failed verification" in line
    assert "ask the run owner for the original file" in line


def test_join_without_any_bootstrap_peer_says_the_shipped_list_is_empty(
    capsys: pytest.CaptureFixture[str], no_network: None, node_home: Path, genesis: Path
) -> None:
    code, _, err = join(capsys, node_home, genesis)
    assert code == 2
    line = " ".join(err.split())
    assert "the bootstrap list shipped with this node is empty" in line
    assert "pass --bootstrap" in line


def test_join_as_trainer_with_a_key_the_genesis_does_not_name_exits_2(
    capsys: pytest.CaptureFixture[str], no_network: None, node_home: Path, genesis: Path
) -> None:
    bootstrap = f"/ip4/127.0.0.1/tcp/4001/p2p/{key_named('boot').peer_id}"
    code, _, err = run(
        capsys,
        "join", "--role", "trainer", "--run", str(genesis), "--home", str(node_home),
        "--listen", LOOPBACK, "--bootstrap", bootstrap,
    )  # fmt: skip
    assert code == 2
    assert "is not a trainer of this run" in " ".join(err.split())


def test_join_on_a_port_in_use_says_so_and_exits_2(
    capsys: pytest.CaptureFixture[str], node_home: Path, genesis: Path
) -> None:
    bootstrap = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{key_named('boot').peer_id}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, _, err = run(
            capsys,
            "join", "--role", "inference", "--run", str(genesis), "--home", str(node_home),
            "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--bootstrap", bootstrap,
        )  # fmt: skip
    assert code == 2
    line = " ".join(err.split())
    assert f"cannot listen on /ip4/127.0.0.1/tcp/{port}: Address already in use" in line


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--engine", "vllm"), "--engine vllm needs vllm: pip install 'swarm-node[gpu]'"),
        (("--engine", "tensorrt"), "--engine 'tensorrt' is unknown; use torch or vllm"),
        (("--device", "cuda:3"), "--device cuda:3: this machine has no CUDA GPU"),
        (("--device", "tpu"), "--device 'tpu' is not cpu, cuda or cuda:N"),
        (("--dtype", "float16"), "--dtype 'float16' is unknown; use float32 or bfloat16"),
    ],
)
def test_join_refuses_an_engine_or_device_this_machine_lacks_before_any_network_use(
    capsys: pytest.CaptureFixture[str],
    no_network: None,
    node_home: Path,
    genesis: Path,
    flags: tuple[str, str],
    says: str,
) -> None:
    """This machine has no GPU and no vllm: each a one-line error with the fix, exit 2."""
    bootstrap = f"/ip4/127.0.0.1/tcp/4001/p2p/{key_named('boot').peer_id}"
    code, _, err = join(capsys, node_home, genesis, "--bootstrap", bootstrap, *flags)
    assert code == 2, err
    assert says in " ".join(err.split()) and "Traceback" not in err


def broken_copy(src: Path, dst: Path, *, vocab: int | None = None, template: bool = True) -> Path:
    import json
    import shutil

    shutil.copytree(src, dst)
    if vocab is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["vocab_size"] = vocab
        (dst / "config.json").write_text(json.dumps(cfg))
    if not template:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        del cfg["chat_template"]
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("vocab", "template", "says"),
    [
        (300, True, "uses 512 ids but the model's vocab_size is 300: it is not this model's"),
        (None, False, "has no chat template"),
    ],
)
def test_join_refuses_a_model_whose_tokenizer_does_not_fit_before_any_network_use(
    capsys: pytest.CaptureFixture[str],
    no_network: None,
    node_home: Path,
    tmp_path: Path,
    hf_model_dir: Path,
    vocab: int | None,
    template: bool,
    says: str,
) -> None:
    model = broken_copy(hf_model_dir, tmp_path / "model", vocab=vocab, template=template)
    owner = tmp_path / "owner"
    assert run(capsys, "init", "--home", str(owner))[0] == 0
    path = tmp_path / "genesis.run"
    code, _, err = run(
        capsys,
        "run", "create", "--name", "m", "-o", str(path), "--home", str(owner),
        "--trainer", key_named("t").peer_id, "--validator", key_named("v").peer_id,
        "--model", str(model), "--chat-template",
    )  # fmt: skip
    if code == 2:  # run create refuses a missing template already (and join then too)
        assert says in " ".join(err.split()), err
        return
    assert code == 0, err
    bootstrap = f"/ip4/127.0.0.1/tcp/4001/p2p/{key_named('boot').peer_id}"
    code, _, err = join(capsys, node_home, path, "--bootstrap", bootstrap, "--model", str(model))
    assert code == 2, err
    assert says in " ".join(err.split()) and "Traceback" not in err


@pytest.mark.parametrize(
    ("role", "flags", "says"),
    [
        ("trainer", ("--nproc", "0"), "--nproc 0 is not a number of processes; give 1 or more"),
        ("inference", ("--nproc", "2"), "an inference node uses one device: drop --nproc"),
        ("validator", ("--nproc", "2"), "a validator node uses one device: drop --nproc"),
        (
            "trainer",
            ("--nproc", "2", "--device", "cuda"),
            "--nproc 2 on cuda:0 needs 2 CUDA GPUs from cuda:0 on (one per rank) and this"
            " machine has 1; lower --nproc or pick another --device",
        ),
    ],
)
def test_join_refuses_an_nproc_it_cannot_run_before_any_network_use(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_network: None,
    node_home: Path,
    tmp_path: Path,
    role: str,
    flags: tuple[str, ...],
    says: str,
) -> None:
    """A trainer of the run (so only ``--nproc`` is wrong) on a machine with one GPU."""
    from node.compute import devices
    from node.home import NodeHome

    one_gpu = devices.Accelerators(("NVIDIA H200",), vllm=False, note="torch (test)")
    monkeypatch.setattr(devices, "probe", lambda timeout=120.0: one_gpu)
    me = NodeHome(node_home).load_key().peer_id
    owner = tmp_path / "owner"
    assert run(capsys, "init", "--home", str(owner))[0] == 0
    genesis = tmp_path / "mine.run"
    code, _, err = run(
        capsys,
        "run", "create", "--name", "nproc", "-o", str(genesis), "--home", str(owner),
        "--trainer", me, "--validator", me,
    )  # fmt: skip
    assert code == 0, err
    bootstrap = f"/ip4/127.0.0.1/tcp/4001/p2p/{key_named('boot').peer_id}"
    code, _, err = run(
        capsys,
        "join", "--role", role, "--run", str(genesis), "--home", str(node_home),
        "--listen", LOOPBACK, "--bootstrap", bootstrap, *flags,
    )  # fmt: skip
    assert code == 2, err
    assert says in " ".join(err.split()) and "Traceback" not in err
