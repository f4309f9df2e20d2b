"""Prompt assignment: which prompts a worker's n-th request covers, and with which seed.

A worker never chooses its prompts or its sampling seed (easy prompts or lucky seeds could be
picked), nor how many requests it makes of a version (it could make many and submit the lucky
ones). Decisions this module owns:

- **Counters are bounded** (``within_quota``): a worker's requests of one policy version are
  numbered ``0 .. quota - 1``, ``quota`` a genesis parameter (``RunParams.quota``, requests per
  worker per version). A counter at or above it is refused before any work; what a worker does
  not submit of its quota is visible in the ledger (``swarm.ledger.views.QuotaUse``).
- **Nothing is computable before the version exists.** The digest mixes the version's manifest
  id (the sha256 of the trainer's signed SHARDCAST manifest, 32 bytes), which nobody knows until
  the trainer has cut and signed that version::

      digest = sha256(b"swarm-node/assignment/2\\0" | manifest_id | run \\0 version \\0 worker
                      \\0 counter)

  (``run``, ``version``, ``worker`` and ``counter`` as UTF-8 text, decimal for the numbers; the
  manifest id is fixed-length and comes first, so no two inputs give the same bytes.)
- **Legacy runs replay as they were.** A genesis signed before quotas existed reads as
  ``quota = 0`` (``swarm.messages.run.LEGACY_PARAMS``): counters are unbounded and the digest is
  the old one, without the manifest (``manifest_id=None``)::

      digest = sha256(b"swarm-node/assignment/1\\0" | run \\0 version \\0 worker \\0 counter)

  ``assignment_key`` says which of the two a run uses, so the worker, the validator and the
  audit cannot disagree on it.

From the digest, for both::

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
_DOMAIN_2 = b"swarm-node/assignment/2\0"
MANIFEST_ID_BYTES = 32
_MAX_DRAWS = 1 << 16


@dataclass(frozen=True, slots=True)
class Assignment:
    seed: int
    prompt_ids: tuple[int, ...]


def within_quota(counter: int, quota: int) -> bool:
    """True when ``counter`` is one of a worker's requests of a version (``0 .. quota - 1``;
    any counter of a legacy run, ``quota == 0``)."""
    return counter >= 0 and (quota == 0 or counter < quota)


def quota_refusal(counter: int, quota: int) -> str | None:
    """The one-line reason a counter is refused before any work, or None when it is in the
    quota."""
    if within_quota(counter, quota):
        return None
    return (
        f"request counter {counter} is outside the quota: a worker makes requests 0..{quota - 1}"
        f" of each policy version (quota={quota}), then waits for the next version"
    )


def assignment_key(quota: int, manifest_id: bytes | None) -> bytes | None:
    """The manifest id a run's assignment mixes: None for a legacy run (``quota == 0``), else
    ``manifest_id``, which must then be known (``ConfigError`` saying so)."""
    if quota == 0:
        return None
    if manifest_id is None:
        raise ConfigError(
            "the assignment of a run with a quota mixes the policy version's manifest id, and"
            " it is not known here; fetch that version (or its announcement) first"
        )
    return manifest_id


def assign(
    run_id: str,
    version: int,
    worker: str,
    counter: int,
    *,
    n_prompts: int,
    suite_size: int,
    excluded: Container[int] = frozenset(),
    manifest_id: bytes | None = None,
) -> Assignment:
    """The prompts and seed of ``worker``'s ``counter``-th request for policy ``version``.

    ``manifest_id``: the version's manifest id (runs with a quota); None: the legacy assignment
    (``quota == 0``). Use ``assignment_key`` to pick between them from the run's quota."""
    if n_prompts < 1 or suite_size < n_prompts:
        raise ConfigError(f"cannot draw {n_prompts} prompts from a suite of {suite_size}")
    fields = f"{run_id}\0{version}\0{worker}\0{counter}".encode()
    if manifest_id is None:
        digest = hashlib.sha256(_DOMAIN + fields).digest()
    else:
        if len(manifest_id) != MANIFEST_ID_BYTES:
            raise ConfigError(
                f"a manifest id is {MANIFEST_ID_BYTES} bytes (a sha256), not {len(manifest_id)}"
            )
        digest = hashlib.sha256(_DOMAIN_2 + manifest_id + fields).digest()
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
