"""Models as they ship: a model card binds a sharded safetensors checkpoint (the index as a small
file, every shard by sha256 and size in the index's order), refuses one that cannot be bound with
one line naming the file, hashes each file once per process, and loads a directory of shards
like one file. An unsharded card encodes exactly as before."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from cli.app import main
from node.model import DEFAULT_MODEL_DIR, load_causal_lm, load_weights_into
from node.model.card import (
    INDEX,
    ModelMismatchError,
    card_for_dir,
    check_dir,
    mark_verified,
    weights_mismatch,
)
from node.model.loading import read_weights, weight_files
from node.run import create_genesis
from node.run_assets import AssetDirs, check_local, local_model
from swarm.errors import ConfigError, MalformedError
from swarm.identity import NodeKey
from swarm.messages import FileRef, ModelSpec, RunGenesis, decode
from tests.sharded_model import shard_name, sharded_model

KEY = NodeKey.from_seed(b"\x05" * 32)
PEER = KEY.peer_id
SHARDS = [shard_name(i, 3) for i in (1, 2, 3)]


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    return sharded_model(tmp_path / "sharded")


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def index_of(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / INDEX).read_text())
    return data


# -- binding --------------------------------------------------------------------------------


def test_a_sharded_checkpoint_binds_its_index_and_every_shard_in_order(sharded: Path) -> None:
    card = card_for_dir(sharded, name="sharded")
    assert card.bound and card.sharded and card.weights is None
    assert [r.name for r in card.weight_files] == SHARDS == [r.name for r in card.all_weights()]
    assert INDEX in [r.name for r in card.files]
    for ref in card.weight_files:
        data = (sharded / ref.name).read_bytes()
        assert ref.sha256 == hashlib.sha256(data).digest() and ref.size == len(data)
    assert card.weights_size() == sum((sharded / n).stat().st_size for n in SHARDS)
    check_dir(card, sharded)


def test_an_unsharded_card_encodes_exactly_as_before(tmp_path: Path) -> None:
    # The ids below are what the code before sharded cards computed for these directories.
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 8, "hidden_size": 4}')
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 100)
    card = card_for_dir(model, name="pinned")
    assert card.card_id() == "eeeb3d2b4348248d55498d398edb3022"
    assert "weight_files" not in card.to_wire() and not card.sharded
    embedded = card_for_dir(DEFAULT_MODEL_DIR, name="swarm-node/tiny-byte-llama")
    assert embedded.card_id() == "234f2d9997f7c1af44739d4876274c24"
    assert sorted(embedded.to_wire()) == ["config", "files", "manifest_id", "name", "weights"]


def test_a_sharded_card_round_trips_on_the_wire(sharded: Path) -> None:
    card = card_for_dir(sharded, name="sharded")
    wire = card.to_wire()
    assert "weights" not in wire and [f["name"] for f in wire["weight_files"]] == SHARDS
    genesis = create_genesis(KEY, name="r", trainers=[PEER], validators=[PEER], model=card)
    back = decode(genesis.raw, RunGenesis).message.model
    assert back == card and back.card_id() == card.card_id() and back.sharded


def test_a_card_binds_one_weights_file_or_safetensors_shards_never_both() -> None:
    ref = FileRef("model.safetensors", b"\0" * 32, 1)
    shard = FileRef(SHARDS[0], b"\1" * 32, 1)
    with pytest.raises(MalformedError, match="not both"):
        ModelSpec("m", weights=ref, weight_files=(shard,))
    with pytest.raises(MalformedError, match="not safetensors"):
        ModelSpec("m", weight_files=(FileRef("model.bin", b"\0" * 32, 1),))
    with pytest.raises(MalformedError, match="twice"):
        ModelSpec("m", weight_files=(shard, shard))


def _missing_shard(d: Path) -> None:
    (d / SHARDS[1]).unlink()


def _unnamed_safetensors(d: Path) -> None:
    shutil.copyfile(d / SHARDS[0], d / "extra.safetensors")


def _no_index(d: Path) -> None:
    (d / INDEX).unlink()


def _tensor_in_two_shards(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    first, last = load_file(str(d / SHARDS[0])), load_file(str(d / SHARDS[2]))
    name = sorted(first)[0]
    save_file({**last, name: first[name]}, str(d / SHARDS[2]), metadata={"format": "pt"})


def _tensor_listed_twice(d: Path) -> None:
    text = (d / INDEX).read_text()
    name, shard = next(iter(index_of(d)["weight_map"].items()))
    entry = f'"{name}": "{shard}"'
    (d / INDEX).write_text(text.replace(entry, f'{entry},\n    "{name}": "{SHARDS[2]}"', 1))


def _wrong_shard_in_index(d: Path) -> None:
    index = index_of(d)
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = SHARDS[2]
    (d / INDEX).write_text(json.dumps(index))


def _not_a_plain_name(d: Path) -> None:
    index = index_of(d)
    index["weight_map"][next(iter(index["weight_map"]))] = "../" + SHARDS[0]
    (d / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("damage", "named", "why"),
    [
        (_missing_shard, INDEX, rf"names {SHARDS[1]}, which is not in"),
        (_unnamed_safetensors, "extra.safetensors", r"is not named by model\.safetensors\.index"),
        (_no_index, "sharded", r"3 \*\.safetensors files and no model\.safetensors\.index\.json"),
        (_tensor_in_two_shards, SHARDS[2], "both hold tensor"),
        (_tensor_listed_twice, INDEX, "twice"),
        (_wrong_shard_in_index, INDEX, "places tensor"),
        (_not_a_plain_name, INDEX, "not a plain file name"),
    ],
)
def test_a_checkpoint_that_cannot_be_bound_is_refused_in_one_line_naming_the_file(
    sharded: Path, damage: Any, named: str, why: str
) -> None:
    damage(sharded)
    before = snapshot(sharded)
    with pytest.raises(ConfigError, match=why) as info:
        card_for_dir(sharded, name="sharded")
    message = str(info.value)
    assert "\n" not in message and named in message
    assert snapshot(sharded) == before  # nothing written


def test_run_create_refuses_a_bad_checkpoint_and_writes_no_genesis(
    capsys: pytest.CaptureFixture[str], sharded: Path, tmp_path: Path
) -> None:
    home, genesis = tmp_path / "home", tmp_path / "run.genesis"
    _missing_shard(sharded)
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                *("run", "create", "--home", str(home), "--name", "r", "-o", str(genesis)),
                *("--trainer", PEER, "--validator", PEER, "--model", str(sharded)),
            ]
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and SHARDS[1] in err and len(err.splitlines()) == 1, err
    assert not genesis.exists()


# -- checking -------------------------------------------------------------------------------


def test_weights_mismatch_checks_one_file_or_a_directory_of_shards(
    sharded: Path, tmp_path: Path
) -> None:
    card = card_for_dir(sharded, name="sharded")
    v0 = tmp_path / "v0"
    v0.mkdir()
    for name in SHARDS:
        shutil.copyfile(sharded / name, v0 / name)
    (v0 / ".complete").write_text("")  # files that are not safetensors are not weights
    assert weights_mismatch(card, v0) is None
    assert weights_mismatch(card, sharded) is None  # the model directory itself
    assert weights_mismatch(card, v0 / SHARDS[0]) == (
        "is one file where the run's genesis binds 3 shard files"
    )
    shutil.copyfile(sharded / SHARDS[0], v0 / "stray.safetensors")
    assert (
        weights_mismatch(card, v0)
        == "holds stray.safetensors, which the run's genesis does not bind"
    )
    (v0 / "stray.safetensors").unlink()
    data = bytearray((v0 / SHARDS[1]).read_bytes())
    data[-1] ^= 1
    (v0 / SHARDS[1]).unlink()  # a new file, as a fetch writes one
    (v0 / SHARDS[1]).write_bytes(bytes(data))
    assert weights_mismatch(card, v0) == (
        f"file {SHARDS[1]} differs from the file the run's genesis binds (sha256)"
    )
    (v0 / SHARDS[1]).unlink()
    assert weights_mismatch(card, v0) == f"file {SHARDS[1]} is missing"
    assert weights_mismatch(card, tmp_path / "nowhere") == "is missing"

    single = card_for_dir(DEFAULT_MODEL_DIR, name="one")
    assert weights_mismatch(single, DEFAULT_MODEL_DIR / "model.safetensors") is None
    assert weights_mismatch(single, sharded / SHARDS[0]) is not None
    assert weights_mismatch(ModelSpec("unbound"), tmp_path / "nowhere") is None


def test_a_local_copy_with_a_differing_shard_is_refused_naming_it(
    sharded: Path, tmp_path: Path
) -> None:
    card = card_for_dir(sharded, name="sharded")
    other = sharded_model(tmp_path / "other")
    data = bytearray((other / SHARDS[2]).read_bytes())
    data[-1] ^= 1
    (other / SHARDS[2]).unlink()
    (other / SHARDS[2]).write_bytes(bytes(data))
    with pytest.raises(ModelMismatchError, match=rf"{SHARDS[2]} differs"):
        check_dir(card, other)
    (other / SHARDS[0]).unlink()
    with pytest.raises(ModelMismatchError, match=rf"{SHARDS[0]} is missing"):
        check_dir(card, other)


def test_the_cache_of_a_sharded_card_is_found_and_trusted(sharded: Path, tmp_path: Path) -> None:
    card = card_for_dir(sharded, name="sharded")
    dirs = AssetDirs.under(tmp_path / "home")
    assert local_model(card, None, dirs) is None
    shutil.copytree(sharded, dirs.model(card))
    mark_verified(card, dirs.model(card))
    assert local_model(card, None, dirs) == dirs.model(card)
    (dirs.model(card) / SHARDS[1]).unlink()  # lost since: the marker is not enough
    assert local_model(card, None, dirs) is None


def test_each_file_is_hashed_once_per_process(
    sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[str] = []
    real = hashlib.file_digest

    def counting(f: Any, digest: str) -> Any:
        read.append(Path(f.name).name)
        return real(f, digest)

    monkeypatch.setattr(hashlib, "file_digest", counting)
    old = time.time_ns() - 3600 * 10**9  # a model downloaded an hour ago
    for p in sharded.iterdir():
        os.utime(p, ns=(old, old))
    card = card_for_dir(sharded, name="sharded")
    genesis = create_genesis(KEY, name="r", trainers=[PEER], validators=[PEER], model=card)
    dirs = AssetDirs.under(tmp_path / "home")
    check_local(genesis.message, "trainer", dirs, model=sharded)  # the CLI's early check
    assert local_model(card, sharded, dirs) == sharded  # the launch's check
    check_dir(card, sharded, what="trainer model")  # the trainer's publish of v0
    assert weights_mismatch(card, sharded) is None
    assert sorted(read) == sorted(r.name for r in card.all_files())  # each once

    # A file written since is read again, and its new bytes are seen (the same inode and size).
    data = bytearray((sharded / SHARDS[0]).read_bytes())
    data[-1] ^= 1
    (sharded / SHARDS[0]).write_bytes(bytes(data))
    with pytest.raises(ModelMismatchError, match=SHARDS[0]):
        check_dir(card, sharded)
    assert read.count(SHARDS[0]) == 2


# -- loading --------------------------------------------------------------------------------


def test_loading_a_directory_of_shards_gives_the_same_weights_as_one_file(
    sharded: Path, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    one = load_file(str(DEFAULT_MODEL_DIR / "model.safetensors"))
    model = load_causal_lm(DEFAULT_MODEL_DIR)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    # As SHARDCAST stores a sharded version: the shard files by name, no index.
    v0 = tmp_path / "v0"
    v0.mkdir()
    for name in SHARDS:
        shutil.copyfile(sharded / name, v0 / name)
    for source in (v0, sharded):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        load_weights_into(model, source)
        state = model.state_dict()
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[k], reference[k]) for k in reference)
        back = read_weights(source)
        assert back.keys() == one.keys() and all(torch.equal(back[k], one[k]) for k in one)
    assert weight_files(sharded) == [sharded / n for n in SHARDS]
    hf = load_causal_lm(sharded).state_dict()  # transformers reads the index itself
    assert all(torch.equal(hf[k], reference[k]) for k in reference)


def test_loading_refuses_a_tensor_in_two_files_before_changing_the_model(
    sharded: Path, tmp_path: Path
) -> None:
    import torch

    model = load_causal_lm(DEFAULT_MODEL_DIR)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    v0 = tmp_path / "v0"
    v0.mkdir()
    for name in SHARDS:
        shutil.copyfile(sharded / name, v0 / name)
    shutil.copyfile(sharded / SHARDS[0], v0 / "model-again.safetensors")
    with pytest.raises(ConfigError, match="twice"):
        load_weights_into(model, v0)
    (v0 / "model-again.safetensors").unlink()
    (v0 / SHARDS[2]).unlink()
    with pytest.raises(ConfigError, match=r"do not fit the model \(missing"):
        load_weights_into(model, v0)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
