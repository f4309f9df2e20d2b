"""Nobody trusts the trainer: a real swarm on 127.0.0.1 (a bootstrap peer, a rogue trainer, a
validator that replays every step, two workers) with the embedded model, served in bfloat16.

The trainer cheats on a plan, one step each: another learning rate (v2), perturbed published
weights (v3), a group cited by a verdict nobody signed (v4), one worker's accepted work left out
(v5, v6); its other steps are honest. The validator's training audit signs a
``training-dispute`` of each kind and agrees with the honest steps bit for bit; then
``audit --training`` from the swarm alone (a fresh node that knows only the genesis and the
bootstrap address) finds the same, reports the left-out worker in its coverage, and answers a
version never announced with a row that says so.
"""

from __future__ import annotations

import traceback
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.audit import AuditAssets
from node.audit_training import audit_training, parse_versions
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.roles.cheats import trainer_cheat_by_spec
from node.roles.launch import RoleHandle, launch
from node.run import create_genesis
from node.runtime import Node
from swarm.errors import ConfigError
from swarm.ledger.training import TrainingStore
from swarm.messages import RunParams
from tests.netfactory import LOOPBACK, key_named, loopback_config, wait_until

PARAMS = RunParams(
    group_size=4,
    batch_prompts=2,
    max_tokens=8,
    async_level=2,
    submissions_per_step=2,
    eval_every=0,
    train_audit_share=1.0,
)
VERSIONS = 7
PLAN = "learning-rate@1,perturb-weights@2,unaccepted-sample@3,drop-worker@4,drop-worker@5"
EXPECTED = {2: "replay-mismatch", 3: "weights-mismatch", 4: "unknown-verdict"}
HONEST = (1, 7)


@pytest.mark.slow
@pytest.mark.timeout(600)  # seven steps, each replayed, on two shared cores
async def test_training_audits_agree_with_honest_steps_and_dispute_each_cheat(
    tmp_path: Path,
) -> None:
    owner, trainer_key, validator_key = (key_named(n) for n in ("owner", "t-rogue", "t-val"))
    genesis = create_genesis(
        owner,
        name="train-audit",
        trainers=[trainer_key.peer_id],
        validators=[validator_key.peer_id],
        params=PARAMS,
        created_at=1,
    )

    def engine() -> TorchEngine:
        return TorchEngine.from_dir(DEFAULT_MODEL_DIR)

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(
            BootstrapPeer.start(
                BootstrapConfig(
                    key=key_named("t-boot"), listen=LOOPBACK, heartbeat=0.2, genesis=(genesis,)
                )
            )
        )

        async def start(key, role: str, **kw) -> RoleHandle:  # type: ignore[no-untyped-def]
            config = loopback_config(
                key, genesis, role, boot.addrs()[:1], heartbeat=0.2, discover_every_s=0.5
            )
            node = await stack.enter_async_context(Node.start(config))
            return await stack.enter_async_context(
                launch(
                    node,
                    tmp_path / key.peer_id[-8:],
                    engine_factory=engine,
                    ledger_sync_every_s=1.0,
                    **kw,
                )
            )

        trainer = await start(
            trainer_key,
            "trainer",
            max_versions=VERSIONS,
            trainer_cheat=trainer_cheat_by_spec(PLAN),
        )
        validator = await start(validator_key, "validator")
        for name in ("t-worker-a", "t-worker-b"):
            await start(key_named(name), "inference")
        audits = validator.train_audits
        assert audits is not None and validator.training is not None
        store = validator.training

        def audited() -> bool:
            done = store.audits()
            return all(v in done for v in range(1, VERSIONS + 1))

        try:
            try:
                await wait_until(audited, 300, poll=0.5)
            except trio.TooSlowError:
                state = {
                    "trainer_version": trainer.trainer and trainer.trainer.version,
                    "audits": store.audits(),
                    "training": audits.status(),
                }
                raise AssertionError(f"not every version audited: {state}") from None
            outcomes = store.audits()
            assert trainer.trainer is not None
            kept = {s.version: s.kept_groups for s in trainer.trainer.stats.steps}
            expected, honest = dict(EXPECTED), set(HONEST)
            if kept.get(2) == 0:
                # Every group of that step had equal rewards: zero advantage, zero gradient,
                # and AdamW (no weight decay) moves no weight at any rate. The other rate
                # changed nothing, so the replay rightly agrees: no cheat to catch.
                print("the learning-rate step had no kept group: its replay must agree")
                del expected[2]
                honest.add(2)
            for version in sorted(honest):  # the version and its detail first: CI cuts long lines
                assert outcomes[version][0] == "agreed", f"v{version}: {outcomes[version]}, {kept}"
            for version, reason in expected.items():
                assert outcomes[version][0] == reason, f"v{version}: {outcomes[version]}, {kept}"
            reasons = {d["reason"] for d in store.disputes()}
            assert set(expected.values()) <= reasons, store.disputes()
            # The left-out worker's work shows in the receipts: a later sample trained first.
            try:
                await wait_until(
                    lambda: any(d["reason"] == "skipped-sample" for d in store.disputes()), 60
                )
            except trio.TooSlowError:
                raise AssertionError(f"no skipped-sample dispute: {_queue_view(store)}") from None
            skipped = [d for d in store.disputes() if d["reason"] == "skipped-sample"]
            assert all(d["version"] in (5, 6) for d in skipped), skipped
            # Every node keeps the disputes: the trainer's own store got them by gossip.
            assert trainer.training is not None
            await wait_until(lambda: len(trainer.training.disputes()) >= len(store.disputes()), 30)
            assert validator.status()["training"]["disputes"]

            # From the swarm alone: the same findings, the coverage, the disputes.
            report = await audit_training(
                genesis,
                boot.addrs()[:1],
                tmp_path / "audit",
                AuditAssets(model=DEFAULT_MODEL_DIR, home=tmp_path / "auditor"),
                versions=[*range(1, VERSIONS + 1), 99],  # v99: never announced
                discover_s=30,
            )
            rows = {r.version: r for r in report.rows}
            assert set(rows) >= set(range(1, VERSIONS + 1)), report.to_json()
            for version in honest:
                assert rows[version].outcome == "agreed", rows[version]
            for version, reason in expected.items():
                assert rows[version].outcome == "disputed"
                assert rows[version].findings[0].reason == reason, rows[version]
            assert not report.ok
            assert {d["reason"] for d in report.disputes} >= set(expected.values())
            assert any(c["handed"] for c in report.coverage.values()), report.coverage
            assert rows[99].outcome == "not-replayed" and "never announced" in rows[99].detail
        except BaseException:
            traceback.print_exc()
            raise


def _queue_view(store: TrainingStore) -> dict[str, object]:
    """What the skip check saw: the validator's receipts (worker, seq, sample version) and
    each record's window and the seqs it cited."""
    receipts = store.receipts()
    seq = {x.message.verdict_id: (x.message.worker[-6:], x.message.seq) for x in receipts}
    return {
        "receipts": [
            (x.message.worker[-6:], x.message.seq, x.message.sample_version, x.message.queued)
            for x in receipts
        ],
        "records": {
            r.message.version: (
                r.message.min_version,
                r.message.parent,
                [seq.get(v, "?") for v in r.message.verdicts],
            )
            for r in store.records()
        },
    }


def test_versions_lists_are_parsed_or_refused_in_one_line() -> None:
    assert parse_versions("1,3,5-7") == [1, 3, 5, 6, 7]
    for bad in ("a", "0", "5-3", "1,,2"):
        with pytest.raises(ConfigError, match="--versions"):
            parse_versions(bad)
