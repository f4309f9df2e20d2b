"""Local Hugging Face data sets as a task source: a ``datasets`` folder (``save_to_disk``) or
parquet, arrow, CSV or JSON files, loaded with ``datasets`` from local files only.

Decisions this module owns:

- What is bound (``bind``): every file of the folder (or the one file given), each by sha256
  (``RunGenesis.task_files``), plus the layout and the column names (``HfSpec``, JSON text in
  ``RunGenesis.task_spec``). A folder with sub-folders is refused: a ``DatasetDict`` has one per
  split, so the user names the split's folder. Nodes fetch the files from peers like a JSONL
  data set's (``node.run_assets``) and load the same rows in the same order.
- Loading (``load``): ``datasets.load_from_disk`` for a saved folder, else
  ``datasets.load_dataset(layout, data_files=...)`` on the sorted files, with the hub switched
  off (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE``), its cache in a temporary folder (nothing
  left behind) and the rows kept in memory. Row ``i`` is task ``i``.
- Columns: the prompt and the answer by name; the verifier from a column or one name for all
  rows (``exact`` or ``math``); an optional target-length column for the length penalty. Each
  row passes the checks of a JSONL line (``node.tasks.dataset.task_of_row``), named
  ``folder row N``. A named column the data lacks is a one-line error that lists the columns it
  has, before any work.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.tasks.dataset import TaskDataset, task_of_row
from node.tasks.verifiers import DATA_VERIFIERS
from swarm.errors import ConfigError

log = logging.getLogger(__name__)

SOURCE = "datasets"
LAYOUTS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}
SAVED_MARKERS = ("dataset_info.json", "state.json")
MAX_FILES = 256


@dataclass(frozen=True)
class HfSpec:
    layout: str
    """``saved`` (a ``save_to_disk`` folder) or a builder name: parquet, arrow, csv, json."""
    prompt: str = "prompt"
    answer: str = "answer"
    verifier_column: str = ""
    """The column naming each row's verifier; empty: ``verifier`` for every row."""
    verifier: str = "exact"
    target_len_column: str = ""

    def __post_init__(self) -> None:
        if self.layout not in ("saved", *LAYOUTS.values()):
            raise ConfigError(f"unknown data set layout {self.layout!r}")
        if self.verifier not in DATA_VERIFIERS:
            raise ConfigError(
                f"--verifier {self.verifier!r} is not one of {', '.join(DATA_VERIFIERS)}"
            )

    def to_text(self) -> str:
        body = {"source": SOURCE, **self.__dict__}
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> HfSpec:
        try:
            raw = json.loads(text)
            raw.pop("source", None)
            return cls(**raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"the genesis's data set spec is malformed ({exc})") from exc


def files_of(path: Path) -> list[Path]:
    """The files ``--tasks PATH`` binds: the one file, or every file of the folder, sorted."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"--tasks {path}: no such file or folder")
    entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
    folders = [p.name for p in entries if p.is_dir()]
    if folders:
        raise ConfigError(
            f"--tasks {path} holds folders ({', '.join(folders[:4])}): a DatasetDict has one per"
            f" split; pass the split's folder, e.g. --tasks {path / folders[0]}"
        )
    if not entries:
        raise ConfigError(f"--tasks {path}: the folder is empty")
    if len(entries) > MAX_FILES:
        raise ConfigError(f"--tasks {path}: more than {MAX_FILES} files; merge them")
    return entries


def layout_of(files: Sequence[Path]) -> str:
    names = {p.name for p in files}
    if all(m in names for m in SAVED_MARKERS):
        return "saved"
    kinds = {LAYOUTS.get(p.suffix.lower().replace(".jsonl", ".json")) for p in files}
    if len(kinds) != 1 or None in kinds:
        listed = ", ".join(sorted(p.name for p in files)[:5])
        raise ConfigError(
            f"data set files ({listed}) are not one of: a save_to_disk folder, or parquet,"
            " arrow, csv or json files of one kind"
        )
    return str(kinds.pop())


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - a default dependency
        raise ConfigError("this node lacks the datasets package: pip install datasets") from exc
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _where(files: Sequence[Path], layout: str) -> Path:
    """What errors name: the folder, or the one file given."""
    return files[0].parent if layout == "saved" or len(files) > 1 else files[0]


def _rows(files: Sequence[Path], layout: str) -> Any:
    datasets = _datasets()
    where = _where(files, layout)
    try:
        if layout == "saved":
            table = datasets.load_from_disk(str(files[0].parent), keep_in_memory=True)
            if not isinstance(table, datasets.Dataset):
                raise ConfigError(f"{where} is a DatasetDict; pass one split's folder")
            return table
        with tempfile.TemporaryDirectory(prefix="swarm-datasets-") as cache:
            return datasets.load_dataset(
                layout,
                data_files=[str(p) for p in files],
                split="train",
                cache_dir=cache,
                keep_in_memory=True,
            )
    except ConfigError:
        raise
    except Exception as exc:  # datasets' and pyarrow's errors: the file's contents
        cause = exc.__cause__ or exc
        why = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise ConfigError(f"data set {where} cannot be read by datasets: {why}") from exc


def load(files: Sequence[Path], spec: HfSpec) -> TaskDataset:
    """The tasks of the bound files (sorted as bound); ``ConfigError`` for a missing column or
    a bad row, naming it."""
    table = _rows(files, spec.layout)
    where = _where(files, spec.layout)
    columns = list(table.column_names)
    named = {"--prompt-column": spec.prompt, "--answer-column": spec.answer}
    if spec.verifier_column:
        named["--verifier-column"] = spec.verifier_column
    if spec.target_len_column:
        named["--target-len-column"] = spec.target_len_column
    for option, column in named.items():
        if column not in columns:
            raise ConfigError(
                f"data set {where} has no column {column!r} (its columns: {', '.join(columns)});"
                f" name the right one with {option}"
            )
    tasks = []
    for i, row in enumerate(table):
        tasks.append(
            task_of_row(
                f"{where} row {i}",
                i,
                row,
                prompt_key=spec.prompt,
                answer_key=spec.answer,
                verifier_key=spec.verifier_column or "\0none",
                target_key=spec.target_len_column or "\0none",
                default_verifier=spec.verifier,
            )
        )
    if not tasks:
        raise ConfigError(f"data set {where} holds no rows")
    return TaskDataset(tuple(tasks))
