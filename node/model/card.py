"""The model card: which bytes a run's model is, and whether a local directory holds them.

Decisions this module owns:

- What a card binds (``card_for_dir``): every plain file at the top of the model directory
  (config.json, tokenizer files, tokenizer_config.json with the chat template,
  generation_config.json, special_tokens_map.json, ...) by sha256 and size, and the one
  ``*.safetensors`` file as the version-0 weights. Hidden files and other weight formats
  (``WEIGHT_SUFFIXES``) are not part of a card. A small file above ``MAX_SMALL_FILE`` and a
  sharded checkpoint are refused: the card names one weights file, which SHARDCAST carries.
- ``chat_template`` defaults to whether the directory has one (``chat_template`` in
  tokenizer_config.json, or ``chat_template.jinja``); asking for it where there is none is refused.
- Checking a directory against a card (``check_dir``) hashes every card file and names the
  first that is missing or differs; the weights are hashed too (a run's v0 is exactly those
  bytes). ``verified_marker`` records a check, so a cached copy is not hashed at every start.

Only hashlib and json here: main processes import this (no torch, no transformers).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from swarm.errors import ConfigError
from swarm.messages import FileRef, ModelSpec
from swarm.messages.run import MAX_CARD_FILES

MAX_SMALL_FILE = 64 * 1024 * 1024
"""A card's small files are served whole by the run-files protocol; a model's tokenizer.json is
at most a few tens of MiB."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
VERIFIED = ".card-verified"
_HASH_BLOCK = 1 << 20


class ModelMismatchError(ConfigError):
    """A local model file that is missing or differs from the run's model card."""


def sha256_file(path: Path) -> bytes:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.digest()


def file_ref(path: Path) -> FileRef:
    return FileRef(path.name, sha256_file(path), path.stat().st_size)


def has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def card_for_dir(directory: Path, *, name: str, chat_template: bool | None = None) -> ModelSpec:
    """The card of a local model directory (``ConfigError`` for one that cannot be bound)."""
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"{directory} is not a model directory (no config.json); pass --model with a local"
            " Hugging Face model directory"
        )
    entries = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    weights = [p for p in entries if p.suffix == ".safetensors"]
    if len(weights) != 1:
        raise ConfigError(
            f"{directory} holds {len(weights)} *.safetensors files; a run binds exactly one"
            " weights file (merge a sharded checkpoint into model.safetensors first)"
        )
    small = [p for p in entries if p.suffix not in WEIGHT_SUFFIXES]
    if len(small) > MAX_CARD_FILES:
        raise ConfigError(f"{directory} holds {len(small)} files; a card binds at most 64")
    for p in small:
        if p.stat().st_size > MAX_SMALL_FILE:
            raise ConfigError(
                f"{p} is {p.stat().st_size >> 20} MiB; a card's small files are at most"
                f" {MAX_SMALL_FILE >> 20} MiB (move it out of the model directory)"
            )
    template = has_chat_template(directory)
    if chat_template and not template:
        raise ConfigError(
            f"--chat-template: {directory} has no chat template (tokenizer_config.json"
            " 'chat_template' or chat_template.jinja); add one or pass --no-chat-template"
        )
    return ModelSpec(
        name=name,
        files=tuple(file_ref(p) for p in small),
        weights=file_ref(weights[0]),
        chat_template=template if chat_template is None else chat_template,
    )


def mismatch(ref: FileRef, path: Path) -> str | None:
    """Why ``path`` is not the card's file ``ref`` (None when it is)."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != ref.size:
        return f"has {size} bytes where the run's genesis binds {ref.size}"
    if sha256_file(path) != ref.sha256:
        return "differs from the file the run's genesis binds (sha256)"
    return None


_checked: set[tuple[str, str, tuple[tuple[str, int, int], ...]]] = set()
"""Directories this process has checked, keyed by card and every file's size and mtime, so the
CLI's early check and the launch's check hash a large weights file once."""


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _stamp(card: ModelSpec, directory: Path) -> tuple[str, str, tuple[tuple[str, int, int], ...]]:
    stats = []
    for ref in card.all_files():
        try:
            st = (directory / ref.name).stat()
        except OSError:
            return ("", "", ())
        stats.append((ref.name, st.st_size, st.st_mtime_ns))
    return (str(directory.resolve()), card.card_id(), tuple(stats))


def check_dir(
    card: ModelSpec, directory: Path, *, what: str = "--model", trust_marker: bool = False
) -> None:
    """Every card file is in ``directory`` with the card's bytes; else ``ModelMismatchError``
    naming the file. ``trust_marker``: a directory of ours that ``mark_verified`` recorded
    for this card is not hashed again (the home's cache)."""
    if trust_marker:
        marker = directory / VERIFIED
        if (
            marker.is_file()
            and marker.read_text().strip() == card.card_id()
            and all(_size(directory / ref.name) == ref.size for ref in card.all_files())
        ):
            return  # hashed when the marker was written; sizes catch a file lost since
    stamp = _stamp(card, directory)
    if stamp in _checked:
        return
    for ref in card.all_files():
        why = mismatch(ref, directory / ref.name)
        if why is not None:
            raise ModelMismatchError(
                f"{what} {directory}: {ref.name} {why}; use the run's model (or leave out"
                " --model to fetch it from peers)"
            )
    if stamp[0]:
        _checked.add(stamp)


def mark_verified(card: ModelSpec, directory: Path) -> None:
    """Record that ``directory`` holds exactly ``card`` (only for directories we own)."""
    (directory / VERIFIED).write_text(card.card_id() + "\n")


def matches(card: ModelSpec, directory: Path, *, trust_marker: bool = False) -> bool:
    try:
        check_dir(card, directory, trust_marker=trust_marker)
    except ConfigError:
        return False
    return True
