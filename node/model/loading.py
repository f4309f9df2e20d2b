"""Model configuration and loading from a local directory (never from the network).

A model directory is a Hugging Face causal-LM directory: ``config.json`` plus weights in
``model.safetensors`` (or sharded safetensors with an index). The embedded default model lives in
``node/model/default/``; ``--model PATH`` names any other local directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.model import tokenizer
from swarm.errors import ConfigError

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default"

DTYPES = ("float32", "bfloat16")


def default_config() -> dict[str, Any]:
    """``config.json`` of the embedded default model: a tiny byte-level Llama (~0.7M params)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer.VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": tokenizer.BOS_ID,
        "eos_token_id": tokenizer.EOS_ID,
        "pad_token_id": tokenizer.PAD_ID,
        "torch_dtype": "bfloat16",
    }


@dataclass(frozen=True)
class ModelInfo:
    """What an engine needs to know about a loaded model."""

    path: str
    vocab_size: int
    hidden_size: int
    eos_id: int
    pad_id: int


def model_info(path: str | Path) -> ModelInfo:
    """Read ``config.json`` of a local model directory; :class:`ConfigError` if unusable."""
    p = Path(path)
    cfg_path = p / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{p} is not a model directory: cannot read config.json ({exc}); "
            "pass --model with a local Hugging Face model directory"
        ) from exc
    if not any(p.glob("*.safetensors")):
        raise ConfigError(f"{p} holds no *.safetensors weights")
    try:
        eos = cfg.get("eos_token_id")
        eos_id = int(eos[0] if isinstance(eos, list) else eos)
        pad = cfg.get("pad_token_id")
        return ModelInfo(
            str(p),
            int(cfg["vocab_size"]),
            int(cfg["hidden_size"]),
            eos_id,
            int(pad) if pad is not None else eos_id,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg_path} lacks vocab_size/hidden_size/eos_token_id ({exc})") from exc


def torch_dtype(name: str) -> Any:
    """The torch dtype for ``"float32"`` or ``"bfloat16"``."""
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {name!r}")
    return torch.float32 if name == "float32" else torch.bfloat16


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """A transformers causal LM from a local directory, in eval mode, on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_info(path)  # clear error first
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(path), config=config, local_files_only=True, dtype=torch_dtype(dtype)
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load the model in {path}: {exc}") from exc
    return model.to(device).eval()  # type: ignore[arg-type]


def load_weights_into(model: Any, weights: str | Path) -> None:
    """Replace ``model``'s weights with a safetensors file (a new policy version)."""
    import torch
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"cannot read policy weights {weights}: {exc}") from exc
    ref = next(model.parameters())
    state = {k: v.to(dtype=ref.dtype, device=ref.device) for k, v in state.items()}
    try:
        with torch.no_grad():
            model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ConfigError(f"policy weights {weights} do not fit the model: {exc}") from exc
