"""`run create --model/--tasks` binds a model card and a data set; `join` refuses local copies
that differ, naming the file, with one line and exit 2 before any network use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.system.test_cli_identity import run
from tests.unit.test_model_card import fake_model
from tests.unit.test_task_sources import parquet_dir

DIAL_NOWHERE = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


@pytest.fixture
def owner(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> tuple[Path, str]:
    home = tmp_path / "owner"
    code, out, err = run(capsys, "init", "--home", str(home))
    assert code == 0, err
    return home, out.split("peer id:")[1].split()[0]


def tasks_file(path: Path) -> Path:
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "x", "answer": "y"}\n')
    return path


def create(
    capsys: pytest.CaptureFixture[str], owner: tuple[Path, str], out: Path, *extra: str
) -> tuple[int, str, str]:
    home, peer = owner
    return run(
        capsys,
        *("run", "create", "--home", str(home), "--name", "m", "-o", str(out)),
        *("--trainer", peer, "--validator", peer, *extra),
    )


def test_run_create_binds_the_model_card_and_the_data_set(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, owner: tuple[Path, str]
) -> None:
    model = fake_model(tmp_path / "my-model")
    genesis = tmp_path / "run.genesis"
    code, _, err = create(
        capsys,
        owner,
        genesis,
        "--model",
        str(model),
        "--tasks",
        str(tasks_file(tmp_path / "t.jsonl")),
    )
    assert code == 0, err
    code, out, _ = run(capsys, "run", "show", str(genesis), "--json")
    view = json.loads(out)
    assert view["model"] == "my-model" and len(view["model_card"]) == 32
    names = [line.split()[0] for line in view["model_files"]]
    assert names == ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]
    assert view["chat_template"] is True
    assert view["task_suite"] == "jsonl" and view["task_data"].startswith("t.jsonl sha256 ")


def test_run_create_binds_reasoning_gym_with_its_version_and_digest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, owner: tuple[Path, str]
) -> None:
    genesis = tmp_path / "gym.genesis"
    code, _, err = create(
        capsys,
        owner,
        genesis,
        *("--tasks", "reasoning-gym:leg_counting,spell_backward", "--task-size", "50"),
        *("--task-seed", "5", "--param", "eval_size=4"),
    )
    assert code == 0, err
    code, out, _ = run(capsys, "run", "show", str(genesis), "--json")
    view = json.loads(out)
    spec = json.loads(view["task_spec"])
    assert view["task_suite"] == "reasoning-gym" and spec["size"] == 50 and spec["seed"] == 5
    assert [d["name"] for d in spec["datasets"]] == ["leg_counting", "spell_backward"]
    assert spec["version"] == "0.1.25" and len(spec["digest"]) == 64
    assert view["params"]["eval_size"] == 4 and view["params"]["eval_every"] == 10


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "/nonexistent"], "no config.json"),
        (["--no-chat-template", "--model", "TEMPLATELESS", "--chat-template"], "no chat template"),
        (["--tasks", "/nonexistent.jsonl"], "no such file or folder"),
        (["--tasks", "BAD_TASKS"], "bad.jsonl:1"),
        (["--tasks", "reasoning-gym:no_such_gym"], "has no data set 'no_such_gym'"),
        (["--tasks", "PARQUET", "--prompt-column", "q"], "has no column 'q'"),
        (["--tasks", "PARQUET", "--verifier", "fuzzy"], "--verifier 'fuzzy' is not one of"),
    ],
)
def test_run_create_bad_model_or_data_set_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    owner: tuple[Path, str],
    extra: list[str],
    message: str,
) -> None:
    templateless = fake_model(tmp_path / "plain", template=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no answer"}\n')
    parquet = parquet_dir(tmp_path / "pq")
    swap = {"TEMPLATELESS": str(templateless), "BAD_TASKS": str(bad), "PARQUET": str(parquet)}
    code, _, err = create(capsys, owner, tmp_path / "g", *[swap.get(a, a) for a in extra])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "g").exists()


def test_join_refuses_a_local_model_or_data_set_that_differs_naming_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, owner: tuple[Path, str]
) -> None:
    model = fake_model(tmp_path / "run-model")
    genesis = tmp_path / "run.genesis"
    tasks = tasks_file(tmp_path / "t.jsonl")
    assert create(capsys, owner, genesis, "--model", str(model), "--tasks", str(tasks))[0] == 0
    other = fake_model(tmp_path / "other-model")
    (other / "tokenizer.json").write_text('{"changed": 1}')
    home, _ = owner
    join = ("join", "--home", str(home), "--run", str(genesis), "--bootstrap", DIAL_NOWHERE)

    code, _, err = run(capsys, *join, "--role", "inference", "--model", str(other))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "tokenizer.json" in err and "other-model" in err

    changed = tmp_path / "changed.jsonl"
    changed.write_text(tasks.read_text() + '{"prompt": "z", "answer": "w"}\n')
    code, _, err = run(capsys, *join, "--role", "validator", "--tasks", str(changed))
    assert code == 2 and "changed.jsonl" in err and "genesis" in err, err

    code, _, err = run(capsys, *join, "--role", "trainer")
    assert code == 2 and "a trainer needs the run's model" in err.replace("\n", " "), err
