"""The model card: which bytes a run's model is, and whether a local directory holds them.

Decisions this module owns:

- What a card binds (``card_for_dir``): every plain file at the top of the model directory
  (config.json, tokenizer files, tokenizer_config.json with the chat template,
  generation_config.json, special_tokens_map.json, ...) by sha256 and size, and the version-0
  weights: the one ``*.safetensors`` file, or a sharded checkpoint (``_weight_paths``): the
  shard files that ``model.safetensors.index.json`` (itself a small file of the card) names in
  its ``weight_map``, in sorted order. A shard the index names but the directory lacks, a
  ``*.safetensors`` the index does not name, a tensor listed or stored twice, several
  ``*.safetensors`` without an index: each is a one-line ``ConfigError`` naming the file. Hidden
  files and other weight formats (``WEIGHT_SUFFIXES``) are not part of a card; a small file
  above ``MAX_SMALL_FILE`` is refused.
- ``chat_template`` defaults to whether the directory has one (``chat_template`` in
  tokenizer_config.json, or ``chat_template.jinja``); asking for it where there is none is refused.
- Checking a directory against a card (``check_dir``) hashes every card file and names the
  first that is missing or differs; the weights are hashed too (a run's v0 is exactly those
  bytes). ``weights_mismatch`` checks version 0 alone: one file, or a directory of shard files.
  ``verified_marker`` records a check, so a cached copy is not hashed at every start.
- Every file is read once per process (``sha256_file``): hashing streams in blocks, and each
  digest is kept by the file's device, inode, size and times (``_digests``), so the card, the
  CLI's early check, the launch's check and the v0 check share one read of a large file. A file
  modified in the last seconds before it is hashed is not remembered (``_RACY_NS``).

Only the standard library here: main processes import this (no torch, no transformers).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

from swarm.errors import ConfigError, MalformedError
from swarm.messages import FileRef, ModelSpec
from swarm.messages.run import MAX_CARD_FILES, MAX_WEIGHT_FILES

MAX_SMALL_FILE = 64 * 1024 * 1024
"""A card's small files are served whole by the run-files protocol; a model's tokenizer.json is
at most a few tens of MiB."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
VERIFIED = ".card-verified"
INDEX = "model.safetensors.index.json"
"""The index of a sharded safetensors checkpoint (``weight_map``: tensor name -> shard file)."""
MAX_HEADER = 100 * 1024 * 1024
"""The largest safetensors header read (the format's own limit)."""


class ModelMismatchError(ConfigError):
    """A local model file that is missing or differs from the run's model card."""


_digests: dict[tuple[int, int, int, int, int], bytes] = {}
"""sha256 of every file this process has hashed, by (device, inode, size, mtime, ctime)."""
_RACY_NS = 2_000_000_000
"""A file modified this shortly before it was hashed is not remembered: a rewrite within the
file system's timestamp granularity could keep its inode, size and times (git's racy-clean
rule). Released model files are older than that; a fresh download is hashed when checked."""


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def sha256_file(path: Path) -> bytes:
    """The file's sha256, streamed in blocks (bounded memory); a file already hashed by this
    process and unchanged since (same inode, size and times) is not read again."""
    started = time.time_ns()
    with path.open("rb") as f:
        st = os.fstat(f.fileno())
        key = _identity(st)
        known = _digests.get(key)
        if known is not None:
            return known
        digest = hashlib.file_digest(f, "sha256").digest()
        # Remembered only if not written to while read, nor just before (``_RACY_NS``).
        if _identity(os.fstat(f.fileno())) == key and started - st.st_mtime_ns > _RACY_NS:
            _digests[key] = digest
    return digest


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
    weights, sharded = _weight_paths(directory, [p for p in entries if p.suffix == ".safetensors"])
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
    refs = tuple(file_ref(p) for p in weights)
    return ModelSpec(
        name=name,
        files=tuple(file_ref(p) for p in small),
        weights=None if sharded else refs[0],
        weight_files=refs if sharded else (),
        chat_template=template if chat_template is None else chat_template,
    )


def _weight_paths(directory: Path, safetensors: list[Path]) -> tuple[list[Path], bool]:
    """The version-0 weights files of ``directory`` in card order, and whether they are the
    shards of a sharded checkpoint (``ConfigError`` naming the file that cannot be bound)."""
    index = directory / INDEX
    if not index.is_file():
        if len(safetensors) == 1:
            return safetensors, False
        if not safetensors:
            raise ConfigError(
                f"{directory} holds no *.safetensors weights; a run binds safetensors weights"
                " (convert the model's weights to safetensors first)"
            )
        raise ConfigError(
            f"{directory} holds {len(safetensors)} *.safetensors files and no {INDEX}; a run"
            " binds exactly one weights file or a sharded checkpoint with its index (add the"
            " checkpoint's index)"
        )
    weight_map = _weight_map(index)
    names = sorted(set(weight_map.values()))
    if len(names) > MAX_WEIGHT_FILES:
        raise ConfigError(
            f"{index} names {len(names)} shards; a card binds at most {MAX_WEIGHT_FILES}"
        )
    present = {p.name for p in safetensors}
    for shard in names:
        if shard not in present:
            raise ConfigError(
                f"{index} names {shard}, which is not in {directory}; copy every shard of the"
                " checkpoint there"
            )
    for p in safetensors:
        if p.name not in names:
            raise ConfigError(
                f"{p} is not named by {INDEX}; a sharded checkpoint binds only its index's"
                " shards (move it out of the model directory)"
            )
    shards = [directory / shard for shard in names]
    _check_shards(index, weight_map, shards)
    return shards, True


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map``: each tensor once, each file a plain ``*.safetensors`` name."""

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(
                    f"{index} lists {key!r} twice; use the index that came with the checkpoint"
                )
            out[key] = value
        return out

    try:
        data = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=no_repeats)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read {index} ({exc}); use the index that came with the checkpoint"
        ) from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index} has no weight_map; use the index that came with the checkpoint")
    for tensor, shard in weight_map.items():
        try:
            if not isinstance(shard, str):
                raise MalformedError("not a file name")
            FileRef(shard, bytes(32), 0)  # a plain file name, no folders
        except MalformedError as exc:
            raise ConfigError(
                f"{index} places tensor {tensor!r} in {str(shard)[:80]!r}, not a plain file name"
                " of the model directory"
            ) from exc
        if not shard.endswith(".safetensors"):
            raise ConfigError(f"{index} names {shard}, which is not a *.safetensors file")
    return weight_map


def _check_shards(index: Path, weight_map: dict[str, str], shards: list[Path]) -> None:
    """Every tensor is stored once, in the shard the index names (headers only)."""
    stored: dict[str, str] = {}
    for shard in shards:
        for tensor in _tensor_names(shard):
            if tensor in stored:
                raise ConfigError(
                    f"{shard} and {stored[tensor]} both hold tensor {tensor!r}: a tensor is listed"
                    " twice; use the checkpoint's own shards"
                )
            stored[tensor] = shard.name
    for tensor, named in weight_map.items():
        if stored.get(tensor) != named:
            where = f"it is in {stored[tensor]}" if tensor in stored else "no shard holds it"
            raise ConfigError(
                f"{index} places tensor {tensor!r} in {named}, but {where}; use the index that"
                " came with the shards"
            )


def _tensor_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header (``ConfigError`` if it has none)."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(
            f"{path} is not a safetensors file ({exc}); use the checkpoint's own shards"
        ) from exc
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a safetensors file; use the checkpoint's own shards")
    return [k for k in header if k != "__metadata__"]


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


def weights_mismatch(card: ModelSpec, path: Path) -> str | None:
    """Why ``path`` is not the card's version-0 weights (None when it is, or the card binds no
    weights). ``path`` is the one weights file, or a directory holding every weights file by its
    name (a sharded v0); a ``*.safetensors`` there that the card does not bind is a mismatch
    too, since loading a directory reads each of them."""
    refs = card.all_weights()
    if not refs:
        return None
    if not path.exists():
        return "is missing"
    if not path.is_dir():
        if len(refs) != 1:
            return f"is one file where the run's genesis binds {len(refs)} shard files"
        return mismatch(refs[0], path)
    for ref in refs:
        why = mismatch(ref, path / ref.name)
        if why is not None:
            return f"file {ref.name} {why}"
    bound = {ref.name for ref in refs}
    extra = sorted(p.name for p in path.glob("*.safetensors") if p.name not in bound)
    if extra:
        return f"holds {extra[0]}, which the run's genesis does not bind"
    return None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


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
    for ref in card.all_files():  # each file read once per process (sha256_file)
        why = mismatch(ref, directory / ref.name)
        if why is not None:
            raise ModelMismatchError(
                f"{what} {directory}: {ref.name} {why}; use the run's model (or leave out"
                " --model to fetch it from peers)"
            )


def mark_verified(card: ModelSpec, directory: Path) -> None:
    """Record that ``directory`` holds exactly ``card`` (only for directories we own)."""
    (directory / VERIFIED).write_text(card.card_id() + "\n")


def matches(card: ModelSpec, directory: Path, *, trust_marker: bool = False) -> bool:
    try:
        check_dir(card, directory, trust_marker=trust_marker)
    except ConfigError:
        return False
    return True
