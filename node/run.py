"""Creating, writing and loading a run genesis (the file the run owner hands to every node)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from node.tasks.suite import TaskSuite, default_suite
from swarm.errors import ConfigError, MalformedError, SwarmError
from swarm.identity import NodeKey, public_from_peer_id
from swarm.messages import ModelSpec, RunGenesis, RunParams, Signed, decode, run_id_of, sign

DEFAULT_MODEL = "swarm-node/tiny-byte-llama"
DEFAULT_TASK_SUITE = "default"


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
    created_at: int | None = None,
) -> Signed[RunGenesis]:
    """Sign a genesis with the owner's key. Peer IDs are checked before anything is signed."""
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
        model=model or ModelSpec(name=DEFAULT_MODEL),
        task_suite=task_suite,
        task_seed=task_seed,
        trainers=tuple(dict.fromkeys(trainers)),
        validators=tuple(dict.fromkeys(validators)),
        params=params or RunParams(),
    )
    return sign(genesis, owner)


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
    except SwarmError as exc:
        raise type(exc)(
            f"run genesis {path} failed verification ({exc}); it was changed after signing or is"
            " not a genesis: ask the run owner for the original file"
        ) from exc


def suite_for(genesis: RunGenesis) -> TaskSuite:
    """The task suite a genesis names; ``ConfigError`` for one this software does not ship."""
    if genesis.task_suite != DEFAULT_TASK_SUITE:
        raise ConfigError(
            f"run uses task suite {genesis.task_suite!r}; this swarm-node ships only"
            f" {DEFAULT_TASK_SUITE!r} (upgrade swarm-node)"
        )
    return default_suite(genesis.task_seed)


def describe(genesis: Signed[RunGenesis]) -> Mapping[str, object]:
    """A plain view of a genesis for printing (``run show``)."""
    g = genesis.message
    return {
        "run_id": run_id_of(genesis),
        "name": g.name,
        "owner": genesis.signer,
        "created_at_ms": g.created_at,
        "model": g.model.name,
        "model_manifest": g.model.manifest_id.hex(),
        "task_suite": g.task_suite,
        "task_seed": g.task_seed,
        "trainers": list(g.trainers),
        "validators": list(g.validators),
        "params": g.params.to_wire(),
    }
