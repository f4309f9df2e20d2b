"""Prompt assignment: which prompts a worker's n-th request covers, and with which seed.

A worker never chooses its prompts or its sampling seed (easy prompts or lucky seeds could be
picked). Both are drawn from ``sha256(run | version | worker | counter)``, which the validator
recomputes from the submission's own fields::

    seed       = first 8 bytes of the digest (big-endian), below 2**63
    prompt ids = ``n_prompts`` distinct ids of [0, suite_size), drawn by a Philox-free,
                 language-neutral rule: id_i = sha256(digest | i) mod suite_size, skipping
                 repeats and excluded ids (the run's offline filter)

Sample ``j`` of the submission is completion ``j % group_size`` of prompt ``j // group_size``,
sampled with (seed, j) — see ``swarm.sampling``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container
from dataclasses import dataclass

from swarm.errors import ConfigError

_DOMAIN = b"swarm-node/assignment/1\0"
_MAX_DRAWS = 1 << 16


@dataclass(frozen=True, slots=True)
class Assignment:
    seed: int
    prompt_ids: tuple[int, ...]


def assign(
    run_id: str,
    version: int,
    worker: str,
    counter: int,
    *,
    n_prompts: int,
    suite_size: int,
    excluded: Container[int] = frozenset(),
) -> Assignment:
    """The prompts and seed of ``worker``'s ``counter``-th request for policy ``version``."""
    if n_prompts < 1 or suite_size < n_prompts:
        raise ConfigError(f"cannot draw {n_prompts} prompts from a suite of {suite_size}")
    digest = hashlib.sha256(_DOMAIN + f"{run_id}\0{version}\0{worker}\0{counter}".encode()).digest()
    seed = int.from_bytes(digest[:8], "big") >> 1
    chosen: dict[int, None] = {}
    for i in range(_MAX_DRAWS):
        if len(chosen) == n_prompts:
            break
        draw = hashlib.sha256(digest + i.to_bytes(4, "big")).digest()
        prompt = int.from_bytes(draw[:8], "big") % suite_size
        if prompt not in excluded:
            chosen.setdefault(prompt)
    if len(chosen) < n_prompts:
        raise ConfigError("the suite has too few prompts left after the offline filter")
    return Assignment(seed=seed, prompt_ids=tuple(chosen))
