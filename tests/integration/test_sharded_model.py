"""A run binds a sharded model as it ships (three safetensors shards and
model.safetensors.index.json): the trainer publishes the shard files as version 0, and a fresh
worker that has only the genesis and a bootstrap address fetches the card's small files
(run-files) and v0's shard files (SHARDCAST, one version of several files), checks each against
the card, links them into its model cache, loads them and is verified and credited."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from node.audit import AuditAssets, audit_ledger, policy_dir_source
from node.compute.torch_engine import TorchEngine
from node.home import NodeHome
from node.model.card import card_for_dir, check_dir, weights_mismatch
from node.roles.launch import launch
from node.run import create_genesis
from node.run_assets import AssetDirs
from node.runtime import Node
from swarm.messages import RunGenesis, RunParams, Signed
from tests.integration.test_model_binding import Swarm
from tests.netfactory import key_named, wait_until
from tests.sharded_model import sharded_model

PARAMS = RunParams(
    group_size=2, batch_prompts=1, max_tokens=6, async_level=2, shard_size=256 * 1024
)
"""Shards of 256 KiB: the 1.4 MiB model travels in several, across the files' boundaries."""


def genesis_for(model: Path) -> Signed[RunGenesis]:
    return create_genesis(
        key_named("owner"),
        name="sharded",
        trainers=[key_named("trainer").peer_id],
        validators=[key_named("validator").peer_id],
        params=PARAMS,
        model=card_for_dir(model, name="sharded-tiny-llama"),
        created_at=1,
    )


@pytest.mark.slow
async def test_a_fresh_worker_fetches_a_sharded_model_and_is_credited(tmp_path: Path) -> None:
    model = sharded_model(tmp_path / "sharded-model")
    genesis = genesis_for(model)
    card = genesis.message.model
    assert card.sharded and len(card.weight_files) == 3

    async with AsyncExitStack() as stack:
        swarm = Swarm(stack, genesis, tmp_path)
        await swarm.bootstrap()
        trainer = await swarm.start("trainer", "trainer", model_dir=model)
        validator = await swarm.start(
            "validator", "validator", lambda: TorchEngine.from_dir(model), model_dir=model
        )

        # A fresh worker: the genesis, a bootstrap address and an empty home, nothing else.
        home = NodeHome(tmp_path / "fresh-home")
        dirs = AssetDirs.under(home.path)
        node = await stack.enter_async_context(
            Node.start(swarm.config("fresh-worker", "inference", home))
        )
        worker = await stack.enter_async_context(
            launch(
                node,
                home.run_dir(node.run_id),
                engine_factory=lambda: TorchEngine.from_dir(dirs.model(card)),
                ledger_sync_every_s=1.0,
            )
        )
        cache = dirs.model(card)
        assert worker.assets is not None and worker.assets.model_dir == cache
        check_dir(card, cache)  # the index, every shard and every small file, as the card says
        v0 = worker.feed.path_of(0)
        assert v0 is not None and v0.is_dir()  # a version of several files, each by its name
        assert weights_mismatch(card, v0) is None
        for ref in card.weight_files:  # the cache and the pinned v0 share one copy
            assert (cache / ref.name).stat().st_ino == (v0 / ref.name).stat().st_ino
        assert worker.feed.store.info(0).pinned

        wid = node.peer_id
        await wait_until(lambda: worker.worker and worker.worker.stats.accepted >= 1, 180, 0.2)
        await wait_until(
            lambda: validator.ledger.balances().of(wid) > PARAMS.initial_balance, 60, 0.2
        )
        assert trainer.trainer is not None
        ledger_path = validator.ledger.path

    # The audit replays v0 on the run's model by its card (the trainer archives no copy of a
    # sharded v0): here the fresh worker's cache, loaded shard by shard.
    policies = policy_dir_source(tmp_path / "trainer" / "policies")
    assert not (tmp_path / "trainer" / "policies" / "v0.safetensors").exists()
    rows = audit_ledger(ledger_path, policies, assets=AuditAssets(home=home.path))
    assert any(r.check == "accept replay" for r in rows), rows
    assert all(r.ok for r in rows), rows
