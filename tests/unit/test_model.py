"""The embedded default model, its tokenizer and model-directory loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.model import DEFAULT_MODEL_DIR, default_config, load_causal_lm, model_info
from node.model import tokenizer as tok
from swarm.errors import ConfigError


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
