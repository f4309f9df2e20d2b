"""Creating, writing and loading a run genesis (the file the run owner hands to every node), and
resolving what it binds: the task source (``suite_for``).

A genesis binds its model by a card (``node.model.card``): without ``model`` the embedded default
model's directory is bound as it is at creation. Its tasks are the built-in procedural suite
(``task_suite="default"`` and a seed) or a JSONL data set (``task_suite="jsonl"``) bound by
sha256 in ``task_data``."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from node.model import DEFAULT_MODEL_DIR
from node.model.card import card_for_dir, file_ref, mismatch
from node.tasks.dataset import TaskDataset, load_dataset
from node.tasks.suite import TaskSuite, default_suite
from swarm.errors import ConfigError, MalformedError, SwarmError
from swarm.identity import NodeKey, public_from_peer_id
from swarm.messages import (
    FileRef,
    ModelSpec,
    RunGenesis,
    RunParams,
    Signed,
    decode,
    run_id_of,
    sign,
)

DEFAULT_MODEL = "swarm-node/tiny-byte-llama"
DEFAULT_TASK_SUITE = "default"
JSONL_TASK_SUITE = "jsonl"

TaskSource = TaskSuite | TaskDataset
"""What a run's tasks come from: the procedural suite or a data set (the same interface)."""


def parse_params(pairs: Sequence[str]) -> RunParams:
    """``["key=value", ...]`` from the command line into checked run parameters."""
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--param {pair!r} is not of the form key=value")
        values[key.strip()] = value.strip()
    try:
        return RunParams.from_map(values, strings=True)
    except MalformedError as exc:
        raise ConfigError(str(exc)) from exc


def create_genesis(
    owner: NodeKey,
    *,
    name: str,
    trainers: Sequence[str],
    validators: Sequence[str],
    params: RunParams | None = None,
    model: ModelSpec | None = None,
    task_suite: str = DEFAULT_TASK_SUITE,
    task_seed: int = 0,
    task_data: Path | None = None,
    created_at: int | None = None,
) -> Signed[RunGenesis]:
    """Sign a genesis with the owner's key. Peer IDs are checked before anything is signed.

    ``model``: the card (``node.model.card.card_for_dir``); default: the embedded model's card.
    ``task_data``: a JSONL data set to bind instead of the procedural suite."""
    for role, peers in (("trainer", trainers), ("validator", validators)):
        if not peers:
            raise ConfigError(f"a run needs at least one {role}: pass --{role} PEER_ID")
        for peer in peers:
            try:
                public_from_peer_id(peer)
            except MalformedError as exc:
                raise ConfigError(
                    f"--{role} {peer!r}: {exc}; give a node's `swarm-node id`"
                ) from exc
    genesis = RunGenesis(
        name=name,
        created_at=int(time.time() * 1000) if created_at is None else created_at,
        model=model or card_for_dir(DEFAULT_MODEL_DIR, name=DEFAULT_MODEL),
        task_suite=task_suite if task_data is None else JSONL_TASK_SUITE,
        task_seed=task_seed,
        trainers=tuple(dict.fromkeys(trainers)),
        validators=tuple(dict.fromkeys(validators)),
        params=params or RunParams(),
        task_data=None if task_data is None else _data_set_ref(task_data),
    )
    return sign(genesis, owner)


def _data_set_ref(path: Path) -> FileRef:
    try:
        ref = file_ref(path)
    except OSError as exc:
        raise ConfigError(f"--tasks {path}: cannot read it ({exc.strerror})") from exc
    load_data_set(path)  # a file that does not parse is refused before it is bound
    return ref


def write_genesis(genesis: Signed[RunGenesis], path: Path) -> None:
    """Write atomically: a reader never sees half a genesis."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(genesis.raw)
    tmp.replace(path)


def load_genesis(path: Path) -> Signed[RunGenesis]:
    """Read and verify a genesis file; any problem is a ``SwarmError`` naming the file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read run genesis {path}: {exc.strerror}") from exc
    try:
        return decode(data, RunGenesis)
    except ConfigError as exc:  # signed and intact, but naming rules this version cannot follow
        raise ConfigError(f"run genesis {path}: {exc}") from exc
    except SwarmError as exc:
        raise type(exc)(
            f"run genesis {path} failed verification ({exc}); it was changed after signing or is"
            " not a genesis: ask the run owner for the original file"
        ) from exc


def suite_for(genesis: RunGenesis, data_set: Path | None = None) -> TaskSource:
    """The task suite a genesis names. A data-set run needs ``data_set``, the local copy of its
    JSONL file (``node.run_files`` fetches and checks it); ``ConfigError`` for a suite this
    software does not ship, a missing copy, or one that differs from the genesis."""
    if genesis.task_suite == DEFAULT_TASK_SUITE:
        return default_suite(genesis.task_seed)
    if genesis.task_suite == JSONL_TASK_SUITE and genesis.task_data is not None:
        ref = genesis.task_data
        if data_set is None:
            raise ConfigError(
                f"run uses the data set {ref.name} (sha256 {ref.sha256.hex()[:16]}); pass"
                " --tasks FILE or join a swarm with a peer that serves it"
            )
        why = mismatch(ref, data_set)
        if why is not None:
            raise ConfigError(
                f"data set {data_set} {why}; use the run's {ref.name} (or leave out --tasks to"
                " fetch it from peers)"
            )
        return load_data_set(data_set)
    raise ConfigError(
        f"run uses task suite {genesis.task_suite!r}; this swarm-node knows"
        f" {DEFAULT_TASK_SUITE!r} and {JSONL_TASK_SUITE!r} (upgrade swarm-node)"
    )


def load_data_set(path: Path) -> TaskDataset:
    """A JSONL data set as a task suite (the parser and verifiers live in ``node.tasks``)."""
    return load_dataset(path)


def describe(genesis: Signed[RunGenesis]) -> Mapping[str, object]:
    """A plain view of a genesis for printing (``run show``)."""
    g = genesis.message
    return {
        "run_id": run_id_of(genesis),
        "name": g.name,
        "owner": genesis.signer,
        "created_at_ms": g.created_at,
        "model": g.model.name,
        **_card_view(g.model),
        "task_suite": g.task_suite,
        **(
            {}
            if g.task_data is None
            else {"task_data": f"{g.task_data.name} sha256 {g.task_data.sha256.hex()}"}
        ),
        "task_seed": g.task_seed,
        "trainers": list(g.trainers),
        "validators": list(g.validators),
        "params": g.params.to_wire(),
    }


def _card_view(card: ModelSpec) -> dict[str, object]:
    if not card.bound:
        return {"model_card": "none (a run created before model cards: nodes use their own)"}
    return {
        "model_card": card.card_id(),
        "model_files": [f"{r.name} {r.size} B sha256 {r.sha256.hex()}" for r in card.all_files()],
        "chat_template": card.chat_template,
    }
