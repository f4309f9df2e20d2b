"""The run genesis: who may publish policies, who may judge work, and the rules of the run.

``run_id`` is the first 16 bytes of the genesis envelope's id, as 32 lowercase hex characters.
Every DHT key, gossip topic and stream protocol of the run is namespaced by it.

Parameters travel as a map of ints, bools and strings (signed payloads hold no floats); real
numbers are decimal strings that ``RunParams`` parses and checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from swarm.errors import ConfigError, MalformedError
from swarm.identity import public_from_peer_id
from swarm.messages._base import Fields, Signed, typed
from swarm.messages.evaluation import MAX_EVAL_ITEMS
from swarm.sampling import SAMPLERS
from swarm.wire import canonical


def run_id_of(genesis: Signed[RunGenesis]) -> str:
    return genesis.id[:16].hex()


SERVE_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True, slots=True)
class RunParams:
    """The run's parameters with their defaults (the design's recipe)."""

    async_level: int = 2
    group_size: int = 16
    temperature: float = 1.0
    max_tokens: int = 32
    learning_rate: float = 1e-4
    batch_prompts: int = 8
    submissions_per_step: int = 1
    max_grad_norm: float = 0.1
    clip_epsilon: float = 0.2
    clip_delta: float = 4.0
    entropy_coef: float = 0.001
    kl_coef: float = 0.0
    length_penalty: float = 0.0
    shard_size: int = 32 * 1024 * 1024
    toploc_max_exp_mismatches: int = 38
    toploc_max_mant_mean: float = 10.0
    toploc_max_mant_median: float = 8.0
    toploc_max_submission_mant_mean: float = 0.0
    """Mean mantissa error over all of a submission's proof chunks (0 = off). Small models need
    it: 1% weight noise stays inside the per-chunk thresholds but not inside this aggregate."""
    initial_balance: int = 100
    ban_threshold: int = 0
    slash_amount: int = 1000
    credit_per_sample: int = 1
    rejudge_share: float = 0.05
    """The share of other validators' accepted work each validator judges again (0 = off, 1 =
    all); a disagreement becomes a signed dispute that the audit settles by replay."""
    sampler: str = "gumbel-2"
    """The seeded sampler (:mod:`swarm.sampling`): ``gumbel-2`` (integer noise, the same bits on
    every device) or ``gumbel-1`` (numpy Philox on the CPU; every genesis made before issue 24)."""
    quota: int = 64
    """Requests per worker per policy version: a worker's counters lie in ``[0, quota)`` and the
    assignment mixes the version's manifest id (0 = unbounded counters and the assignment of
    runs made before issue 24)."""
    tie_tol_fp32: float = 0.001
    """Sampling check: the largest score gap (logits/T units) tolerated between the validator's
    best token and the sampled one when worker and validator both ran float32 (the campaign,
    ``bench/calibrate.py``: honest float32 pairs differ by at most 3e-5; 1e-3 leaves room for
    other devices)."""
    tie_tol_bf16: float = 1.1
    """The same when either side ran bfloat16 (campaign: honest gaps up to 0.39, shifts of a
    contender's score up to 0.72 across precisions and attention kernels; 1.5x that)."""
    max_tolerated_per_1k: int = 30
    """Tolerated positions per 1,000 tokens that a sample, and a submission's samples together,
    may hold (counted as at least 1,000 tokens); past it the work is rejected (0 = no bound).
    Honest bf16 pairs hold at most 0.3% of positions (campaign)."""
    serve_dtype: str = "bfloat16"
    """The dtype policy versions are published in (``SERVE_DTYPES``): what inference runs. The
    trainer keeps float32 master weights and its optimizer in its child either way."""
    snapshot_every: int = 10
    """Every ``snapshot_every``-th version travels whole (a snapshot); the versions between
    travel as patches against their parent (docs/shardcast.md). 1: every version whole."""
    patch_max_share: float = 0.5
    """A patch above this share of its version's full size is not worth it: the trainer
    publishes that version whole instead (a dense update)."""
    eval_every: int = 10
    """Held-out evaluation cadence: versions 0, K, 2K, ... are evaluated (0 = no evaluation;
    10 keeps it under 5% of a validator's time: bench/tasks.py, eval_share;
    ``swarm.messages.evaluation``)."""
    eval_size: int = 32
    """Items of the held-out split: the task source's last ``eval_size`` items, never served
    for training (an evaluation scores each once)."""
    train_audit_share: float = 0.04
    """The share of versions whose step the due validator replays (``swarm.messages.training``;
    0 = off). At 0.04 the audits cost under 5% of the trainer's compute: bench/train_audit.py,
    ``audit_share``."""
    train_state_keep: int = 8
    """Versions whose training state the trainer keeps and serves for audits (the retention
    window; an audit of an older version is refused with the window it holds)."""

    # Keys this version does not know are kept (and re-signed unchanged) but not interpreted.
    extra: Mapping[str, int | str | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"run parameter {f.name} must be finite, got {value}")
            if isinstance(value, (int, float)) and value < 0:
                raise ConfigError(f"run parameter {f.name} must not be negative, got {value}")
        if self.group_size < 2:
            raise ConfigError("run parameter group_size must be at least 2 (GRPO compares a group)")
        if self.max_tokens < 1 or self.shard_size < 1:
            raise ConfigError("run parameters max_tokens and shard_size must be positive")
        if self.rejudge_share > 1:
            raise ConfigError(
                f"run parameter rejudge_share is a share in [0, 1], not {self.rejudge_share}"
            )
        if self.serve_dtype not in SERVE_DTYPES:
            raise ConfigError(
                f"run parameter serve_dtype must be one of {', '.join(SERVE_DTYPES)},"
                f" not {self.serve_dtype[:32]!r}"
            )
        if self.train_audit_share > 1:
            raise ConfigError(
                "run parameter train_audit_share is a share in [0, 1],"
                f" not {self.train_audit_share}"
            )
        if self.train_state_keep < 2:
            raise ConfigError(
                "run parameter train_state_keep must be at least 2 (an audit needs the state"
                " before the step and, across hardware, the state after)"
            )
        if self.snapshot_every < 1:
            raise ConfigError("run parameter snapshot_every must be at least 1 (1: no patches)")
        if self.eval_every and not 1 <= self.eval_size <= MAX_EVAL_ITEMS:
            raise ConfigError(
                f"run parameter eval_size must lie in [1, {MAX_EVAL_ITEMS}] while eval_every is"
                f" set, not {self.eval_size} (eval_every=0 turns evaluation off)"
            )
        if self.sampler not in SAMPLERS:
            raise ConfigError(
                f"the run uses sampler {self.sampler[:32]!r}, which this swarm-node does not know"
                f" (it knows {', '.join(SAMPLERS)}): upgrade swarm-node to join this run"
            )

    def to_wire(self) -> dict[str, int | str | bool]:
        out: dict[str, int | str | bool] = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            out[f.name] = repr(float(value)) if isinstance(value, float) else value
        return out

    @classmethod
    def from_map(cls, values: Mapping[str, Any], *, strings: bool = False) -> Self:
        """Parse a parameter map. ``strings=True`` accepts every value as text (CLI ``k=v``)."""
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, int | str | bool] = {}
        for key, value in values.items():
            if key not in known:
                if not isinstance(value, (int, str, bool)):
                    raise MalformedError(f"run parameter {key!r} has unsupported type")
                extra[key] = value
                continue
            kwargs[key] = _parse_param(key, known[key].type, value, strings=strings)
        return cls(**kwargs, extra=extra)


LEGACY_PARAMS: Mapping[str, int | str] = {
    "sampler": "gumbel-1",
    "quota": 0,
    "tie_tol_fp32": "0.25",
    "tie_tol_bf16": "0.25",
    "max_tolerated_per_1k": 0,
    "serve_dtype": "float32",
    "snapshot_every": 1,
    "eval_every": 0,
    "train_audit_share": "0.0",
}
"""What a genesis signed before issue 24 meant by leaving these keys out: the numpy sampler, one
tolerance of 0.25 at every precision, no near-tie bound, unbounded counters; and before issue 25:
float32 versions, each published whole; and before issue 26: no held-out evaluation; and before
issue 27: no training audits."""


def _parse_param(key: str, annotation: Any, value: Any, *, strings: bool) -> Any:
    wanted = str(annotation)
    try:
        if wanted == "float":
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise TypeError
            return float(value)
        if wanted == "int":
            if strings and isinstance(value, str):
                return int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError
            return value
        if wanted == "str":
            if not isinstance(value, str) or len(value) > 64:
                raise TypeError
            return value
    except (TypeError, ValueError) as exc:
        raise MalformedError(f"run parameter {key}={value!r} is not a valid {wanted}") from exc
    raise MalformedError(f"run parameter {key} has unsupported type {wanted}")


MAX_CARD_FILES = 64
MAX_WEIGHT_FILES = 256
"""Shard files a card binds (the largest released checkpoints hold a few hundred; 256 of them
fit in a genesis with room to spare)."""
MAX_TASK_FILES = 256
MAX_TASK_SPEC = 16 * 1024
_BAD_NAME = frozenset({"", ".", ".."})


@dataclass(frozen=True, slots=True)
class FileRef:
    """A file a run binds by content: a plain file name (no folders), its sha256 and size."""

    name: str
    sha256: bytes
    size: int

    def __post_init__(self) -> None:
        if self.name in _BAD_NAME or "/" in self.name or "\\" in self.name or "\0" in self.name:
            raise MalformedError(f"bound file name {self.name[:80]!r} is not a plain file name")
        if len(self.sha256) != 32:
            raise MalformedError(f"bound file {self.name!r}: sha256 must be 32 bytes")
        if self.size < 0:
            raise MalformedError(f"bound file {self.name!r}: negative size")

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(f.text("name"), f.blob("sha256", length=32), f.integer("size", minimum=0))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Which model the run trains: the model card.

    A bound card names every small file of the Hugging Face directory (``files``: config,
    tokenizer files with the chat template, generation config; for a sharded checkpoint also
    ``model.safetensors.index.json``) and the version-0 weights by sha256 and size: one
    ``weights`` file, or the shard files of a sharded checkpoint (``weight_files``, in the
    index's order: its sorted file names), never both. It also says whether the run applies the
    model's chat template. A genesis written before cards existed has only ``name`` (and the
    unused ``config``/``manifest_id``); such a run binds no model and nodes use their local one.
    """

    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    manifest_id: bytes = b""
    files: tuple[FileRef, ...] = ()
    weights: FileRef | None = None
    """The one weights file of an unsharded model (None for a sharded one: ``weight_files``)."""
    chat_template: bool = False
    weight_files: tuple[FileRef, ...] = ()
    """The shard files of a sharded checkpoint, in order (empty for one ``weights`` file)."""

    def __post_init__(self) -> None:
        names = [ref.name for ref in self.all_files()]
        if len(names) != len(set(names)):
            raise MalformedError("a model card names a file twice")
        if len(self.files) > MAX_CARD_FILES:
            raise MalformedError(f"a model card holds at most {MAX_CARD_FILES} small files")
        if self.weight_files and self.weights is not None:
            raise MalformedError("a model card binds one weights file or shard files, not both")
        if len(self.weight_files) > MAX_WEIGHT_FILES:
            raise MalformedError(f"a model card binds at most {MAX_WEIGHT_FILES} shard files")
        for ref in self.weight_files:
            if not ref.name.endswith(".safetensors"):
                raise MalformedError(f"model card shard file {ref.name[:80]!r} is not safetensors")

    @property
    def bound(self) -> bool:
        """True when the card binds files and weights (a run created with a model card)."""
        return self.weights is not None or bool(self.weight_files)

    @property
    def sharded(self) -> bool:
        """True when version 0 is a sharded checkpoint (``weight_files``)."""
        return bool(self.weight_files)

    def all_weights(self) -> tuple[FileRef, ...]:
        """Every version-0 weights file, in order: the one file, or the shard files."""
        return self.weight_files or (() if self.weights is None else (self.weights,))

    def weights_size(self) -> int:
        """Bytes of version 0 (all weights files together)."""
        return sum(ref.size for ref in self.all_weights())

    def all_files(self) -> tuple[FileRef, ...]:
        return (*self.files, *self.all_weights())

    def card_id(self) -> str:
        """32 hex characters naming this card (the home caches its files under it)."""
        return hashlib.sha256(canonical(self.to_wire())).hexdigest()[:32]

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "config": dict(self.config),
            "manifest_id": self.manifest_id,
        }
        # Written only when set, so a card-less spec encodes exactly as before cards existed,
        # and an unsharded card exactly as before sharded checkpoints could be bound.
        if self.files:
            out["files"] = [ref.to_wire() for ref in self.files]
        if self.weights is not None:
            out["weights"] = self.weights.to_wire()
        if self.weight_files:
            out["weight_files"] = [ref.to_wire() for ref in self.weight_files]
        if self.chat_template:
            out["chat_template"] = True
        return out

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            name=f.text("name"),
            config=f.plain_map("config", {}),
            manifest_id=f.blob("manifest_id", b""),
            files=f.items("files", FileRef.from_wire, []),
            weights=FileRef.from_wire(f.sub("weights")) if f.has("weights") else None,
            chat_template=f.flag("chat_template", False),
            weight_files=f.items("weight_files", FileRef.from_wire, []),
        )


@dataclass(frozen=True, slots=True)
class RunGenesis:
    """Signed by the run owner. Names the trainers and validators by peer ID."""

    KIND: ClassVar[str] = "run-genesis"
    MAX_BYTES: ClassVar[int] = 64 * 1024

    name: str
    created_at: int
    model: ModelSpec
    task_suite: str
    task_seed: int
    trainers: tuple[str, ...]
    validators: tuple[str, ...]
    params: RunParams = field(default_factory=RunParams)
    task_data: FileRef | None = None
    """The JSONL data set of a ``task_suite="jsonl"`` run, bound by sha256."""
    task_files: tuple[FileRef, ...] = ()
    """The files of a ``task_suite="datasets"`` run (a Hugging Face ``datasets`` folder or
    parquet/arrow files), each bound by sha256."""
    task_spec: str = ""
    """The task source's own settings as canonical JSON text (``node.tasks.sources``): the
    reasoning-gym version, data sets, configs, weights, seed, size and built items' digest, or
    a data set's column names. JSON text because configs hold real numbers (signed payloads
    hold none)."""

    def __post_init__(self) -> None:
        for peer in (*self.trainers, *self.validators):
            public_from_peer_id(peer)  # raises MalformedError for anything but an Ed25519 peer ID
        if not self.trainers:
            raise MalformedError("a run genesis names at least one trainer")
        if not self.validators:
            raise MalformedError("a run genesis names at least one validator")
        if len(self.task_files) > MAX_TASK_FILES:
            raise MalformedError(f"a run genesis binds at most {MAX_TASK_FILES} task files")
        if len(self.task_spec) > MAX_TASK_SPEC:
            raise MalformedError(f"a task spec is at most {MAX_TASK_SPEC} characters")

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "created_at": self.created_at,
            "model": self.model.to_wire(),
            "task_suite": self.task_suite,
            "task_seed": self.task_seed,
            "trainers": list(self.trainers),
            "validators": list(self.validators),
            "params": self.params.to_wire(),
            **({} if self.task_data is None else {"task_data": self.task_data.to_wire()}),
            # Written only when set, so a genesis of the suite or of JSONL encodes as before.
            **({"task_files": [r.to_wire() for r in self.task_files]} if self.task_files else {}),
            **({"task_spec": self.task_spec} if self.task_spec else {}),
        }

    @classmethod
    def from_wire(cls, f: Fields) -> Self:
        return cls(
            name=f.text("name"),
            created_at=f.integer("created_at", minimum=0),
            model=ModelSpec.from_wire(f.sub("model")),
            task_suite=f.text("task_suite"),
            task_seed=f.integer("task_seed"),
            trainers=f.seq("trainers", typed(str, "trainers")),
            validators=f.seq("validators", typed(str, "validators")),
            params=RunParams.from_map({**LEGACY_PARAMS, **f.plain_map("params", {})}),
            task_data=FileRef.from_wire(f.sub("task_data")) if f.has("task_data") else None,
            task_files=f.items("task_files", FileRef.from_wire, []),
            task_spec=f.text("task_spec", ""),
        )
