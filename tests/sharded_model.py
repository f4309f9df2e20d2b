"""A model directory as large released models ship: the embedded default model with its weights
re-saved as shard files plus ``model.safetensors.index.json``, the layout transformers'
``save_pretrained(max_shard_size=...)`` writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from node.model import DEFAULT_MODEL_DIR
from node.model.card import INDEX


def shard_name(i: int, parts: int) -> str:
    return f"model-{i:05d}-of-{parts:05d}.safetensors"


def sharded_model(out: Path, *, source: Path = DEFAULT_MODEL_DIR, parts: int = 3) -> Path:
    """Copy ``source``'s small files to ``out`` and split its ``model.safetensors`` into
    ``parts`` shard files of consecutive tensors, with the index naming each tensor's shard."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for p in sorted(source.iterdir()):
        if p.is_file() and p.suffix != ".safetensors":
            shutil.copyfile(p, out / p.name)
    state = load_file(str(source / "model.safetensors"))
    names = sorted(state)
    step = -(-len(names) // parts)
    weight_map: dict[str, str] = {}
    for i in range(parts):
        chunk = names[i * step : (i + 1) * step]
        shard = shard_name(i + 1, parts)
        save_file({n: state[n] for n in chunk}, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return out
