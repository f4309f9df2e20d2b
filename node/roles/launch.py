"""Start a node's role on top of a running ``Node``: the policy feed (SHARDCAST serving and
fetching), the ledger replica, and the trainer, validator or inference worker.

    async with Node.start(config) as node, launch(node, run_dir) as role:
        ...                                   # role.worker / role.validator / role.trainer

The model runs in a child process by default (``engine_factory``); tests pass an in-process
engine through the same interface. Before any role starts, the run's model and data set are
resolved (``node.run_assets``: a local copy checked against the genesis, the home's cache, or
fetched from peers) and served to peers; ``RoleHandle.assets`` says where they are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.compute.devices import EngineChoice
from node.compute.engine import Engine
from node.model import DEFAULT_MODEL_DIR
from node.model.loading import check_model_dir
from node.model.text import chat_template_wanted
from node.policy_feed import PolicyFeed
from node.roles.cheats import Rogue, TrainerCheat
from node.roles.claims import ClaimBook
from node.roles.evaluation_sync import EvaluationSync, TrainingSync
from node.roles.evaluator import HOLD_TIMEOUT_S, Evaluator, keep_evaluations
from node.roles.evidence import EvidenceService
from node.roles.ledger_sync import LedgerReplica
from node.roles.train_audit import TrainingAudits
from node.roles.training_audit import StepAuditor
from node.roles.validator import Validator
from node.roles.worker import InferenceWorker, Tamper
from node.run import TaskSource, eval_ids, suite_for
from node.run_assets import AssetDirs, RunAssets, check_local, obtain
from node.runtime import Node
from swarm.errors import SwarmError
from swarm.evidence import EvidenceStore
from swarm.ledger import LedgerStore
from swarm.ledger.evaluations import EvaluationStore
from swarm.ledger.training import TrainingStore
from swarm.net import PolicyConflict
from swarm.net.gossip import POLICY_CONFLICT

if TYPE_CHECKING:  # the trainer's modules (numpy, its child's plumbing) only on a trainer
    from node.roles.trainer import Trainer

log = logging.getLogger(__name__)

EngineFactory = Callable[[], Engine]


def child_engine(
    model_dir: Path = DEFAULT_MODEL_DIR,
    choice: EngineChoice | None = None,
    *,
    chat_template: bool = False,
) -> EngineFactory:
    """The production engine: the model in a child process, so the event loop stays free."""
    choice = choice or EngineChoice()

    def make() -> Engine:
        from node.compute.child import ChildEngine

        return ChildEngine(
            model_dir,
            kind=choice.kind,
            dtype=choice.dtype,
            device=choice.device,
            threads=1 if choice.device == "cpu" else None,
            chat_template=chat_template,
        )

    return make


AUDIT_KEEP_EXTRA = 4
"""Versions a validator keeps in its shard store beyond the async window while training audits
are on: the versions a step's samples came from, still held when its audit runs."""


def record_conflict(store: EvidenceStore, conflict: PolicyConflict) -> None:
    """Keep both signed announcements of a policy conflict, pinned, in the node's evidence
    store (``ledger show`` lists them; peers can fetch them by id)."""
    store.put(conflict.accepted.raw, POLICY_CONFLICT, pinned=True)
    store.put(conflict.refused.raw, POLICY_CONFLICT, pinned=True)


@dataclass
class RoleHandle:
    node: Node
    feed: PolicyFeed
    ledger: LedgerStore
    replica: LedgerReplica
    evidence: EvidenceService
    evaluations: EvaluationStore
    eval_sync: EvaluationSync
    assets: RunAssets | None = None
    worker: InferenceWorker | None = None
    validator: Validator | None = None
    trainer: Trainer | None = None
    evaluator: Evaluator | None = None
    training: TrainingStore | None = None
    train_sync: TrainingSync | None = None
    train_audits: TrainingAudits | None = None

    def status(self) -> dict[str, Any]:
        card = self.node.config.genesis.message.model
        out: dict[str, Any] = {
            "model": {
                "name": card.name,
                "card": card.card_id() if card.bound else None,
                # None while the model is still being fetched from peers
                "dir": None if self.assets is None else str(self.assets.model_dir),
            },
            "shardcast": self.feed.status(),
            "ledger": self.replica.status(),
            "evaluation": {**self.evaluations.summary(), **self.eval_sync.status()},
        }
        if self.evaluator is not None:
            out["evaluation"]["evaluator"] = vars(self.evaluator.stats)
        if self.train_audits is not None:
            out["training"] = self.train_audits.status()
        elif self.training is not None:
            out["training"] = self.training.summary()
        if self.train_sync is not None and "training" in out:
            out["training"]["sync"] = self.train_sync.status()
        if self.worker is not None:
            out["worker"] = {
                "loaded_version": self.worker.loaded,
                **vars(self.worker.stats),
                "engine": self.worker.healer.status(),
            }
        out["disk"] = disk_usage(self.ledger.path.parent)
        out["evidence"] = {
            **self.evidence.store.usage(),
            "served": self.evidence.served,
            "fetched": self.evidence.fetched,
        }
        if self.validator is not None:
            out["validator"] = {
                **vars(self.validator.stats),
                "claims": len(self.validator.claims),
                "judge_queue": self.validator.judge_queue(),
                "rate_limited": self.validator.rate_limit.refused,
                "engine": self.validator.healer.status(),
                "outbox": len(self.ledger.pending_handoffs()),
                "dead_letters": self.validator.dead_letter_status(),
                "review": vars(self.validator.review.stats),
            }
        if self.trainer is not None:
            t = self.trainer
            out["trainer"] = {
                "version": t.version,
                "reward_by_version": t.stats.reward_by_version(),
                "queued": t.stats.queued,
                "too_old": t.stats.too_old,
                "idle_fraction": None if math.isnan(t.idle_fraction()) else t.idle_fraction(),
                "rollbacks": t.stats.rollbacks,
                "published_at": t.stats.published_at,
                "busy_s": round(t.stats.busy_seconds, 3),
                "steps": len(t.stats.steps),
                "published": len(t.stats.published_at),
                "accountability": t.log.status(),  # records signed, training states held
                "engine": t.healer.status(),  # restarts of the training child
            }
            if t.stats.group is not None:
                out["trainer"]["group"] = vars(t.stats.group)
        return out


def disk_usage(run_dir: Path) -> dict[str, int]:
    """Bytes on disk under the run's folder, by top-level entry (a database with its WAL, the
    shard store), and ``total``: what ``status`` shows so an operator sees what grows."""
    out: dict[str, int] = {}
    for path in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        name = path.name.removesuffix("-wal").removesuffix("-shm")
        try:
            size = (
                sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                if path.is_dir()
                else path.stat().st_size
            )
        except OSError:  # removed while we looked
            continue
        out[name] = out.get(name, 0) + size
    out["total"] = sum(out.values())
    return out


@asynccontextmanager
async def launch(
    node: Node,
    run_dir: Path,
    *,
    engine_factory: EngineFactory | None = None,
    model_dir: Path | None = None,
    tasks: Path | None = None,
    asset_dirs: AssetDirs | None = None,
    tamper: Tamper | None = None,
    rogue: Rogue | None = None,
    trainer_cheat: TrainerCheat | None = None,
    max_versions: int | None = None,
    compute: EngineChoice | None = None,
    data_channel: bool = True,
    ledger_sync_every_s: float = 10.0,
    torch_threads: int | None = None,
    policy_refresh_s: float = 10.0,
) -> AsyncIterator[RoleHandle]:
    """``model_dir``/``tasks``: local copies of the run's model and data set (checked against
    the genesis); default: the home's cache (``asset_dirs``, default under the node's home, else
    under ``run_dir``), fetched from peers when missing."""
    run_dir.mkdir(parents=True, exist_ok=True)
    home = node.config.home
    dirs = asset_dirs or AssetDirs.under(home.path if home is not None else run_dir)
    # Local copies that differ from the genesis are refused here, before anything starts.
    await trio.to_thread.run_sync(
        lambda: check_local(node.config.genesis.message, node.role, dirs, model_dir, tasks)
    )
    feed = PolicyFeed(
        node, run_dir / "shards", data_channel=data_channel, refresh_every_s=policy_refresh_s
    )
    ledger = LedgerStore(run_dir / "ledger.db", node.config.genesis)
    replica = LedgerReplica(node, ledger, every_s=ledger_sync_every_s)
    evidence = EvidenceService(node, EvidenceStore.beside(ledger.path))
    evidence.serve()  # every holder serves what it keeps
    evaluations = EvaluationStore.beside(ledger.path)
    node.subscribe_ledger(keep_evaluations(evaluations))  # every node keeps the curve
    eval_sync = EvaluationSync(node, evaluations, every_s=ledger_sync_every_s)
    handle = RoleHandle(node, feed, ledger, replica, evidence, evaluations, eval_sync)
    handle.training = training = TrainingStore.beside(ledger.path)
    node.subscribe_ledger(training.keep)  # every node keeps the records and disputes
    handle.train_sync = TrainingSync(node, training, every_s=ledger_sync_every_s)
    claims: ClaimBook | None = None
    node.policy.on_conflict(lambda c: record_conflict(evidence.store, c))
    node.status_extras["role_status"] = handle.status
    engine: Engine | None = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(feed.run)
            nursery.start_soon(replica.run)
            nursery.start_soon(eval_sync.run)  # what gossip did not bring, from peers
            nursery.start_soon(handle.train_sync.run)
            handle.assets = assets = await obtain(node, feed, dirs, model=model_dir, tasks=tasks)
            # A reasoning-gym run builds its items (once: cached by digest beside the data sets).
            suite = await trio.to_thread.run_sync(
                lambda: suite_for(node.config.genesis.message, assets.data_set, cache=dirs.data)
            )
            chat = chat_template_wanted(node.config.genesis.message)
            # Tokenizer that does not fit the model, chat template missing: stop before work.
            check_model_dir(assets.model_dir, chat_template=chat)
            engine_factory = engine_factory or child_engine(
                assets.model_dir, compute, chat_template=chat
            )
            if node.role == "trainer":
                from node.roles.trainer import Trainer

                # Small models train fastest on one thread, and a busy box has no spare core.
                handle.trainer = Trainer(
                    node,
                    feed,
                    run_dir,
                    model_dir=assets.model_dir,
                    max_versions=max_versions,
                    threads=torch_threads,
                    suite=suite,
                    device=(compute or EngineChoice()).device,
                    nproc=(compute or EngineChoice()).nproc,
                    training=training,
                    cheat=trainer_cheat,
                )
                nursery.start_soon(handle.trainer.run)
            elif node.role == "validator":
                engine = await trio.to_thread.run_sync(engine_factory)
                claims = ClaimBook(run_dir / "claims.db")
                handle.validator = Validator(
                    node, feed, engine, ledger, evidence, claims, rogue=rogue, suite=suite
                )
                nursery.start_soon(handle.validator.run)
                handle.validator.training = training
                if node.config.genesis.message.params.train_audit_share > 0:
                    # A training audit replays versions a little behind the newest.
                    feed.store.keep = max(feed.store.keep, feed.store.keep + AUDIT_KEEP_EXTRA)
                handle.train_audits = TrainingAudits(
                    node,
                    training,
                    StepAuditor(
                        node,
                        evidence,
                        suite,
                        assets.model_dir,
                        run_dir / "audit-states",
                        held_weights(node, feed),
                        chat_template=chat,
                    ),
                )
                nursery.start_soon(handle.train_audits.run)
                handle.evaluator = _evaluator(node, feed, handle.validator, evaluations, suite)
                nursery.start_soon(handle.evaluator.run)
            elif node.role == "inference":
                engine = await trio.to_thread.run_sync(engine_factory)
                handle.worker = InferenceWorker(
                    node, feed, engine, run_dir, tamper=tamper, suite=suite
                )
                nursery.start_soon(handle.worker.run)
            yield handle
            nursery.cancel_scope.cancel()
    finally:
        if handle.trainer is not None:
            handle.trainer.close()
        if handle.train_audits is not None:
            handle.train_audits.auditor.close()
        training.close()
        if engine is not None:
            engine.close()
        ledger.close()
        evaluations.close()
        evidence.store.close()
        if claims is not None:
            claims.close()


def held_weights(node: Node, feed: PolicyFeed) -> Callable[[int], Awaitable[Path | None]]:
    """``weights(version)``: the path of a version held here, else fetched by its accepted
    announcement (asked of peers when gossip never brought it; at most ``HOLD_TIMEOUT_S``);
    None when neither works."""

    async def weights(version: int) -> Path | None:
        path = feed.path_of(version)
        if path is not None:
            return path
        announcement = await feed.announcement_of(version)
        if announcement is None:
            return None
        with trio.move_on_after(HOLD_TIMEOUT_S):
            try:
                await feed.fetch(announcement)
            except SwarmError as exc:
                log.info("policy v%d not fetched: %s", version, exc)
        return feed.path_of(version)

    return weights


def _evaluator(
    node: Node,
    feed: PolicyFeed,
    validator: Validator,
    store: EvaluationStore,
    suite: TaskSource,
) -> Evaluator:
    """The validator's held-out evaluation, on its engine under its judge lock."""
    g = node.config.genesis.message
    weights = held_weights(node, feed)

    async def hold(version: int) -> bool:
        return await weights(version) is not None

    return Evaluator(
        run_id=node.run_id,
        key=node.key,
        params=g.params,
        validators=g.validators,
        source=suite,
        item_ids=eval_ids(g, suite),
        store=store,
        policy=node.policy,
        on_version=validator.on_version,
        hold=hold,
        publish=node.publish_ledger,
    )
