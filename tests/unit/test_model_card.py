"""The model card and data set binding: what a genesis binds, and how a local copy is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.model import DEFAULT_MODEL_DIR
from node.model.card import ModelMismatchError, card_for_dir, check_dir, mark_verified
from node.run import create_genesis, describe, suite_for
from node.run_assets import AssetDirs, check_local, local_data_set, local_model
from swarm.errors import ConfigError, MalformedError
from swarm.identity import NodeKey
from swarm.messages import FileRef, ModelSpec, RunGenesis, decode, sign
from swarm.wire import canonical, seal

KEY = NodeKey.from_seed(b"\x03" * 32)
PEER = KEY.peer_id


def fake_model(directory: Path, *, template: bool = True, weights: bytes = b"w" * 100) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"vocab_size": 8, "hidden_size": 4}))
    tok: dict[str, object] = {"eos_token": "<e>"}
    if template:
        tok["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(tok))
    (directory / "tokenizer.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(weights)
    (directory / ".hidden").write_text("not bound")
    return directory


def test_card_binds_every_small_file_and_the_weights(tmp_path: Path) -> None:
    card = card_for_dir(fake_model(tmp_path / "m"), name="m")
    names = [r.name for r in card.files]
    assert names == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert card.weights is not None and card.weights.name == "model.safetensors"
    assert card.weights.size == 100 and card.chat_template and card.bound


def test_chat_template_follows_the_model_unless_told(tmp_path: Path) -> None:
    plain = fake_model(tmp_path / "plain", template=False)
    assert not card_for_dir(plain, name="p").chat_template
    assert not card_for_dir(fake_model(tmp_path / "t"), name="t", chat_template=False).chat_template
    with pytest.raises(ConfigError, match="no chat template"):
        card_for_dir(plain, name="p", chat_template=True)


def test_a_sharded_checkpoint_or_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m")
    (model / "model-2.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="exactly one weights file"):
        card_for_dir(model, name="m")
    with pytest.raises(ConfigError, match=r"no config\.json"):
        card_for_dir(tmp_path, name="x")


def test_a_local_copy_that_differs_is_refused_naming_the_file(tmp_path: Path) -> None:
    card = card_for_dir(fake_model(tmp_path / "m"), name="m")
    check_dir(card, tmp_path / "m")
    other = fake_model(tmp_path / "other")
    (other / "tokenizer_config.json").write_text('{"eos_token": "<x>"}')
    with pytest.raises(ModelMismatchError, match=r"tokenizer_config\.json"):
        check_dir(card, other)
    (other / "tokenizer_config.json").write_text(
        (tmp_path / "m" / "tokenizer_config.json").read_text()
    )
    (other / "model.safetensors").write_bytes(b"v" * 100)  # same size, other bytes
    with pytest.raises(ModelMismatchError, match=r"model.safetensors differs"):
        check_dir(card, other)
    (other / "tokenizer.json").unlink()
    with pytest.raises(ModelMismatchError, match=r"tokenizer\.json is missing"):
        check_dir(card, other)


def test_the_cache_marker_is_trusted_only_for_the_homes_own_cache(tmp_path: Path) -> None:
    card = card_for_dir(fake_model(tmp_path / "m"), name="m")
    dirs = AssetDirs.under(tmp_path / "home")
    assert local_model(card, None, dirs) is None  # not cached, not the embedded model
    cache = fake_model(dirs.model(card), weights=b"z" * 100)
    assert local_model(card, None, dirs) is None  # a wrong cache is not used
    (cache / "model.safetensors").write_bytes(b"w" * 100)
    assert local_model(card, None, dirs) == cache
    mark_verified(card, cache)
    assert local_model(card, None, dirs) == cache
    (cache / "tokenizer.json").unlink()  # lost after the check: the marker is not enough
    assert local_model(card, None, dirs) is None


def test_a_trainer_without_the_model_is_refused_before_network_use(tmp_path: Path) -> None:
    card = card_for_dir(fake_model(tmp_path / "m"), name="m")
    genesis = create_genesis(KEY, name="r", trainers=[PEER], validators=[PEER], model=card)
    dirs = AssetDirs.under(tmp_path / "home")
    check_local(genesis.message, "inference", dirs)  # fetches later
    with pytest.raises(ConfigError, match="a trainer needs the run's model"):
        check_local(genesis.message, "trainer", dirs)
    check_local(genesis.message, "trainer", dirs, model=tmp_path / "m")


def test_without_a_model_run_create_binds_the_embedded_model() -> None:
    genesis = create_genesis(KEY, name="r", trainers=[PEER], validators=[PEER])
    card = genesis.message.model
    assert card.bound and card.weights is not None
    check_dir(card, DEFAULT_MODEL_DIR)
    assert {r.name for r in card.files} >= {"config.json"}
    assert describe(genesis)["model_card"] == card.card_id()


def test_a_genesis_from_before_model_cards_still_loads() -> None:
    old_payload = {
        "name": "old",
        "created_at": 1,
        "model": {"name": "swarm-node/tiny-byte-llama", "config": {}, "manifest_id": b""},
        "task_suite": "default",
        "task_seed": 0,
        "trainers": [PEER],
        "validators": [PEER],
        "params": {},
    }
    payload = canonical(old_payload)
    raw = seal(RunGenesis.KIND, payload, KEY.public, KEY.signature(RunGenesis.KIND, payload))
    genesis = decode(raw, RunGenesis).message
    assert not genesis.model.bound and genesis.task_data is None
    assert genesis.model.to_wire() == old_payload["model"]  # re-encodes byte for byte
    assert local_model(genesis.model, None, AssetDirs.under(Path("/nonexistent"))) == (
        DEFAULT_MODEL_DIR
    )


refs = st.builds(
    FileRef,
    name=st.sampled_from(["config.json", "tokenizer.json", "a", "generation_config.json"]),
    sha256=st.binary(min_size=32, max_size=32),
    size=st.integers(0, 2**40),
)


@given(
    files=st.lists(refs, max_size=4, unique_by=lambda r: r.name),
    weights=st.one_of(st.none(), refs.map(lambda r: FileRef("w.safetensors", r.sha256, r.size))),
    chat_template=st.booleans(),
    task_data=st.one_of(st.none(), refs),
)
def test_card_and_data_set_fields_round_trip(
    files: list[FileRef], weights: FileRef | None, chat_template: bool, task_data: FileRef | None
) -> None:
    card = ModelSpec("m", files=tuple(files), weights=weights, chat_template=chat_template)
    genesis = RunGenesis(
        name="r",
        created_at=1,
        model=card,
        task_suite="jsonl" if task_data else "default",
        task_seed=0,
        trainers=(PEER,),
        validators=(PEER,),
        task_data=task_data,
    )
    back = decode(sign(genesis, KEY).raw, RunGenesis).message
    assert back == genesis and back.model.card_id() == card.card_id()


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "..", ""])
def test_bound_file_names_are_plain_names(name: str) -> None:
    with pytest.raises(MalformedError):
        FileRef(name, b"\0" * 32, 1)


def test_a_data_set_is_bound_by_sha256_and_a_different_copy_refused(tmp_path: Path) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    genesis = create_genesis(
        KEY, name="r", trainers=[PEER], validators=[PEER], task_data=data
    ).message
    assert genesis.task_suite == "jsonl" and genesis.task_data is not None
    assert suite_for(genesis, data).task(1).answer == "4"
    with pytest.raises(ConfigError, match="pass --tasks FILE"):
        suite_for(genesis)
    changed = tmp_path / "changed.jsonl"
    changed.write_text(data.read_text().replace('"4"', '"5"'))
    with pytest.raises(ConfigError, match=r"--tasks .*changed.jsonl differs"):
        local_data_set(genesis, changed, AssetDirs.under(tmp_path))
    with pytest.raises(ConfigError, match="differs"):
        suite_for(genesis, changed)


def test_a_data_set_that_does_not_parse_is_not_bound(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no answer"}\n')
    with pytest.raises(ConfigError):
        create_genesis(KEY, name="r", trainers=[PEER], validators=[PEER], task_data=bad)
