"""Start a node's role on top of a running ``Node``: the policy feed (SHARDCAST serving and
fetching), the ledger replica, and the trainer, validator or inference worker.

    async with Node.start(config) as node, launch(node, run_dir) as role:
        ...                                   # role.worker / role.validator / role.trainer

The model runs in a child process by default (``engine_factory``); tests pass an in-process
engine through the same interface.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from node.compute.engine import Engine
from node.model import DEFAULT_MODEL_DIR
from node.policy_feed import PolicyFeed
from node.roles.ledger_sync import LedgerReplica
from node.roles.trainer import Trainer
from node.roles.validator import Validator
from node.roles.worker import InferenceWorker, Tamper
from node.runtime import Node
from swarm.ledger import LedgerStore
from swarm.net import PolicyConflict
from swarm.net.gossip import POLICY_CONFLICT

EngineFactory = Callable[[], Engine]


def child_engine(model_dir: Path = DEFAULT_MODEL_DIR) -> EngineFactory:
    """The production engine: the model in a child process, so the event loop stays free."""

    def make() -> Engine:
        from node.compute.child import ChildEngine

        return ChildEngine(model_dir, threads=1)

    return make


def record_conflict(ledger: LedgerStore, conflict: PolicyConflict) -> None:
    """Keep both signed announcements of a policy conflict as ledger evidence (``ledger show``)."""
    subject = f"policy/{conflict.version}".encode()
    ledger.add_evidence(POLICY_CONFLICT, subject, conflict.accepted.raw)
    ledger.add_evidence(POLICY_CONFLICT, subject, conflict.refused.raw)


@dataclass
class RoleHandle:
    node: Node
    feed: PolicyFeed
    ledger: LedgerStore
    replica: LedgerReplica
    worker: InferenceWorker | None = None
    validator: Validator | None = None
    trainer: Trainer | None = None

    def status(self) -> dict[str, Any]:
        balances = self.ledger.balances()
        out: dict[str, Any] = {
            "shardcast": self.feed.status(),
            "ledger": {
                "events": len(self.ledger),
                "balance": balances.of(self.node.peer_id),
                "banned": sorted(p for p in balances.by_peer if balances.banned(p)),
            },
        }
        if self.worker is not None:
            out["worker"] = {"loaded_version": self.worker.loaded, **vars(self.worker.stats)}
        if self.validator is not None:
            out["validator"] = vars(self.validator.stats)
        if self.trainer is not None:
            t = self.trainer
            out["trainer"] = {
                "version": t.version,
                "reward_by_version": t.stats.reward_by_version(),
                "queued": t.stats.queued,
                "idle_fraction": None if math.isnan(t.idle_fraction()) else t.idle_fraction(),
                "rollbacks": t.stats.rollbacks,
                "published_at": t.stats.published_at,
                "busy_s": round(t.stats.busy_seconds, 3),
            }
            if t.stats.group is not None:
                out["trainer"]["group"] = vars(t.stats.group)
        return out


@asynccontextmanager
async def launch(
    node: Node,
    run_dir: Path,
    *,
    engine_factory: EngineFactory | None = None,
    model_dir: Path = DEFAULT_MODEL_DIR,
    tamper: Tamper | None = None,
    max_versions: int | None = None,
    data_channel: bool = True,
    ledger_sync_every_s: float = 10.0,
    torch_threads: int | None = None,
    policy_refresh_s: float = 10.0,
) -> AsyncIterator[RoleHandle]:
    run_dir.mkdir(parents=True, exist_ok=True)
    engine_factory = engine_factory or child_engine(model_dir)
    feed = PolicyFeed(
        node, run_dir / "shards", data_channel=data_channel, refresh_every_s=policy_refresh_s
    )
    ledger = LedgerStore(run_dir / "ledger.db", node.config.genesis)
    replica = LedgerReplica(node, ledger, every_s=ledger_sync_every_s)
    handle = RoleHandle(node, feed, ledger, replica)
    node.policy.on_conflict(lambda c: record_conflict(ledger, c))
    node.status_extras["role_status"] = handle.status
    engine: Engine | None = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(feed.run)
            nursery.start_soon(replica.run)
            if node.role == "trainer":
                # Small models train fastest on one thread, and a busy box has no spare core.
                handle.trainer = Trainer(
                    node,
                    feed,
                    run_dir,
                    model_dir=model_dir,
                    max_versions=max_versions,
                    threads=torch_threads,
                )
                nursery.start_soon(handle.trainer.run)
            elif node.role == "validator":
                engine = await trio.to_thread.run_sync(engine_factory)
                handle.validator = Validator(node, feed, engine, ledger)
                nursery.start_soon(handle.validator.run)
            elif node.role == "inference":
                engine = await trio.to_thread.run_sync(engine_factory)
                handle.worker = InferenceWorker(node, feed, engine, run_dir, tamper=tamper)
                nursery.start_soon(handle.worker.run)
            yield handle
            nursery.cancel_scope.cancel()
    finally:
        if handle.trainer is not None:
            handle.trainer.close()
        if engine is not None:
            engine.close()
        ledger.close()
