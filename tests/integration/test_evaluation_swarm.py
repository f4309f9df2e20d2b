"""Held-out evaluation in a real swarm on 127.0.0.1: one trainer, two validators, one worker and
a bootstrap peer keeping a ledger replica, with the embedded model and evaluation at every
version. Each evaluated version is signed by the validator due for it and gossiped; every node
stores the same record; the dashboard API of a worker and of the bootstrap peer return the
curve; ``audit`` replays a sampled item of each and agrees."""

from __future__ import annotations

import traceback
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
import trio

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.audit import audit_ledger, policy_dir_source
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.roles.launch import RoleHandle, launch
from node.run import create_genesis
from node.runtime import Node
from node.web.serve import serve_dashboard
from node.web.views import bootstrap_view, node_view
from swarm.messages import RunParams, eval_seed, eval_validator
from tests.netfactory import LOOPBACK, key_named, loopback_config, wait_until

PARAMS = RunParams(
    group_size=4, batch_prompts=2, max_tokens=8, async_level=2, eval_every=1, eval_size=8
)
VERSIONS = 2


@pytest.mark.slow
async def test_validators_evaluate_their_due_versions_and_every_node_stores_them(
    tmp_path: Path,
) -> None:
    owner, trainer_key = key_named("owner"), key_named("trainer")
    validator_keys = [key_named(f"eval-validator-{i}") for i in range(2)]
    validators = [k.peer_id for k in validator_keys]
    genesis = create_genesis(
        owner,
        name="eval",
        trainers=[trainer_key.peer_id],
        validators=validators,
        params=PARAMS,
        created_at=1,
    )

    def engine() -> TorchEngine:
        return TorchEngine.from_dir(DEFAULT_MODEL_DIR)

    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(
            BootstrapPeer.start(
                BootstrapConfig(
                    key=key_named("boot"),
                    listen=LOOPBACK,
                    heartbeat=0.2,
                    genesis=(genesis,),
                    ledger_dir=tmp_path / "boot" / "runs",
                )
            )
        )
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)

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

        trainer = await start(trainer_key, "trainer", max_versions=VERSIONS)
        vals = [await start(k, "validator") for k in validator_keys]
        worker = await start(key_named("eval-worker"), "inference")
        wanted = set(range(VERSIONS + 1))

        def held(handle: RoleHandle) -> set[int]:
            return {r.message.version for r in handle.evaluations.records()}

        # Every node stores every evaluation: the evaluator keeps its own, gossip brings the
        # rest, and the worker, started after v0 was evaluated, pulls v0 from a peer.
        try:
            everyone = (*vals, worker, trainer)
            try:
                await wait_until(lambda: all(held(h) >= wanted for h in everyone), 180, poll=0.2)
            except trio.TooSlowError:
                state = {
                    "trainer_version": trainer.trainer and trainer.trainer.version,
                    "held": [sorted(held(h)) for h in everyone],
                    "evaluators": [v.evaluator and vars(v.evaluator.stats) for v in vals],
                }
                raise AssertionError(f"evaluations not everywhere: {state}") from None
            run_id = trainer.node.run_id
            for record in worker.evaluations.records():
                e = record.message
                assert record.signer == eval_validator(run_id, e.version, validators)
                assert e.seed == eval_seed(run_id, e.version)
                assert len(e.item_ids) == PARAMS.eval_size
            # Each validator evaluated exactly its own share, each version once.
            for key, handle in zip(validator_keys, vals, strict=True):
                assert handle.evaluator is not None
                mine = [v for v in wanted if eval_validator(run_id, v, validators) == key.peer_id]
                assert handle.evaluator.stats.evaluated == len(mine)
                assert handle.evaluator.stats.missed == 0
            status = worker.status()["evaluation"]
            assert status["count"] >= len(wanted) and status["first_version"] == 0

            # The API of a role node and of the bootstrap peer return the curve.
            mine_view = node_view(worker.node, worker.ledger.path, worker.feed)
            boot_view = bootstrap_view(boot, genesis, tmp_path / "boot")
            await wait_until(lambda: len(boot_view.evaluations()) >= len(wanted), 30, poll=0.2)
            for view in (mine_view, boot_view):
                url = await nursery.start(serve_dashboard, view, "127.0.0.1", 0)
                async with httpx.AsyncClient(timeout=10) as http:
                    curve = (await http.get(url + "api/v1/evaluations")).json()
                    rewards = (await http.get(url + "api/v1/rewards")).json()
                assert curve["available"] and rewards["eval"]["available"]
                points = {p["version"]: p for p in curve["items"]}
                assert set(points) >= wanted
                assert points[0]["signer"] == eval_validator(run_id, 0, validators)
                assert points[0]["items"] == PARAMS.eval_size
            evaluator_ledger = vals[0].ledger.path
            policies = tmp_path / trainer_key.peer_id[-8:] / "policies"
        except BaseException:
            # Raised in here, a failure reaches pytest nested deeper than the 10 exception
            # groups a traceback shows (every node's nurseries): print it where it happened.
            traceback.print_exc()
            raise

    rows = audit_ledger(evaluator_ledger, policy_dir_source(policies), credits=0)
    evaluated = [r for r in rows if r.check == "evaluation replay"]
    assert len(evaluated) >= len(wanted), rows
    assert all(r.ok for r in evaluated), evaluated
