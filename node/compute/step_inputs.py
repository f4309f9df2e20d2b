"""What a training step and its replay both prepare (``node.compute.train_child`` and
``node.compute.train_state``, which must not import each other): the prompts of groups that
carry only their text, tokenized; the model's tied parameters. Imports no torch: the node
process loads ``train_child`` for its client classes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from node.compute.groups import Group


def tokenize_prompts(groups: list[Group], text: Any) -> list[Group]:
    """Fill in the token ids of groups that carry only their prompt's text, with the run
    model's own tokenizer and chat template (``text``: a ``node.model.text.ModelText``)."""
    ids: dict[str, list[int]] = {}
    out = []
    for g in groups:
        if g.prompt or not g.text:
            out.append(g)
            continue
        if g.text not in ids:
            ids[g.text] = list(text.encode_prompt(g.text))
        out.append(replace(g, prompt=ids[g.text]))
    return out


# -- the child side ------------------------------------------------------------------------------


def tied_copies(model: Any) -> dict[str, str]:
    """Names of tied parameters after the first (``lm_head.weight`` of a model whose embedding
    is tied), each with the name that is stored: a version's file holds a tied tensor once, as
    Hugging Face saves it (twice, it was 22% of a Qwen2-0.5B version and of its patches,
    docs/BENCHMARKS.md, Delta SHARDCAST). Loaders fill the copy back in
    (``node.model.loading.load_weights_into``, and ``load`` here)."""
    first: dict[int, str] = {}
    copies: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        stored = first.setdefault(id(param), name)
        if stored != name:
            copies[name] = stored
    return copies
