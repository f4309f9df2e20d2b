"""``swarm-node audit --training --run G --bootstrap ADDR [--versions LIST | --sample N]``:
check the trainer from the swarm alone.

The auditor joins as a throwaway node (as ``node.audit_swarm`` does), pulls the training records
from the validators and the trainers (``/training/1``), the validators' receipts and training
disputes (``/train-receipts/1``), and for each chosen version runs the checks and the replay of
``node.roles.training_audit.StepAuditor``: the cited verdicts and submissions by the evidence
protocol, the state before from the trainer, the published weights by SHARDCAST. Unlike the
ledger audit the replay runs while the node is up: it runs in a child process, so the node's
event loop keeps serving. The report holds one row per version, coverage per worker, and the
disputes the validators signed. A version without a record, one the trainer never announced,
or one past the retention window is a row that says so, never a traceback.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import trio

from node.audit import AuditAssets
from node.audit_swarm import _find_validators, auditor_config
from node.model.text import chat_template_wanted
from node.roles.evaluation_sync import LIMITS, TrainingSync
from node.roles.evidence import EvidenceService
from node.roles.training_audit import StepAudit, StepAuditor, coverage, decode_receipts
from node.run import suite_for
from node.run_assets import local_data_set, local_model
from node.runtime import Node
from node.shardcast import ShardcastService
from node.version_chain import VersionChain
from swarm.errors import ConfigError, SwarmError
from swarm.evidence import EvidenceStore
from swarm.ledger.training import TrainingStore
from swarm.messages import RunGenesis, Signed, TrainingDispute, decode
from swarm.net import DialPolicy
from swarm.net.names import TRAIN_RECEIPTS
from swarm.shardcast import FetchConfig, ShardStore

log = logging.getLogger(__name__)


@dataclass
class TrainingReport:
    rows: list[StepAudit] = field(default_factory=list)
    coverage: dict[str, dict[str, int]] = field(default_factory=dict)
    disputes: list[dict[str, Any]] = field(default_factory=list)
    records: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.outcome != "disputed" for r in self.rows) and not self.disputes

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records": self.records,
            "rows": [r.to_json() for r in self.rows],
            "coverage": self.coverage,
            "disputes": self.disputes,
        }


def parse_versions(text: str) -> list[int]:
    """``1,3,5-8`` -> [1, 3, 5, 6, 7, 8]; a clear error for anything else."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(
                f"--versions takes numbers and ranges (1,3,5-8), not {part!r}"
            ) from None
        if first < 1 or last < first:
            raise ConfigError(f"--versions: {part!r} is no range of versions from 1 on")
        out += range(first, last + 1)
    return sorted(set(out))


async def audit_training(
    genesis: Signed[RunGenesis],
    bootstrap: Sequence[str],
    workdir: Path,
    assets: AuditAssets,
    *,
    versions: Sequence[int] | None = None,
    sample: int | None = None,
    discover_s: float = 60.0,
    listen: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
    dial: DialPolicy | None = None,
) -> TrainingReport:
    g = genesis.message
    dirs = assets.dirs()
    model_dir = local_model(g.model, assets.model, dirs)
    if model_dir is None:
        raise ConfigError(
            f"the run's model {g.model.name} is not in {dirs.model(g.model)}; pass --model DIR"
        )
    suite = suite_for(g, local_data_set(g, assets.tasks, dirs), cache=dirs.data)
    workdir.mkdir(parents=True, exist_ok=True)
    config = auditor_config(genesis, bootstrap, listen, dial)
    store = TrainingStore(workdir / "training.db")
    evidence_store = EvidenceStore(workdir / "evidence.db")
    shards = ShardStore(workdir / "shards", keep=1 << 20)
    report = TrainingReport()
    try:
        async with Node.start(config) as node:
            validators = await _find_validators(node, genesis, discover_s)
            sync = TrainingSync(node, store)
            raws: list[Any] = []
            for peer in [*validators, *g.trainers]:
                with trio.move_on_after(30):
                    try:
                        await sync.pull(peer)
                        if peer in validators:
                            body = await node.request(
                                peer, TRAIN_RECEIPTS, msgpack.packb([0, 2**62]), LIMITS
                            )
                            raws.append(msgpack.unpackb(body, raw=False))
                    except SwarmError as exc:
                        log.warning("training records from %s: %s", peer[-8:], exc)
            records = store.records()
            report.records = [r.message.version for r in records]
            receipts = decode_receipts(r for a in raws for r in a.get("receipts", []))
            report.coverage = coverage(records, receipts, g.params.async_level)
            report.disputes = _disputes(raws)
            chosen = _choose(report.records, versions, sample)
            evidence = EvidenceService(node, evidence_store)
            evidence.serve()
            async with ShardcastService.start(node, genesis, shards, data_channel=None) as service:
                chain = VersionChain(shards)

                async def weights(version: int) -> Path | None:
                    if shards.weights_path(version) is None:
                        with trio.move_on_after(60):
                            try:
                                await chain.weights(
                                    service,
                                    version,
                                    config=FetchConfig(stall_timeout=10.0, give_up_after=30.0),
                                )
                            except SwarmError as exc:
                                log.warning("weights of v%d not fetched: %s", version, exc)
                    return shards.weights_path(version)

                auditor = StepAuditor(
                    node,
                    evidence,
                    suite,
                    model_dir,
                    workdir / "states",
                    weights,
                    chat_template=chat_template_wanted(g),
                )
                try:
                    for version in chosen:
                        record = store.record(version)
                        if record is None:
                            newest = max(report.records, default=0)
                            why = (
                                f"never announced (no record, and newer than the newest v{newest})"
                                if version > newest
                                else "no training record held by any validator or trainer"
                            )
                            report.rows.append(StepAudit(version, "not-replayed", why))
                            continue
                        report.rows.append(await auditor.audit(record))
                finally:
                    auditor.close()
    finally:
        store.close()
        evidence_store.close()
    return report


def _choose(held: list[int], versions: Sequence[int] | None, sample: int | None) -> list[int]:
    if versions:
        return sorted(versions)
    if sample is not None:
        return sorted(random.sample(held, min(sample, len(held))))
    return held


def _disputes(answers: list[Any]) -> list[dict[str, Any]]:
    seen: dict[bytes, dict[str, Any]] = {}
    for answer in answers:
        for raw in answer.get("disputes", []):
            try:
                d = decode(raw, TrainingDispute)
            except SwarmError:
                continue
            m = d.message
            seen[d.id] = {
                "version": m.version,
                "reason": m.reason,
                "detail": m.detail,
                "by": d.signer,
                "trainer": m.trainer,
            }
    return sorted(seen.values(), key=lambda d: (d["version"], d["reason"]))
