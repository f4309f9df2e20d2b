"""Model configuration and loading from a local directory (never from the network).

A model directory is a Hugging Face causal-LM directory: ``config.json`` plus weights in
``model.safetensors`` (or sharded safetensors with an index). The embedded default model lives in
``node/model/default/``; ``--model PATH`` names any other local directory. A policy version's
weights are one safetensors file or a directory of shard files (``weight_files``); they are read
tensor by tensor (``iter_weights``), so loading never holds a second copy of the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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
    eos_ids: tuple[int, ...] = ()
    """The stop set, ``eos_id`` first: every id of generation_config.json's ``eos_token_id``,
    then config.json's, then the chat template's end-of-turn token (:func:`stop_ids`)."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}; the model directory is damaged") from exc
    return data if isinstance(data, dict) else {}


def _first_id(*values: Any) -> int | None:
    """The first set token id among ``values`` (a list counts by its first entry)."""
    for v in values:
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _all_ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


END_OF_TURN_PROBE = "swarm-node-end-of-turn-probe"
"""Assistant content rendered through a chat template to find what follows an assistant turn."""


def _special_tokens(p: Path) -> dict[str, int]:
    """Content -> id of every special added token (tokenizer.json, then tokenizer_config.json)."""
    out: dict[str, int] = {}
    for t in _read_json(p / "tokenizer.json").get("added_tokens") or []:
        if isinstance(t, dict) and t.get("special") and isinstance(t.get("id"), int):
            out.setdefault(str(t.get("content")), int(t["id"]))
    decoder = _read_json(p / "tokenizer_config.json").get("added_tokens_decoder") or {}
    for key, t in decoder.items() if isinstance(decoder, dict) else ():
        if isinstance(t, dict) and t.get("special") and str(key).isdigit():
            out.setdefault(str(t.get("content")), int(key))
    return out


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def end_of_turn_id(path: str | Path) -> int | None:
    """The special token that ends an assistant turn in the model's chat template, or None.

    The template (``tokenizer_config.json``) is rendered with jinja2's sandbox, as transformers
    renders it, for a user turn and an assistant turn whose content is a probe; the special
    token that starts the text right after the probe (whitespace skipped) ends the turn:
    ``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama-3, ``<end_of_turn>`` for Gemma. A
    template that does not render, or puts no special token there, names none.
    """
    p = Path(path)
    cfg = _read_json(p / "tokenizer_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    specials = _special_tokens(p)
    if not specials:
        return None
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "1 Jan 2026"
    messages = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": END_OF_TURN_PROBE},
    ]
    try:
        text = env.from_string(template).render(
            messages=messages,
            add_generation_prompt=False,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
        )
    except Exception:  # any template failure just means "no end of turn known"
        return None
    at = text.rfind(END_OF_TURN_PROBE)
    if at < 0:
        return None
    rest = text[at + len(END_OF_TURN_PROBE) :].lstrip()
    matches = [c for c in specials if c and rest.startswith(c)]
    return specials[max(matches, key=len)] if matches else None


def stop_ids(path: str | Path, cfg: dict[str, Any] | None = None) -> tuple[int, ...]:
    """The model's stop set, in order, without repeats: generation_config.json's
    ``eos_token_id`` (an id or a list), config.json's, then :func:`end_of_turn_id`."""
    p = Path(path)
    gen = _read_json(p / "generation_config.json")
    cfg = _read_json(p / "config.json") if cfg is None else cfg
    ids = [*_all_ids(gen.get("eos_token_id")), *_all_ids(cfg.get("eos_token_id"))]
    turn = end_of_turn_id(p)
    if turn is not None:
        ids.append(turn)
    return tuple(dict.fromkeys(ids))


def model_info(path: str | Path) -> ModelInfo:
    """Read ``config.json`` of a local model directory; :class:`ConfigError` if unusable.

    EOS and PAD come from the model's files: ``generation_config.json`` first (what the model
    was released to generate with), then ``config.json``; PAD falls back to EOS. The stop set
    (:func:`stop_ids`) adds every other EOS id those files list and the chat template's end of
    turn; an id outside the vocabulary is a :class:`ConfigError`.
    """
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
    gen = _read_json(p / "generation_config.json")
    eos_id = _first_id(gen.get("eos_token_id"), cfg.get("eos_token_id"))
    if eos_id is None:
        raise ConfigError(
            f"{p} names no eos_token_id in generation_config.json or config.json; "
            "add the model's EOS id there"
        )
    pad_id = _first_id(gen.get("pad_token_id"), cfg.get("pad_token_id"))
    pad_id = eos_id if pad_id is None else pad_id
    try:
        vocab, hidden = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg_path} lacks vocab_size/hidden_size ({exc})") from exc
    stops = stop_ids(p, cfg)
    outside = [i for i in stops if not 0 <= i < vocab]
    if outside:
        raise ConfigError(
            f"{p} names EOS id {outside[0]} outside its vocabulary of {vocab} (in "
            "generation_config.json, config.json or the chat template's end of turn); fix the "
            "eos_token_id there or use the model's own files"
        )
    return ModelInfo(str(p), vocab, hidden, eos_id, pad_id, stops)


def tokenizer_size(path: str | Path) -> int:
    """Number of ids ``tokenizer.json`` of a model directory uses (largest id + 1), from JSON."""
    tok = _read_json(Path(path) / "tokenizer.json")
    vocab = (tok.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", -1) for t in tok.get("added_tokens") or [] if isinstance(t, dict)]
    return max((int(i) for i in ids if isinstance(i, int)), default=-1) + 1


def check_model_dir(path: str | Path, *, chat_template: bool = False) -> ModelInfo:
    """The checks a node runs before it starts work, from the JSON files alone (no torch).

    A tokenizer with more ids than the model's vocabulary, a missing ``tokenizer.json`` and a
    chat template the run asks for but the model lacks are each a one-line ``ConfigError``.
    """
    info = model_info(path)
    if not (Path(path) / "tokenizer.json").is_file():
        raise ConfigError(
            f"{path} has no tokenizer.json: every role tokenizes with the model's own tokenizer;"
            " copy the model's tokenizer files into the directory"
        )
    size = tokenizer_size(path)
    if size > info.vocab_size:
        raise ConfigError(
            f"the tokenizer in {path} uses {size} ids but the model's vocab_size is "
            f"{info.vocab_size}: it is not this model's tokenizer; use the tokenizer files the "
            "model was trained with"
        )
    from node.model.card import has_chat_template

    if chat_template and not has_chat_template(Path(path)):
        raise ConfigError(
            f"the run applies the model's chat template but {path} has none; add chat_template "
            "to tokenizer_config.json (or use the model the run was created with)"
        )
    return info


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


def weight_files(weights: str | Path) -> list[Path]:
    """The safetensors files of a policy version: ``weights`` itself, or for a directory (a
    sharded version) the shards its ``model.safetensors.index.json`` names, else every
    ``*.safetensors`` in it, in sorted order."""
    path = Path(weights)
    if not path.is_dir():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no weight_map; the model directory is damaged")
        return [path / str(name) for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"policy weights {path} hold no *.safetensors file")
    return files


def iter_weights(weights: str | Path) -> Iterator[tuple[str, Any]]:
    """Every tensor of a policy version (a file or a directory of shards, :func:`weight_files`)
    as ``(name, tensor)`` on the CPU, one at a time: memory holds one tensor, not the model."""
    from safetensors import SafetensorError, safe_open

    for file in weight_files(weights):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    yield name, f.get_tensor(name)
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            raise ConfigError(f"cannot read policy weights {file}: {exc}") from exc


def read_weights(weights: str | Path) -> dict[str, Any]:
    """All tensors of a policy version (a file or a directory of shards) in one state dict."""
    state: dict[str, Any] = {}
    for name, tensor in iter_weights(weights):
        if name in state:
            raise ConfigError(f"policy weights {weights} hold tensor {name!r} twice")
        state[name] = tensor
    return state


def _shapes(weights: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every tensor of a policy version, from the headers alone."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(weights):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if name in shapes:
                        raise ConfigError(
                            f"policy weights {weights} hold tensor {name!r} twice ({file.name})"
                        )
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            raise ConfigError(f"cannot read policy weights {file}: {exc}") from exc
    return shapes


def load_weights_into(model: Any, weights: str | Path) -> None:
    """Replace ``model``'s weights with a policy version: a safetensors file, or a directory of
    shard files (:func:`weight_files`).

    Every name and shape is checked against the model from the files' headers before anything
    is copied; then tensors are read and copied in one at a time (bounded memory). A Hugging
    Face file stores a tied parameter once (e.g. lm_head tied to the embeddings): every name of
    one shared tensor takes the stored copy.
    """
    import torch

    targets = model.state_dict(keep_vars=True)
    shapes = _shapes(weights)
    unexpected = sorted(set(shapes) - set(targets))
    aliases: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        aliases.setdefault(id(tensor), []).append(name)
    missing = sorted(
        name for names in aliases.values() if not any(n in shapes for n in names) for name in names
    )
    wrong = [n for n in shapes if n in targets and tuple(targets[n].shape) != shapes[n]]
    if unexpected or missing or wrong:
        what = "; ".join(
            f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (("unexpected", unexpected), ("missing", missing), ("shape", wrong))
            if names
        )
        raise ConfigError(f"policy weights {weights} do not fit the model ({what})")
    with torch.no_grad():
        for name, tensor in iter_weights(weights):
            targets[name].copy_(tensor)  # casts to the parameter's dtype and device
