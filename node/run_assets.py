"""What a node needs of its run before it works: the model directory the genesis's card binds
and the run's data set, from a local copy, the home's cache, or the run's peers.

Decisions this module owns:

- Where a model comes from (``local_model``), in this order: ``--model DIR`` (checked against
  the card: a file that differs is refused, named, before any work), the home's cache
  ``<models>/<card id>/`` (verified once, marked), the embedded default model when the card binds
  it; otherwise it is fetched (``obtain``): the card's small files over run-files, the version-0
  weights by SHARDCAST (checked against the card by ``PolicyFeed``), linked into the cache: the
  one weights file, or each shard file of a sharded card from v0's directory.
  A trainer is the model's source and never fetches it.
- A genesis without a card (made before cards) binds nothing: the node uses ``--model`` or the
  embedded model, as before.
- The data set of a ``jsonl`` run comes the same way: ``--tasks FILE`` (checked), the cache
  ``<data>/<sha256>/<name>``, or the run's peers; so do the files of a ``datasets`` run:
  ``--tasks DIR`` (or one bound file), the cache folder ``<data>/<set id>/`` (``set id``: the
  sha256 of the files' hashes), or the run's peers, file by file. Either way ``data_set`` is
  what ``node.run.suite_for`` reads: the JSONL file, or the folder holding the bound files.
- What a node holds it serves (``serve``): the card's small files and the data set, by sha256.
- Downloads say what they do: one log line per file, and SHARDCAST progress every few seconds.

Cancellation leaves ``.part`` files and, for v0, SHARDCAST's resumable store; the cache marker is
written last, so a half-built cache directory is completed, never trusted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from node.model import DEFAULT_MODEL_DIR, model_info
from node.model.card import check_dir, mark_verified, matches, mismatch
from node.policy_feed import PolicyFeed
from node.run_files import RUN_FILES_LIMITS, RunFileServer, fetch_file
from swarm.errors import ConfigError, SwarmError, ValidationError
from swarm.messages import FileRef, ModelSpec, RunGenesis
from swarm.net.names import RUN_FILES
from swarm.shardcast import FetchProgress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AssetDirs:
    """Where the home caches run files: models by card id, data sets by sha256."""

    models: Path
    data: Path

    @classmethod
    def under(cls, root: Path) -> AssetDirs:
        return cls(root / "models", root / "data")

    def model(self, card: ModelSpec) -> Path:
        return self.models / card.card_id()

    def data_set(self, ref: FileRef) -> Path:
        return self.data / ref.sha256.hex() / ref.name

    def data_files(self, refs: tuple[FileRef, ...]) -> Path:
        """The cache folder of a ``datasets`` run's files."""
        digest = hashlib.sha256(b"".join(ref.sha256 for ref in refs)).hexdigest()
        return self.data / digest[:32]


def local_model(card: ModelSpec, given: Path | None, dirs: AssetDirs) -> Path | None:
    """The model directory to use without the network, or None when it must be fetched.

    ``ModelMismatchError`` (a ``ConfigError``) when ``given`` differs from the card."""
    if not card.bound:  # a genesis from before model cards binds nothing
        path = given or DEFAULT_MODEL_DIR
        model_info(path)  # a bad --model is a clear error
        return path
    if given is not None:
        check_dir(card, given)
        return given
    cache = dirs.model(card)
    if matches(card, cache, trust_marker=True):
        return cache
    if matches(card, DEFAULT_MODEL_DIR):
        return DEFAULT_MODEL_DIR
    return None


def local_data_set(genesis: RunGenesis, given: Path | None, dirs: AssetDirs) -> Path | None:
    """The data set to use without the network (None: none bound, or fetch it): the JSONL file,
    or the folder holding a ``datasets`` run's files."""
    if genesis.task_files:
        return _local_files(genesis.task_files, given, dirs)
    ref = genesis.task_data
    if ref is None:
        return None
    if given is not None:
        why = mismatch(ref, given)
        if why is not None:
            raise ConfigError(
                f"--tasks {given} {why}; use the run's data set {ref.name} (or leave out"
                " --tasks to fetch it from peers)"
            )
        return given
    cached = dirs.data_set(ref)
    return cached if cached.is_file() and mismatch(ref, cached) is None else None


def _local_files(refs: tuple[FileRef, ...], given: Path | None, dirs: AssetDirs) -> Path | None:
    if given is not None:
        folder = given.parent if given.is_file() else given
        for ref in refs:
            why = mismatch(ref, folder / ref.name)
            if why is not None:
                raise ConfigError(
                    f"--tasks {given}: {ref.name} {why}; use the run's data set (or leave out"
                    " --tasks to fetch it from peers)"
                )
        return folder
    cached = dirs.data_files(refs)
    return cached if all(mismatch(r, cached / r.name) is None for r in refs) else None


def check_local(
    genesis: RunGenesis,
    role: str,
    dirs: AssetDirs,
    model: Path | None = None,
    tasks: Path | None = None,
) -> None:
    """Refuse bad local copies before any network use (the CLI calls this first)."""
    found = local_model(genesis.model, model, dirs)
    if found is None and role == "trainer":
        raise ConfigError(
            f"a trainer needs the run's model locally: pass --model DIR with the model the"
            f" genesis binds ({genesis.model.name}, card {genesis.model.card_id()})"
        )
    local_data_set(genesis, tasks, dirs)


@dataclass(frozen=True)
class RunAssets:
    model_dir: Path
    data_set: Path | None


async def obtain(
    node: Any,
    feed: PolicyFeed,
    dirs: AssetDirs,
    *,
    model: Path | None = None,
    tasks: Path | None = None,
    give_up_after: float = 300.0,
) -> RunAssets:
    """The run's model directory and data set, fetched from peers where not held locally, and
    served to peers from then on. Needs ``feed`` running (v0 comes by SHARDCAST)."""
    genesis: RunGenesis = node.config.genesis.message
    card = genesis.model
    model_dir = await trio.to_thread.run_sync(local_model, card, model, dirs)
    if model_dir is None:
        if node.role == "trainer":
            check_local(genesis, node.role, dirs, model, tasks)  # raises: trainers never fetch
        model_dir = await _fetch_model(node, feed, card, dirs.model(card), give_up_after)
    data_set = await trio.to_thread.run_sync(local_data_set, genesis, tasks, dirs)
    if data_set is None and genesis.task_data is not None:
        data_set = await fetch_file(
            node,
            genesis.task_data,
            dirs.data_set(genesis.task_data),
            give_up_after=give_up_after,
            what="data set",
        )
    if data_set is None and genesis.task_files:
        data_set = dirs.data_files(genesis.task_files)
        for ref in genesis.task_files:
            if mismatch(ref, data_set / ref.name) is not None:
                await fetch_file(
                    node, ref, data_set / ref.name, give_up_after=give_up_after, what="data file"
                )
    refs = genesis.task_files or (() if genesis.task_data is None else (genesis.task_data,))
    serve(node, card, model_dir, refs, data_set)
    return RunAssets(model_dir, data_set)


def serve(
    node: Any,
    card: ModelSpec,
    model_dir: Path,
    data_refs: tuple[FileRef, ...],
    data_set: Path | None,
) -> RunFileServer:
    """Serve the card's small files and the data set's files on run-files."""
    server = RunFileServer()
    if card.bound:
        server.add_dir(card.files, model_dir)
    if data_set is not None and data_set.is_dir():
        server.add_dir(data_refs, data_set)
    elif data_set is not None:
        server.add(data_refs[0], data_set)
    node.handle(RUN_FILES, server.handle, RUN_FILES_LIMITS)
    return server


async def _fetch_model(
    node: Any, feed: PolicyFeed, card: ModelSpec, cache: Path, give_up_after: float
) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    weights = card.all_weights()
    log.info(
        "fetching the run's model %s (card %s): %d files and %.1f MiB of weights in %d"
        " file(s) from peers",
        card.name,
        card.card_id(),
        len(card.files),
        card.weights_size() / 2**20,
        len(weights),
    )
    for ref in card.files:
        if mismatch(ref, cache / ref.name) is not None:
            await fetch_file(
                node, ref, cache / ref.name, give_up_after=give_up_after, what="model file"
            )
    missing = await trio.to_thread.run_sync(
        lambda: [ref for ref in weights if mismatch(ref, cache / ref.name) is not None]
    )
    if missing:
        # v0 is the file, or for a sharded card a directory holding each shard by its name.
        stored = await _fetch_v0(feed, give_up_after)
        for ref in missing:
            await _link(stored / ref.name if stored.is_dir() else stored, cache / ref.name)
    mark_verified(card, cache)
    log.info("model %s ready in %s", card.name, cache)
    return cache


async def _link(stored: Path, target: Path) -> None:
    """Put a file of the stored v0 into the cache: the pinned v0 and the cache share one copy."""
    target.unlink(missing_ok=True)
    try:
        os.link(stored, target)
    except OSError:
        await trio.to_thread.run_sync(shutil.copyfile, stored, target)


async def _fetch_v0(feed: PolicyFeed, give_up_after: float) -> Path:
    """Version 0 by SHARDCAST (checked against the card by the feed), retried while no peer
    serves it yet; progress logged every 5 s."""
    last = [0.0]

    def progress(p: FetchProgress) -> None:
        now = time.monotonic()
        if now - last[0] >= 5.0:
            last[0] = now
            log.info(
                "model weights (policy v0): %.1f of %.1f MiB, %d/%d shards, %.1f MiB/s",
                p.done_bytes / 2**20,
                p.total_bytes / 2**20,
                p.shards_done,
                p.shards_total,
                p.rate / 2**20,
            )

    deadline = trio.current_time() + give_up_after
    while True:
        try:
            return await feed.fetch_version(0, on_progress=progress)
        except (ConfigError, ValidationError):
            raise  # a v0 that is not the card's weights: waiting will not help
        except SwarmError as exc:  # no provider known yet, or every provider failed
            if trio.current_time() >= deadline:
                raise
            log.info("model weights not available yet (%s); retrying", exc)
            await trio.sleep(2.0)
