"""A real swarm trains: one trainer, one validator, two honest workers and a cheater on 127.0.0.1
in one trio run, with the embedded model. The policy advances, the cheater is slashed and banned,
the honest workers are credited, and the audit agrees with every slash."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.audit import audit_ledger, policy_dir_source
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.roles.cheats import edit_token
from node.roles.launch import RoleHandle, launch
from node.run import create_genesis
from node.runtime import Node
from swarm.messages import RunParams
from tests.netfactory import LOOPBACK, key_named, loopback_config, wait_until

PARAMS = RunParams(group_size=4, batch_prompts=2, max_tokens=8, async_level=2)


@pytest.mark.slow
async def test_swarm_trains_and_slashes_the_cheater(tmp_path: Path) -> None:
    owner, trainer_key, validator_key = (key_named(n) for n in ("owner", "trainer", "validator"))
    genesis = create_genesis(
        owner,
        name="rl",
        trainers=[trainer_key.peer_id],
        validators=[validator_key.peer_id],
        params=PARAMS,
        created_at=1,
    )
    workers = [key_named(f"worker-{i}") for i in range(2)]
    cheater = key_named("cheater")

    def engine() -> TorchEngine:
        return TorchEngine.from_dir(DEFAULT_MODEL_DIR)

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(
            BootstrapPeer.start(
                BootstrapConfig(
                    key=key_named("boot"), listen=LOOPBACK, heartbeat=0.2, genesis=(genesis,)
                )
            )
        )

        async def start(key, role: str, **kw) -> RoleHandle:  # type: ignore[no-untyped-def]
            config = loopback_config(
                key,
                genesis,
                role,
                boot.addrs()[:1],
                heartbeat=0.2,
                discover_every_s=0.5,
            )
            node = await stack.enter_async_context(Node.start(config))
            return await stack.enter_async_context(
                launch(
                    node,
                    tmp_path / key.peer_id[-8:],
                    engine_factory=engine,
                    data_channel=True,
                    ledger_sync_every_s=1.0,
                    **kw,
                )
            )

        trainer = await start(trainer_key, "trainer", max_versions=3)
        validator = await start(validator_key, "validator")
        honest = [await start(k, "inference") for k in workers]
        bad = await start(cheater, "inference", tamper=edit_token)

        assert trainer.trainer is not None and validator.validator is not None
        await wait_until(lambda: trainer.trainer.version >= 2, 240, poll=0.2)  # type: ignore[union-attr]
        await wait_until(lambda: validator.ledger.balances().banned(cheater.peer_id), 60, poll=0.2)
        await wait_until(
            lambda: all(
                validator.ledger.balances().of(k.peer_id) > PARAMS.initial_balance for k in workers
            ),
            60,
            poll=0.2,
        )
        # Every node's replica converges on the validator's ledger (gossip plus sync).
        await wait_until(
            lambda: all(h.ledger.ids() >= validator.ledger.ids() for h in (*honest, bad, trainer)),
            60,
            poll=0.2,
        )
        assert bad.worker is not None and bad.worker.stats.rejected >= 1
        assert trainer.trainer.stats.reward_by_version()  # type: ignore[union-attr]
        policies = tmp_path / trainer_key.peer_id[-8:] / "policies"
        ledger_path = validator.ledger.path

    rows = audit_ledger(ledger_path, policy_dir_source(policies))
    assert rows and all(r.ok for r in rows), rows
    assert any(r.check == "slash replay" for r in rows)
