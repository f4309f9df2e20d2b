"""Many validators, one truth: three validators (one of them rogue: it credits forged work),
three honest workers, a worker that signs one assignment twice and sends the copies to two
validators, and a cheater that sends forged work to the rogue validator; real hosts on
127.0.0.1 in one trio run, with the embedded model.

The equivocator is slashed once and never credited for the copy; a copy of an envelope judged
elsewhere is refused, not judged; the rogue's credit is disputed by the others' re-judging and
the audit upholds the dispute; honest workers are credited once per assignment; every replica
converges on the same balances; an event with a changed amount is refused by every replica; an
auditor with only the genesis and a bootstrap address replays every slash."""

from __future__ import annotations

import dataclasses
import traceback
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.audit import audit_ledger
from node.audit_swarm import gather
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.roles.cheats import credit_everything, edit_token
from node.roles.launch import RoleHandle, launch
from node.run import create_genesis, suite_for
from node.runtime import Node, RuntimeConfig
from swarm.assignment import assign
from swarm.errors import PeerError, ValidationError
from swarm.evidence import EvidenceStore
from swarm.identity import NodeKey
from swarm.ledger import EQUIVOCATION
from swarm.messages import LedgerEvent, RolloutSubmission, RunParams, Signed, Verdict, decode, sign
from swarm.net import DialPolicy
from swarm.net.names import SUBMIT
from swarm.net.protocols import SUBMIT_LIMITS
from tests.netfactory import LOOPBACK, key_named, loopback_config, wait_until

PARAMS = RunParams(group_size=2, batch_prompts=2, max_tokens=8, async_level=2, rejudge_share=1.0)
PATIENT_DIAL = DialPolicy(attempts=5, timeout=10.0, backoff=0.5, max_backoff=2.0)
CREDIT = PARAMS.credit_per_sample * PARAMS.group_size * PARAMS.batch_prompts


def _work(
    engine: TorchEngine, run_id: str, key: NodeKey, counter: int, manifest_id: bytes | None
) -> RolloutSubmission:
    suite = suite_for(GENESIS.message)
    a = assign(
        run_id,
        0,
        key.peer_id,
        counter,
        n_prompts=PARAMS.batch_prompts,
        suite_size=suite.size,
        excluded=suite.excluded,
        manifest_id=manifest_id,
    )
    return build_submission(
        generate_groups(engine, suite, a, PARAMS), run_id=run_id, version=0, counter=counter
    )


OWNER, TRAINER = key_named("owner"), key_named("trainer")
VALIDATORS = [key_named(f"validator-{i}") for i in range(3)]
GENESIS = create_genesis(
    OWNER,
    name="validators",
    trainers=[TRAINER.peer_id],
    validators=[k.peer_id for k in VALIDATORS],
    params=PARAMS,
    created_at=1,
)
WORKERS = [key_named(f"worker-{i}") for i in range(3)]
EQUIVOCATOR, CHEATER = key_named("equivocator"), key_named("cheater")


async def _submit(node: Node, validator: str, signed: Signed[RolloutSubmission]) -> Signed[Verdict]:
    return decode(await node.request(validator, SUBMIT, signed.raw, SUBMIT_LIMITS), Verdict)


@pytest.mark.slow
@pytest.mark.timeout(900)  # eleven nodes and three judging validators on two shared cores
async def test_validators_check_each_other_and_the_audit_replays_from_the_swarm(
    tmp_path: Path,
) -> None:
    engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR)

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(
            BootstrapPeer.start(
                BootstrapConfig(
                    key=key_named("boot"), listen=LOOPBACK, heartbeat=0.5, genesis=(GENESIS,)
                )
            )
        )

        def config(key: NodeKey, role: str) -> RuntimeConfig:
            return loopback_config(
                key,
                GENESIS,
                role,
                boot.addrs()[:1],
                heartbeat=0.5,  # eleven nodes in one process: keep the background chatter low
                discover_every_s=2.0,
            )

        async def start(
            key: NodeKey, role: str, *, into: AsyncExitStack = stack, **kw: Any
        ) -> RoleHandle:
            node = await into.enter_async_context(Node.start(config(key, role)))
            return await into.enter_async_context(
                launch(
                    node,
                    tmp_path / key.peer_id[-8:],
                    engine_factory=lambda: TorchEngine.from_dir(DEFAULT_MODEL_DIR),
                    data_channel=True,  # shards by sendfile: far cheaper than streams
                    ledger_sync_every_s=1.0,
                    **kw,
                )
            )

        trainer = await start(TRAINER, "trainer", max_versions=1)
        v0, v1 = [await start(k, "validator") for k in VALIDATORS[:2]]
        rogue = await start(VALIDATORS[2], "validator", rogue=credit_everything)
        validators = [v0, v1, rogue]
        ids = [k.peer_id for k in VALIDATORS]
        await wait_until(
            lambda: (
                all(v.feed.path_of(0) is not None for v in validators)
                and all(
                    set(ids) - {v.node.peer_id} <= set(v.node.peers_by_role().get("validator", []))
                    for v in validators
                )
            ),
            120,
            poll=0.2,
        )
        run_id = v0.node.run_id
        manifest = v0.feed.manifest_id(0)  # policy v0's: the assignment mixes it
        assert manifest is not None

        # The equivocator: one assignment signed twice (created_at differs), one copy each to
        # two validators. The second validator learnt the claim from the first one's verdict.
        equivocator = await stack.enter_async_context(Node.start(config(EQUIVOCATOR, "inference")))
        work = await trio.to_thread.run_sync(_work, engine, run_id, EQUIVOCATOR, 0, manifest)
        first = sign(work, EQUIVOCATOR)
        copy = sign(dataclasses.replace(work, created_at=work.created_at + 1), EQUIVOCATOR)
        for v in validators:  # a direct dial: no need to wait for DHT discovery
            await equivocator.overlay.dial(v.node.overlay.addrs()[:1], PATIENT_DIAL)
        assert (await _submit(equivocator, ids[0], first)).message.accepted
        await wait_until(lambda: v1.validator.claims.of(EQUIVOCATOR.peer_id, 0, 0), 30)  # type: ignore[union-attr]
        with pytest.raises(PeerError, match="not judged twice"):
            await _submit(equivocator, ids[2], first)  # the same envelope elsewhere: refused
        slashed = await _submit(equivocator, ids[1], copy)
        assert not slashed.message.accepted and EQUIVOCATION in slashed.message.reasons

        # The cheater sends forged work to the rogue validator, which credits it.
        cheater = await stack.enter_async_context(Node.start(config(CHEATER, "inference")))
        forged = sign(
            edit_token(await trio.to_thread.run_sync(_work, engine, run_id, CHEATER, 0, manifest)),
            CHEATER,
        )
        await cheater.overlay.dial(rogue.node.overlay.addrs()[:1], PATIENT_DIAL)
        credited = await _submit(cheater, ids[2], forged)
        assert credited.message.accepted

        crowd = await stack.enter_async_context(AsyncExitStack())  # the workers, closed early
        honest = [await start(k, "inference", into=crowd) for k in WORKERS]
        assert trainer.trainer is not None
        await wait_until(lambda: trainer.trainer.version >= 1, 300, poll=0.5)  # type: ignore[union-attr]
        await wait_until(
            lambda: all(v0.ledger.balance(k.peer_id) > PARAMS.initial_balance for k in WORKERS),
            300,
            poll=0.5,
        )
        # A credit with a changed amount, signed by a validator: every replica refuses it.
        accepted = next(
            v
            for v in (decode(raw, Verdict) for raw in v0.ledger.raw_verdicts())
            if v.message.accepted and v.signer == ids[0]
        )
        forged_credit = sign(
            LedgerEvent(run_id, "credit", accepted.message.worker, 10**6, accepted.id, 1),
            VALIDATORS[0],
        )
        others = [trainer, v1, rogue, *honest]  # gossip does not deliver v0's own message to v0
        before = [h.replica.refused for h in others]
        with pytest.raises(ValidationError, match="credit of 1000000"):
            v0.ledger.add([forged_credit])
        await v0.node.publish_ledger(forged_credit)
        await wait_until(
            lambda: all(h.replica.refused > b for h, b in zip(others, before, strict=True)),
            60,
            poll=0.2,
        )
        # The workers' replicas hold what the validators held; then they leave (CPU is scarce).
        held = v0.ledger.ids()
        await wait_until(lambda: all(h.ledger.ids() >= held for h in honest), 60, poll=0.5)
        assert all(forged_credit.id not in h.ledger.ids() for h in honest)
        await crowd.aclose()

        # The rogue's credit is disputed by the others, and the cheater slashed.
        await wait_until(
            lambda: (
                any(d.message.peer == ids[2] for d in v0.ledger.disputes()) and v0.ledger.banned()
            ),
            180,
            poll=0.5,
        )

        everyone = [trainer, *validators]

        # Every replica converges on the same events and balances.
        def converged() -> bool:
            sets = [h.ledger.ids() for h in everyone]
            return all(s == sets[0] for s in sets) and all(
                h.ledger.stored_balances() == v0.ledger.stored_balances() for h in everyone
            )

        await wait_until(converged, 120, poll=0.5)
        assert all(forged_credit.id not in h.ledger.ids() for h in everyone)

        # The books: one slash of the equivocator, no credit for its copy; honest workers
        # credited once per accepted assignment and never slashed.
        ledger = v0.ledger
        counted = [e for e in ledger.events() if ledger.is_counted(e.id)]

        def of(peer: str, kind: str) -> list[Signed[LedgerEvent]]:
            return [e for e in counted if e.message.peer == peer and e.message.event == kind]

        assert len(of(EQUIVOCATOR.peer_id, "slash")) == 1
        assert len(of(EQUIVOCATOR.peer_id, "credit")) == 1
        assert of(EQUIVOCATOR.peer_id, "credit")[0].message.evidence != slashed.id
        verdicts = [decode(raw, Verdict) for raw in ledger.raw_verdicts()]
        for key in WORKERS:
            accepted_assignments = {
                (v.message.policy_version, v.message.counter)
                for v in verdicts
                if v.message.worker == key.peer_id and v.message.accepted
            }
            assert not of(key.peer_id, "slash")
            assert len(of(key.peer_id, "credit")) == len(accepted_assignments)
            assert ledger.balance(key.peer_id) == PARAMS.initial_balance + CREDIT * len(
                accepted_assignments
            )
        # Each slash's evidence has at least two holders (the accuser and another validator).
        slashes = [*of(EQUIVOCATOR.peer_id, "slash"), *of(CHEATER.peer_id, "slash")]
        assert len(slashes) == 2
        await wait_until(
            lambda: all(
                sum(v.evidence.store.pinned(s.message.evidence) for v in validators) >= 2
                for s in slashes
            ),
            60,
            poll=0.5,
        )

        # The auditor: the genesis and a bootstrap address.
        try:
            gathered = await gather(
                GENESIS,
                boot.addrs()[:1],
                tmp_path / "auditor",
                credits=2,
                listen=LOOPBACK,
                dial=PATIENT_DIAL,
                discover_s=60,
            )
        except Exception as exc:  # the swarm's nested nurseries would hide the cause
            traceback.print_exc()
            raise AssertionError(f"the auditor could not gather: {exc!r}") from exc
        assert not gathered.missing_versions

    evidence = EvidenceStore(gathered.evidence)
    rows = audit_ledger(
        gathered.ledger,
        gathered.policy_path,
        credits=2,
        evidence=evidence,
        manifests=gathered.manifest_id,
    )
    evidence.close()
    slash_rows = [r for r in rows if r.check in ("slash replay", "equivocation")]
    assert slash_rows and all(r.ok for r in slash_rows), rows
    assert len(slash_rows) == len([e for e in counted if e.message.event == "slash"])
    assert any(r.check == "equivocation" for r in slash_rows)
    disputes = [r for r in rows if r.check == "dispute"]
    assert disputes and all(r.ok and r.detail.startswith("upheld") for r in disputes), rows
