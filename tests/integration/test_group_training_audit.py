"""Two trainers averaging, checked: a real swarm on 127.0.0.1 (a bootstrap peer, two genesis
trainers averaging through hivemind, a validator that audits every version, two workers).

Trainer B forges its gradient on the first two rounds in which it has samples of its own with
signal (the negated gradient of its samples, committed and sent as its own). Which trainer a
sample goes to is a rendezvous draw on its submission, and a round starts when either trainer
has its share, so B often has none in a round: forged rounds picked by number carried no
samples in two CI runs (of ``bd727e8``, with two such rounds, and of ``45588ba``, with three).
Picks counted by groups alone were spent, in 2 of 3 CI runs (of ``0900199`` and ``c2d77c7``),
on rounds whose groups all had equal rewards: no gradient, and a commitment of no samples.

Every round's record carries both members' signed gradient commitments; ``audit --training``
from the swarm alone replays the averaging from the committed gradients and every member's
gradient from its samples: a round where B's forged gradient carried samples is
``member-mismatch``, an honest averaged round agrees. The validator, which replays one member
per round (its draw picks it), never disputes an honest round.
"""

from __future__ import annotations

import traceback
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.audit import AuditAssets
from node.audit_training import audit_training
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.roles.cheats import trainer_cheat_by_spec
from node.roles.launch import RoleHandle, launch
from node.run import create_genesis
from node.runtime import Node
from swarm.messages import GradientCommitment, RunParams, decode
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
VERSIONS = 5
FORGED = 2
"""Trainer B forges its gradient on the first two rounds in which it has samples of its own with
signal (``forge-gradient*2``); its other rounds are honest."""


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_audit_agrees_with_averaged_rounds_and_catches_a_forged_member_gradient(
    tmp_path: Path,
) -> None:
    owner, a_key, b_key, validator_key = (
        key_named(n) for n in ("owner", "g-trainer-a", "g-trainer-b", "g-val")
    )
    genesis = create_genesis(
        owner,
        name="group-audit",
        trainers=[a_key.peer_id, b_key.peer_id],
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
                    key=key_named("g-boot"), listen=LOOPBACK, heartbeat=0.2, genesis=(genesis,)
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

        await start(a_key, "trainer", max_versions=VERSIONS)
        cheat = trainer_cheat_by_spec(f"forge-gradient*{FORGED}")
        await start(b_key, "trainer", max_versions=VERSIONS, trainer_cheat=cheat)
        validator = await start(validator_key, "validator")
        for name in ("g-worker-a", "g-worker-b"):
            await start(key_named(name), "inference")
        store = validator.training
        assert store is not None

        try:
            await wait_until(
                lambda: all(v in store.audits() for v in range(1, VERSIONS + 1)), 400, poll=0.5
            )
            forged: set[int] = set()
            averaged: set[int] = set()
            rounds = []  # (version, parent, [(member, samples)]): said when nothing was tested
            for record in store.records():
                r = record.message
                members = [decode(raw, GradientCommitment) for raw in r.members]
                rounds.append(
                    (r.version, r.parent, [(m.signer[-6:], m.message.samples) for m in members])
                )
                if len(members) > 1:
                    averaged.add(r.version)
                if any(
                    m.signer == b_key.peer_id and m.message.samples > 0 and r.parent in cheat.picked
                    for m in members
                ):
                    forged.add(r.version)
            # By step number (rounds from v1, v2, v3) B once carried no samples in all three
            # forged rounds (CI of 45588ba, docs/RELIABILITY.md, section 5): it now forges the
            # first rounds it has samples in. The rounds and B's id say why, should it fail.
            b = b_key.peer_id[-6:]
            assert forged, f"B ({b})'s forged gradient carried no samples: nothing tested {rounds}"
            assert averaged - forged, f"no honest round of both trainers: nothing tested {rounds}"
            # The validator replays one member per round: no honest round is ever disputed.
            outcomes = store.audits()
            for version in averaged - forged:
                assert outcomes[version][0] == "agreed", outcomes

            # One forged round and one honest one: each round replays every member.
            bad, honest = min(forged), min(averaged - forged)
            report = await audit_training(
                genesis,
                boot.addrs()[:1],
                tmp_path / "audit",
                AuditAssets(model=DEFAULT_MODEL_DIR, home=tmp_path / "auditor"),
                versions=sorted({bad, honest}),
                discover_s=30,
            )
            rows = {r.version: r for r in report.rows}
            assert rows[bad].outcome == "disputed", rows[bad]
            assert rows[bad].findings[0].reason == "member-mismatch", rows[bad]
            assert b_key.peer_id[-8:] in rows[bad].findings[0].detail
            assert rows[honest].outcome == "agreed", rows[honest]
        except BaseException:
            traceback.print_exc()
            raise
