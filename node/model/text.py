"""The one tokenizer path: a model's own tokenizer and chat template, from its local files.

Decisions this module owns:

- Every role encodes prompts and decodes completions with :class:`ModelText`, loaded by
  ``transformers.AutoTokenizer`` from the model directory with ``local_files_only=True``: the
  embedded byte model (whose ``tokenizer.json`` maps byte ``b`` to id ``b``, made by
  ``scripts/make_default_model.py``) takes the same path as any Hugging Face model.
- A prompt is the task text as the single user turn of the chat template with the generation
  prompt appended (``add_generation_prompt=True``) when the run asks for the template
  (``ModelSpec.chat_template``, read by :func:`chat_template_wanted`); otherwise the
  plain text with the tokenizer's own special tokens (the byte model prepends BOS).
- A completion decodes up to its first stop id (any id of the model's stop set) with special
  tokens skipped; bytes that are not valid UTF-8 decode with replacement characters (a model
  may emit any token).
- EOS and PAD come from the model's files (:func:`node.model.loading.model_info`:
  generation_config.json, then config.json, then the tokenizer's own).
- A tokenizer with more ids than the model's ``vocab_size`` does not belong to the model, and a
  run that asks for a chat template the tokenizer lacks cannot start: both are
  :class:`ConfigError` naming the fix, raised when the text is loaded (the main process checks
  the same from the JSON files first, :func:`node.model.loading.check_model_dir`).

Imports transformers; only the compute child (and the in-process trainer and tests) load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.model.loading import model_info
from swarm.errors import ConfigError

if TYPE_CHECKING:
    from swarm.messages import RunGenesis


def chat_template_wanted(genesis: RunGenesis) -> bool:
    """Whether the run applies the model's chat template to prompts (off unless the genesis's
    model card says so; the embedded model's runs leave it off)."""
    return bool(getattr(genesis.model, "chat_template", False))


class ModelText:
    """A model's tokenizer: prompt encoding (optionally through the chat template) and decoding."""

    def __init__(self, path: str | Path, *, chat_template: bool = False) -> None:
        from transformers import AutoTokenizer

        info = model_info(path)
        try:
            tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"cannot load the tokenizer of {path}: {exc}; a model directory needs its "
                "tokenizer files (tokenizer.json and tokenizer_config.json)"
            ) from exc
        size = len(tok)
        if size > info.vocab_size:
            raise ConfigError(
                f"the tokenizer in {path} has {size} tokens but the model's vocab_size is "
                f"{info.vocab_size}: it is not this model's tokenizer; use the tokenizer files "
                "the model was trained with"
            )
        if chat_template and not getattr(tok, "chat_template", None):
            raise ConfigError(
                f"the run applies the model's chat template but the tokenizer in {path} has "
                "none; add chat_template to tokenizer_config.json or create the run without it"
            )
        self.tokenizer = tok
        self.chat_template = chat_template
        self.eos_id = info.eos_id
        self.stop_ids = frozenset(info.eos_ids or (info.eos_id,))
        self.pad_id = info.pad_id

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a task prompt as the model sees it."""
        if self.chat_template:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return [int(i) for i in ids]

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        return [self.encode_prompt(t) for t in texts]

    def decode(self, tokens: list[int]) -> str:
        """Text of a completion up to its first stop id, special tokens skipped."""
        end = next((i for i, t in enumerate(tokens) if t in self.stop_ids), None)
        if end is not None:
            tokens = tokens[:end]
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))
