"""The embedded default model, its tokenizer and model-directory loading."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from node.model import DEFAULT_MODEL_DIR, default_config, load_causal_lm, model_info
from node.model import tokenizer as tok
from node.model.loading import check_model_dir
from node.model.text import ModelText
from swarm.errors import ConfigError
from tests.hf_model import make_test_model


def test_default_model_ships_small_with_its_config() -> None:
    weights = DEFAULT_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size < 2 * 1024 * 1024
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert cfg == default_config()
    info = model_info(DEFAULT_MODEL_DIR)
    assert (info.vocab_size, info.hidden_size, info.eos_id) == (259, 128, tok.EOS_ID)


def test_default_model_loads_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_causal_lm(DEFAULT_MODEL_DIR)
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 < n_params < 1_500_000


def test_tokenizer_round_trip_and_specials() -> None:
    ids = tok.encode("rev:abc=")
    assert ids[0] == tok.BOS_ID and ids[1:] == list(b"rev:abc=")
    assert tok.decode([*list(b"cba"), tok.EOS_ID, *list(b"junk")]) == "cba"
    assert tok.decode([tok.BOS_ID, 0xFF, tok.PAD_ID]) == "\ufffd"


def test_bad_model_dirs_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config"):
        model_info(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="safetensors"):
        model_info(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError):
        model_info(tmp_path)
    with pytest.raises(ConfigError):
        load_causal_lm(tmp_path, dtype="float64")


# -- one tokenizer path ------------------------------------------------------------------------


def test_embedded_tokenizer_file_keeps_the_byte_ids() -> None:
    """The shipped tokenizer.json, loaded by transformers, gives exactly the byte tokenizer's
    ids (so the shipped weights still fit) and decodes like it."""
    text = ModelText(DEFAULT_MODEL_DIR)
    rng = random.Random(0)
    samples = ["rev:abc=", "sort:kqzd=", " lead\tand trail \n", "héllo wörld ✓"]
    samples += ["".join(chr(rng.randrange(1, 0x3000)) for _ in range(50)) for _ in range(20)]
    for s in samples:
        assert text.encode_prompt(s) == tok.encode(s)
    for ids in ([*b"cba", tok.EOS_ID, *b"junk"], [tok.BOS_ID, 0xFF, tok.PAD_ID], [0xE2, 0x82]):
        assert text.decode(ids) == tok.decode(ids)
    assert (text.eos_id, text.pad_id) == (tok.EOS_ID, tok.PAD_ID)


def test_make_test_model_is_deterministic_and_loads_offline(
    hf_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = sorted(p.name for p in hf_model_dir.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    again = make_test_model(tmp_path / "again")
    for name in names:
        assert (again / name).read_bytes() == (hf_model_dir / name).read_bytes(), name
    cfg = json.loads((hf_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    model = load_causal_lm(hf_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_chat_template_wraps_the_prompt_when_the_run_asks(hf_model_dir: Path) -> None:
    plain = ModelText(hf_model_dir)
    chat = ModelText(hf_model_dir, chat_template=True)
    assert plain.tokenizer.decode(plain.encode_prompt("rev:abc=")) == "rev:abc="
    rendered = chat.tokenizer.decode(chat.encode_prompt("rev:abc="))
    assert rendered == "<|im_start|>user\nrev:abc=<|im_end|>\n<|im_start|>assistant\n"
    # EOS and PAD from generation_config.json; decoding stops at EOS and drops specials.
    eos = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (chat.eos_id, chat.pad_id) == (
        eos,
        chat.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    body = plain.encode_prompt("cba")
    assert chat.decode([*body, eos, *body]) == "cba"


def test_eos_and_pad_come_from_generation_config_first(tmp_path: Path, hf_model_dir: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(hf_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    info = model_info(model)
    assert (info.eos_id, info.pad_id) == (7, 0)  # pad falls back to config.json's


def test_tokenizer_larger_than_the_model_vocab_is_refused(
    tmp_path: Path, hf_model_dir: Path
) -> None:
    model = tmp_path / "m"
    shutil.copytree(hf_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["vocab_size"] = 300
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="uses 512 ids but the model's vocab_size is 300"):
        check_model_dir(model)
    with pytest.raises(ConfigError, match="has 512 tokens but the model's vocab_size is 300"):
        ModelText(model)


def test_missing_chat_template_is_refused_when_the_run_asks(
    tmp_path: Path, hf_model_dir: Path
) -> None:
    model = tmp_path / "m"
    shutil.copytree(hf_model_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    check_model_dir(model)  # fine when the run does not ask for it
    with pytest.raises(ConfigError, match="applies the model's chat template but"):
        check_model_dir(model, chat_template=True)
    with pytest.raises(ConfigError, match="applies the model's chat template but"):
        ModelText(model, chat_template=True)
    (model / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer"):
        check_model_dir(model)


def test_shipped_tokenizer_files_are_what_make_default_model_writes(tmp_path: Path) -> None:
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "scripts" / "make_default_model.py"
    spec = importlib.util.spec_from_file_location("make_default_model", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (DEFAULT_MODEL_DIR / name).read_bytes(), name
