"""reasoning-gym as a task source: the genesis binds the generators, every node builds the same
items offline and checks them against the genesis's digest.

Decisions this module owns:

- The spec (:class:`GymSpec`, JSON text in ``RunGenesis.task_spec``) names the reasoning-gym
  release (its distribution version, ``importlib.metadata``: the package's own ``__version__``
  says 0.1.19 in 0.1.25), the data sets with their configs and weights, a seed, a size and the
  sha256 of the built items. Items are mixed by reasoning-gym's own ``CompositeDataset``
  (weighted choice per index, sub-data sets seeded ``seed + i + 1``), so a spec means what it
  means to reasoning-gym's users.
- Items are built in a child process with ``PYTHONHASHSEED=0`` (``python -m
  node.tasks.gym_child``): 8 generators of 0.1.25 iterate sets of strings (codeio,
  intermediate_integration, isomorphic_strings, knight_swap, list_functions,
  polynomial_multiplication, ransom_note, word_ladder), so two processes with other hash seeds
  build other items from the same seed. The child also keeps reasoning-gym's imports (sympy and
  more) out of the node's process. Its output is one canonical JSON item per line; the digest
  is the sha256 of those bytes, and the file is cached under that digest (a later start reads
  it: some generators take 300 ms an item).
- At ``run create`` (``check=True``) each item must survive JSON (gsm_symbolic's do not) and its
  data set's scorer must give the item's own answer 1.0 after the trip (boxnet, graph_color,
  propositional_logic, rubiks_cube, rush_hour, arc_agi and rearc do not in 0.1.25): a run whose
  correct answers score 0 cannot learn, so such a data set is refused, named.
- A task is ``Task(id, family=data set name, prompt=question, answer, verifier="reasoning-gym",
  entry=JSON of data set, config and item)``: the compute child rebuilds the scorer from it
  (:mod:`node.tasks.verifiers`).
- Every problem is a one-line :class:`ConfigError` before any work: reasoning-gym missing or
  of another version (which to install), a data set name the install lacks, built items whose
  digest differs from the genesis.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.model.card import sha256_file
from node.tasks.dataset import TaskDataset
from node.tasks.suite import Task
from swarm.errors import ConfigError

log = logging.getLogger(__name__)

SOURCE = "reasoning-gym"
DISTRIBUTION = "reasoning-gym"
MAX_SIZE = 1_000_000
BUILD_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class GymDataset:
    """One generator of the mix: its reasoning-gym name, config and (unnormalised) weight."""

    name: str
    weight: float = 1.0
    config: Mapping[str, Any] | None = None
    target_len: int | None = None
    """The INTELLECT-2 length penalty's target for this data set's completions (ours, not
    reasoning-gym's: its items name no length); None: no penalty."""

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "weight": self.weight, "config": dict(self.config or {})}
        if self.target_len is not None:
            out["target_len"] = self.target_len
        return out


@dataclass(frozen=True)
class GymSpec:
    version: str
    datasets: tuple[GymDataset, ...]
    seed: int
    size: int
    digest: str = ""
    """sha256 (hex) of the built items; empty until built (``run create`` fills it)."""

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ConfigError("a reasoning-gym source names at least one data set")
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ConfigError(f"a reasoning-gym source names a data set twice: {names}")
        if not 1 <= self.size <= MAX_SIZE:
            raise ConfigError(f"a reasoning-gym source has 1 to {MAX_SIZE} items, not {self.size}")
        for d in self.datasets:
            if not (isinstance(d.weight, int | float) and d.weight > 0):
                raise ConfigError(f"reasoning-gym data set {d.name}: weight must be > 0")

    def to_text(self) -> str:
        """Canonical JSON (sorted keys, no spaces): what the genesis signs."""
        body = {
            "source": SOURCE,
            "version": self.version,
            "datasets": [d.to_json() for d in self.datasets],
            "seed": self.seed,
            "size": self.size,
            "digest": self.digest,
        }
        return canonical_json(body)

    def build_request(self) -> str:
        """What the child builds from (the spec without its digest)."""
        return canonical_json(
            {
                "datasets": [d.to_json() for d in self.datasets],
                "seed": self.seed,
                "size": self.size,
            }
        )

    def scorer_config(self, name: str) -> dict[str, Any]:
        """The config reasoning-gym's composite gives data set ``name``: its own, with the
        derived seed and the size filled in where it names none."""
        for i, d in enumerate(self.datasets):
            if d.name == name:
                cfg = dict(d.config or {})
                cfg.setdefault("seed", self.seed + i + 1)
                cfg.setdefault("size", self.size)
                return cfg
        raise ConfigError(f"item of data set {name!r}, which the source does not name")

    @classmethod
    def from_text(cls, text: str) -> GymSpec:
        try:
            raw = json.loads(text)
            datasets = tuple(
                GymDataset(
                    str(d["name"]),
                    float(d.get("weight", 1.0)),
                    dict(d.get("config") or {}),
                    _target(d.get("target_len")),
                )
                for d in raw["datasets"]
            )
            return cls(
                str(raw["version"]), datasets, int(raw["seed"]), int(raw["size"]), raw["digest"]
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"the genesis's reasoning-gym spec is malformed ({exc})") from exc


def _target(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"a reasoning-gym data set's target_len must be a positive integer, not {value!r}"
        )
    return value


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_install(version: str) -> None:
    """ConfigError (one line: what to install) unless this node has reasoning-gym ``version``."""
    have = installed_version()
    if have != version:
        found = "no reasoning-gym" if have is None else f"reasoning-gym {have}"
        raise ConfigError(
            f"the run builds its tasks with reasoning-gym {version} and this node has {found}:"
            f" pip install reasoning-gym=={version}"
        )


def parse_config(path: Path | None, names: Sequence[str]) -> tuple[GymDataset, ...]:
    """The data sets of ``--tasks reasoning-gym:NAMES`` with ``--task-config FILE``.

    The file is YAML or JSON in reasoning-gym's composite format (``datasets: [{name, weight,
    config}]``, plus our optional ``target_len`` for the length penalty); ``names`` (may be
    empty when the file lists them) picks and orders them, and a name the file leaves out gets
    weight 1 and reasoning-gym's default config."""
    listed: dict[str, GymDataset] = {}
    if path is not None:
        listed = {d.name: d for d in _read_config(path)}
    order = list(names) or list(listed)
    if not order:
        raise ConfigError(
            "name the reasoning-gym data sets: --tasks reasoning-gym:NAME[,NAME...]"
            " (or list them under datasets: in --task-config)"
        )
    return tuple(listed.get(n, GymDataset(n)) for n in order)


def _read_config(path: Path) -> list[GymDataset]:
    try:
        import yaml

        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--task-config {path}: cannot read it ({exc.strerror})") from exc
    except ImportError as exc:
        raise ConfigError(f"--task-config {path}: PyYAML is missing (pip install pyyaml)") from exc
    except Exception as exc:  # yaml.YAMLError: the file's syntax
        why = str(exc).splitlines()[0]
        raise ConfigError(f"--task-config {path}: not YAML or JSON ({why})") from exc
    items = raw.get("datasets") if isinstance(raw, dict) else None
    if not isinstance(items, list) or not items:
        raise ConfigError(
            f"--task-config {path}: expected 'datasets:' with a list of {{name, weight, config}}"
        )
    out = []
    for i, d in enumerate(items):
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            raise ConfigError(f"--task-config {path}: datasets[{i}] needs a name")
        config = d.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"--task-config {path}: datasets[{i}].config must be a map")
        try:
            weight = float(d.get("weight", 1.0))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"--task-config {path}: datasets[{i}].weight is no number") from exc
        out.append(GymDataset(d["name"], weight, config, _target(d.get("target_len"))))
    return out


def build(spec: GymSpec, dest: Path, *, check: bool = False) -> str:
    """Build ``spec``'s items into ``dest`` (one canonical JSON item per line) in a child
    process; returns their sha256. ``check``: also refuse data sets whose items or scorers do
    not survive the trip (``run create``). Leaves nothing at ``dest`` on failure."""
    check_install(spec.version)
    part = dest.with_name(f".{dest.name}.part{os.getpid()}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    args = [sys.executable, "-m", "node.tasks.gym_child", str(part)] + (["--check"] * check)
    log.info("building %d reasoning-gym items (%s)", spec.size, _names(spec))
    try:
        done = subprocess.run(
            args,
            input=spec.build_request(),
            env=env,
            text=True,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit status {done.returncode}"
            raise ConfigError(why.removeprefix("error: "))
        digest = sha256_file(part).hex()
        part.replace(dest)
        return digest
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(
            f"building the reasoning-gym items took over {BUILD_TIMEOUT_S:.0f} s"
        ) from exc
    finally:
        part.unlink(missing_ok=True)


def _names(spec: GymSpec) -> str:
    return ", ".join(d.name for d in spec.datasets)


def bind(spec: GymSpec, cache: Path) -> GymSpec:
    """``spec`` with its digest, building (and checking) its items: what ``run create`` signs."""
    tmp = cache / "reasoning-gym" / f"unbound-{os.getpid()}.jsonl"
    digest = build(spec, tmp, check=True)
    final = items_path(cache, digest)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(final)
    return GymSpec(spec.version, spec.datasets, spec.seed, spec.size, digest)


def items_path(cache: Path, digest: str) -> Path:
    return cache / "reasoning-gym" / f"{digest}.jsonl"


def load(spec: GymSpec, cache: Path) -> TaskDataset:
    """The source's tasks: the cached items when their digest is the genesis's, else built
    afresh and checked. ``ConfigError`` when the built items differ from the genesis."""
    path = items_path(cache, spec.digest)
    data = path.read_bytes() if path.is_file() else b""  # read once: hashed, then parsed
    if hashlib.sha256(data).hexdigest() != spec.digest:
        fresh = path.with_name(f"built-{os.getpid()}.jsonl")
        digest = build(spec, fresh)
        if digest != spec.digest:
            fresh.unlink(missing_ok=True)
            raise ConfigError(
                f"reasoning-gym {spec.version} built items with sha256 {digest[:16]} where the"
                f" genesis binds {spec.digest[:16]} ({_names(spec)}, seed {spec.seed}): this"
                " install generates other items (another platform or patched package?)"
            )
        fresh.replace(path)
        data = path.read_bytes()
    return tasks_of(spec, data)


def tasks_of(spec: GymSpec, data: bytes) -> TaskDataset:
    configs: dict[str, str] = {}
    targets = {d.name: d.target_len for d in spec.datasets}
    tasks = []
    for i, line in enumerate(data.decode("utf-8").splitlines()):
        item = json.loads(line)
        name = item["metadata"]["source_dataset"]
        if name not in configs:
            configs[name] = canonical_json(spec.scorer_config(name))
        entry = f'{{"config":{configs[name]},"dataset":{json.dumps(name)},"item":{line}}}'
        answer = str(item["answer"])
        tasks.append(Task(i, name, 0, item["question"], answer, targets.get(name), SOURCE, entry))
    if len(tasks) != spec.size:
        raise ConfigError(f"reasoning-gym built {len(tasks)} items where the spec says {spec.size}")
    return TaskDataset(tuple(tasks), spec.digest)
