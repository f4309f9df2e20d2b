"""Creating, writing and loading a run genesis (the file the run owner hands to every node), and
resolving what it binds: the task source (``suite_for``).

A genesis binds its model by a card (``node.model.card``): without ``model`` the embedded default
model's directory is bound as it is at creation. Its tasks (``bind_tasks``) are one of:

- the built-in procedural suite (``task_suite="default"`` and a seed);
- a JSONL data set (``task_suite="jsonl"``) bound by sha256 in ``task_data``;
- a local Hugging Face data set (``task_suite="datasets"``: a ``datasets`` folder or parquet,
  arrow, csv or json files, each bound by sha256 in ``task_files``; columns in ``task_spec``);
- reasoning-gym generators (``task_suite="reasoning-gym"``: version, data sets, configs,
  weights, seed, size and the built items' digest in ``task_spec``).

The held-out evaluation split is the source's last ``eval_size`` items, at most a fifth of them
(``eval_ids``): they are
excluded from training (``suite_for``), and a split whose prompts also appear among the training
items is refused when the genesis is made and when a node loads it."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.model import DEFAULT_MODEL_DIR
from node.model.card import card_for_dir, file_ref, mismatch
from node.tasks import gym, hf
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
HF_TASK_SUITE = hf.SOURCE
GYM_TASK_SUITE = gym.SOURCE
GYM_PREFIX = "reasoning-gym:"
DEFAULT_GYM_SIZE = 1000

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
    tasks: TaskBinding | None = None,
    created_at: int | None = None,
) -> Signed[RunGenesis]:
    """Sign a genesis with the owner's key. Peer IDs are checked before anything is signed.

    ``model``: the card (``node.model.card.card_for_dir``); default: the embedded model's card.
    ``task_data``: a JSONL data set to bind instead of the procedural suite; ``tasks``: any
    source (``bind_tasks``). The evaluation split is checked against the training items."""
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
    if tasks is None:
        tasks = TaskBinding(task_suite) if task_data is None else bind_tasks(str(task_data))
    genesis = RunGenesis(
        name=name,
        created_at=int(time.time() * 1000) if created_at is None else created_at,
        model=model or card_for_dir(DEFAULT_MODEL_DIR, name=DEFAULT_MODEL),
        task_suite=tasks.suite,
        task_seed=task_seed,
        trainers=tuple(dict.fromkeys(trainers)),
        validators=tuple(dict.fromkeys(validators)),
        params=params or RunParams(),
        task_data=tasks.data,
        task_files=tasks.files,
        task_spec=tasks.spec,
    )
    # Loading the source here refuses an evaluation split that overlaps the training items
    # (and anything else a node would refuse) before the genesis is signed.
    suite_for(genesis, tasks.local, cache=tasks.cache)
    return sign(genesis, owner)


@dataclass(frozen=True)
class TaskBinding:
    """What a genesis binds of its task source, and where the owner's copy is."""

    suite: str
    data: FileRef | None = None
    files: tuple[FileRef, ...] = ()
    spec: str = ""
    local: Path | None = None
    """The owner's copy: the JSONL file, or the folder of a ``datasets`` source."""
    cache: Path | None = None
    """Where a reasoning-gym source's built items were cached."""


def bind_tasks(
    tasks: str,
    *,
    task_config: Path | None = None,
    seed: int = 0,
    size: int = DEFAULT_GYM_SIZE,
    columns: Mapping[str, str] | None = None,
    cache: Path | None = None,
) -> TaskBinding:
    """``--tasks`` as a binding: ``default``, ``reasoning-gym:NAME[,NAME...]`` (with
    ``--task-config``), a JSONL file, or a ``datasets`` folder or parquet/arrow/csv file
    (``columns``: ``prompt``, ``answer``, ``verifier_column``, ``verifier``,
    ``target_len_column``). Builds and checks what it binds: one-line ``ConfigError``s."""
    if tasks == DEFAULT_TASK_SUITE:
        return TaskBinding(DEFAULT_TASK_SUITE)
    if tasks.startswith(GYM_PREFIX) or (tasks == GYM_TASK_SUITE and task_config is not None):
        names = [n.strip() for n in tasks.removeprefix(GYM_PREFIX).split(",") if n.strip()]
        if tasks == GYM_TASK_SUITE:
            names = []
        version = gym.installed_version()
        if version is None:
            raise ConfigError("reasoning-gym is not installed here: pip install reasoning-gym")
        spec = gym.GymSpec(version, gym.parse_config(task_config, names), seed, size)
        where = cache or default_task_cache()
        return TaskBinding(GYM_TASK_SUITE, spec=gym.bind(spec, where).to_text(), cache=where)
    path = Path(tasks)
    if path.is_file() and path.suffix.lower() == ".jsonl" and not columns:
        try:
            ref = file_ref(path)
        except OSError as exc:
            raise ConfigError(f"--tasks {path}: cannot read it ({exc.strerror})") from exc
        return TaskBinding(JSONL_TASK_SUITE, data=ref, local=path)
    if not path.exists():
        raise ConfigError(
            f"--tasks {tasks}: no such file or folder; give default, reasoning-gym:NAME[,NAME],"
            " a JSONL file, or a datasets folder / parquet file"
        )
    files = hf.files_of(path)
    columns_spec = hf.HfSpec(hf.layout_of(files), **dict(columns or {}))
    try:
        refs = tuple(file_ref(p) for p in files)
    except OSError as exc:
        raise ConfigError(f"--tasks {path}: cannot read it ({exc.strerror})") from exc
    local = path if path.is_dir() else path.parent
    return TaskBinding(HF_TASK_SUITE, files=refs, spec=columns_spec.to_text(), local=local)


def default_task_cache() -> Path:
    """Where a node without a home caches built reasoning-gym items."""
    return Path(tempfile.gettempdir()) / "swarm-node-tasks"


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


def suite_for(
    genesis: RunGenesis, data_set: Path | None = None, *, cache: Path | None = None
) -> TaskSource:
    """The training tasks a genesis names, without its evaluation split (``eval_ids``). A
    data-set run needs ``data_set``, the local copy of its JSONL file or the folder holding its
    files (``node.run_files`` fetches and checks them); a reasoning-gym run builds its items
    (cached under ``cache``). ``ConfigError`` for a source this software does not know, a
    missing copy, one that differs from the genesis, or an evaluation split that overlaps."""
    source = _source_for(genesis, data_set, cache)
    return _held_out(source, held_out_count(genesis, source.size))


def held_out_count(genesis: RunGenesis, size: int) -> int:
    """Items of the evaluation split: ``eval_size``, but at most a fifth of the source, so a
    small data set keeps most of its items for training (none when evaluation is off)."""
    return min(genesis.params.eval_size, size // 5) if genesis.params.eval_every else 0


def eval_ids(genesis: RunGenesis, source: TaskSource) -> list[int]:
    """The held-out items: the source's last ``held_out_count`` ids (none: no evaluation)."""
    return list(range(source.size - held_out_count(genesis, source.size), source.size))


def _held_out(source: TaskSource, n: int) -> TaskSource:
    if n <= 0:
        return source
    held = range(source.size - n, source.size)
    overlap = _overlap(source, n)
    if overlap is not None:
        train, held_id = overlap
        raise ConfigError(
            f"the evaluation split overlaps the training items: held-out item {held_id} has the"
            f" prompt of training item {train}; deduplicate the data, choose another seed or"
            " lower --param eval_size"
        )
    return source.with_excluded(frozenset(held))


_OVERLAPS: dict[tuple[Any, ...], tuple[int, int] | None] = {}


def _overlap(source: TaskSource, n: int) -> tuple[int, int] | None:
    """The first (training id, held-out id) pair with the same prompt, or None. Cached per
    source: a process starting several nodes of one run checks it once."""
    key: tuple[Any, ...] = (type(source).__name__, getattr(source, "seed", None), source.size, n)
    key += (getattr(source, "sha256", "") or id(source),) if isinstance(source, TaskDataset) else ()
    if key not in _OVERLAPS:
        held = {source.task(i).prompt: i for i in range(source.size - n, source.size)}
        prompts = ((i, source.task(i).prompt) for i in range(source.size - n))
        _OVERLAPS[key] = next(((i, held[p]) for i, p in prompts if p in held), None)
    return _OVERLAPS[key]


def _source_for(genesis: RunGenesis, data_set: Path | None, cache: Path | None) -> TaskSource:
    if genesis.task_suite == DEFAULT_TASK_SUITE:
        return default_suite(genesis.task_seed)
    if genesis.task_suite == GYM_TASK_SUITE:
        spec = gym.GymSpec.from_text(genesis.task_spec)
        where = cache or default_task_cache()
        # Keyed by the cache too: a node with its own home builds (and checks) its own items.
        return _loaded(("gym", genesis.task_spec, where), lambda: gym.load(spec, where))
    if genesis.task_suite == HF_TASK_SUITE and genesis.task_files:
        if data_set is None:
            raise ConfigError(
                f"run uses a data set of {len(genesis.task_files)} file(s)"
                f" ({genesis.task_files[0].name}, ...); pass --tasks DIR or join a swarm with a"
                " peer that serves it"
            )
        for ref in genesis.task_files:
            why = mismatch(ref, data_set / ref.name)
            if why is not None:
                raise ConfigError(
                    f"data set file {data_set / ref.name} {why}; use the run's data set (or"
                    " leave out --tasks to fetch it from peers)"
                )
        spec_h = hf.HfSpec.from_text(genesis.task_spec)
        files = [data_set / ref.name for ref in genesis.task_files]
        key = ("hf", genesis.task_spec, *(ref.sha256 for ref in genesis.task_files))
        return _loaded(key, lambda: hf.load(files, spec_h))
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
        f" {', '.join(map(repr, TASK_SUITES))} (upgrade swarm-node)"
    )


TASK_SUITES = (DEFAULT_TASK_SUITE, JSONL_TASK_SUITE, HF_TASK_SUITE, GYM_TASK_SUITE)
_LOADED: dict[tuple[Any, ...], TaskDataset] = {}


def _loaded(key: tuple[Any, ...], load: Callable[[], TaskDataset]) -> TaskDataset:
    """A loaded data set by what binds it: every node of a process (tests, ``up``) shares one,
    and a node loads its source once however many roles ask."""
    if key not in _LOADED:
        _LOADED[key] = load()
    return _LOADED[key]


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
        **(
            {"task_files": [f"{r.name} {r.size} B sha256 {r.sha256.hex()}" for r in g.task_files]}
            if g.task_files
            else {}
        ),
        **({"task_spec": g.task_spec} if g.task_spec else {}),
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
