"""A run binds its model and its data set: a fresh worker that has only the genesis and a
bootstrap address fetches the card's files (run-files), the v0 weights (SHARDCAST) and the data
set (a parquet folder of two files, loaded with ``datasets``) from its peers, checks every hash,
generates with the model's chat template, and is verified and credited. A reasoning-gym run's
fresh worker builds the same items (digest equal) and is credited. A worker given a different
local model is refused, the file named; a trainer whose v0 is not the card's weights never
announces it, and a v0 that differs is refused everywhere."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.audit import AuditAssets, audit_ledger, policy_dir_source
from node.compute.torch_engine import TorchEngine
from node.home import NodeHome
from node.model.card import ModelMismatchError, card_for_dir, check_dir
from node.policy_feed import PolicyFeed
from node.rl.rollout import score_item
from node.roles.launch import RoleHandle, launch
from node.run import TaskBinding, bind_tasks, create_genesis
from node.run_assets import AssetDirs
from node.runtime import Node, RuntimeConfig
from node.tasks import gym
from node.tasks.dataset import TaskDataset
from swarm.errors import ValidationError
from swarm.messages import PolicyAnnouncement, RunGenesis, RunParams, Signed, sign
from swarm.net.records import wall_clock_ms
from swarm.shardcast import publish
from tests.hf_model import make_test_model
from tests.netfactory import LOOPBACK, key_named, loopback_config, wait_until

PARAMS = RunParams(group_size=2, batch_prompts=1, max_tokens=6, async_level=2)


@pytest.fixture(scope="module")
def models(hf_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The run's model (``scripts/make_test_model.py``: Qwen2, BPE tokenizer, ChatML) and
    another one of the same shape (seed 1)."""
    other = make_test_model(tmp_path_factory.mktemp("models") / "other-model", seed=1)
    return hf_model_dir, other


def data_set(path: Path) -> Path:
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "verifier": "exact"} for a in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def parquet_set(folder: Path) -> Path:
    """Ten sums in two parquet files, columns named as a Hugging Face data set might."""
    import datasets

    datasets.disable_progress_bars()
    folder.mkdir(parents=True)
    rows = [{"q": f"{a}+{a}=", "a": str(2 * a)} for a in range(10)]
    for part in (0, 1):
        chunk = datasets.Dataset.from_list(rows[part * 5 : part * 5 + 5])
        chunk.to_parquet(str(folder / f"train-{part:05d}-of-00002.parquet"))
    return folder


def genesis_for(
    model: Path, tasks: Path | None = None, binding: TaskBinding | None = None
) -> Signed[RunGenesis]:
    return create_genesis(
        key_named("owner"),
        name="bound",
        trainers=[key_named("trainer").peer_id],
        validators=[key_named("validator").peer_id],
        params=PARAMS,
        model=card_for_dir(model, name="test-qwen2"),
        task_data=tasks,
        tasks=binding,
        created_at=1,
    )


class Swarm:
    def __init__(self, stack: AsyncExitStack, genesis: Signed[RunGenesis], root: Path) -> None:
        self.stack, self.genesis, self.root = stack, genesis, root
        self.boot: BootstrapPeer | None = None

    async def bootstrap(self) -> None:
        self.boot = await self.stack.enter_async_context(
            BootstrapPeer.start(
                BootstrapConfig(
                    key=key_named("boot"), listen=LOOPBACK, heartbeat=0.2, genesis=(self.genesis,)
                )
            )
        )

    def config(self, name: str, role: str, home: NodeHome | None = None) -> RuntimeConfig:
        assert self.boot is not None
        return loopback_config(
            key_named(name),
            self.genesis,
            role,
            self.boot.addrs()[:1],
            home=home,
            heartbeat=0.2,
            discover_every_s=0.5,
        )

    async def start(
        self, name: str, role: str, engine: Callable[[], Any] | None = None, **kw: Any
    ) -> RoleHandle:
        node = await self.stack.enter_async_context(Node.start(self.config(name, role)))
        return await self.stack.enter_async_context(
            launch(
                node,
                self.root / name,
                engine_factory=engine,
                ledger_sync_every_s=1.0,
                **kw,
            )
        )


@pytest.mark.slow
async def test_a_fresh_worker_builds_the_reasoning_gym_items_and_is_credited(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    model, _ = models
    binding = bind_tasks(
        "reasoning-gym:leg_counting,basic_arithmetic", seed=2, size=60, cache=tmp_path / "owner"
    )
    genesis = genesis_for(model, binding=binding)
    digest = gym.GymSpec.from_text(genesis.message.task_spec).digest
    card = genesis.message.model
    async with AsyncExitStack() as stack:
        swarm = Swarm(stack, genesis, tmp_path)
        await swarm.bootstrap()
        await swarm.start("trainer", "trainer", model_dir=model)
        validator = await swarm.start(
            "validator",
            "validator",
            lambda: TorchEngine.from_dir(model, chat_template=card.chat_template),
            model_dir=model,
        )
        # The worker's home has no items: it builds them itself and checks the digest.
        home = NodeHome(tmp_path / "fresh-home")
        node = await stack.enter_async_context(
            Node.start(swarm.config("fresh-worker", "inference", home))
        )
        worker = await stack.enter_async_context(
            launch(
                node,
                home.run_dir(node.run_id),
                engine_factory=lambda: TorchEngine.from_dir(model, chat_template=True),
                model_dir=model,
                ledger_sync_every_s=1.0,
            )
        )
        assert gym.items_path(AssetDirs.under(home.path).data, digest).is_file()
        assert worker.worker is not None
        suite = worker.worker.suite
        assert isinstance(suite, TaskDataset) and suite.sha256 == digest
        wid = node.peer_id
        await wait_until(lambda: worker.worker and worker.worker.stats.accepted >= 1, 180, 0.2)
        await wait_until(
            lambda: validator.ledger.balances().of(wid) > PARAMS.initial_balance, 60, 0.2
        )
        # The validator scores with the data set's own scorer: the reference answer 1, a wrong
        # one 0 (the test model's tokenizer round-trips these digits).
        task = suite.task(next(i for i in suite.ids() if suite.task(i).family == "leg_counting"))
        engine = validator.validator.engine if validator.validator else None
        assert engine is not None and engine.text is not None
        right = engine.text.tokenizer.encode(
            f"<answer>{task.answer}</answer>", add_special_tokens=False
        )
        wrong = engine.text.tokenizer.encode(
            f"<answer>{int(task.answer) + 1}</answer>", add_special_tokens=False
        )
        assert engine.score([score_item(task, right), score_item(task, wrong)], 0.0) == [1.0, 0.0]


@pytest.mark.slow
async def test_a_fresh_worker_fetches_the_bound_model_and_is_credited(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    model, other = models
    tasks = parquet_set(tmp_path / "sums")
    genesis = genesis_for(
        model, binding=bind_tasks(str(tasks), columns={"prompt": "q", "answer": "a"})
    )
    assert len(genesis.message.task_files) == 2
    card = genesis.message.model
    assert card.chat_template  # the test model has a ChatML template, and the run applies it

    async with AsyncExitStack() as stack:
        swarm = Swarm(stack, genesis, tmp_path)
        await swarm.bootstrap()
        trainer = await swarm.start("trainer", "trainer", model_dir=model, tasks=tasks)
        # The validator holds the model but not the data set: it fetches that from the trainer.
        validator = await swarm.start(
            "validator",
            "validator",
            lambda: TorchEngine.from_dir(model, chat_template=card.chat_template),
            model_dir=model,
        )
        assert validator.assets is not None and validator.assets.data_set is not None

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
                engine_factory=lambda: TorchEngine.from_dir(
                    dirs.model(card), chat_template=card.chat_template
                ),
                ledger_sync_every_s=1.0,
            )
        )
        assert worker.assets is not None and worker.assets.model_dir == dirs.model(card)
        assert worker.status()["model"] == {
            "name": "test-qwen2",
            "card": card.card_id(),
            "dir": str(dirs.model(card)),
        }
        check_dir(card, dirs.model(card))  # every file, the weights included, as the card says
        assert worker.assets.data_set == dirs.data_files(genesis.message.task_files)
        assert worker.worker is not None and worker.worker.suite.task(3).prompt == "3+3="
        assert worker.feed.store.info(0).pinned  # v0 is kept, so later joiners can fetch it

        wid = node.peer_id
        await wait_until(lambda: worker.worker and worker.worker.stats.accepted >= 1, 180, 0.2)
        await wait_until(
            lambda: validator.ledger.balances().of(wid) > PARAMS.initial_balance, 60, 0.2
        )
        assert trainer.trainer is not None

        # A worker with a different local model is refused before any work, the file named.
        with pytest.raises(ModelMismatchError, match=r"--model .*other-model: \S+ (differs|has)"):
            await swarm.start("wrong-worker", "inference", model_dir=other)
        ledger_path = validator.ledger.path

    # The audit loads the run's model by its card: here from the fresh worker's home cache.
    policies = policy_dir_source(tmp_path / "trainer" / "policies")
    rows = audit_ledger(ledger_path, policies, assets=AuditAssets(home=home.path))
    assert any(r.check == "accept replay" for r in rows), rows
    assert all(r.ok for r in rows), rows
    with pytest.raises(ModelMismatchError, match="other-model"):
        audit_ledger(ledger_path, policies, assets=AuditAssets(model=other, home=home.path))


async def test_every_node_refuses_a_v0_that_is_not_the_cards_weights(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    model, other = models
    genesis = genesis_for(model, data_set(tmp_path / "tasks.jsonl"))
    async with AsyncExitStack() as stack:
        swarm = Swarm(stack, genesis, tmp_path)
        await swarm.bootstrap()
        trainer = await stack.enter_async_context(Node.start(swarm.config("trainer", "trainer")))
        worker = await stack.enter_async_context(Node.start(swarm.config("worker", "inference")))
        feed = PolicyFeed(trainer, tmp_path / "shards", data_channel=False)
        worker_feed = PolicyFeed(worker, tmp_path / "w-shards", data_channel=False)
        async with trio.open_nursery() as nursery:
            await nursery.start(feed.run)
            await nursery.start(worker_feed.run)
            # The trainer's own publish refuses to announce another file as v0 ...
            with pytest.raises(ValidationError, match="not the run's model weights"):
                await feed.publish(0, other / "model.safetensors")
            assert trainer.policy.newest is None and 0 not in feed.store.versions()
            # ... and a v0 cut behind its back is refused by every node that fetches it.
            manifest = publish(
                other / "model.safetensors",
                key=trainer.key,
                genesis=genesis,
                version=0,
                store=feed.store,
            )
            await wait_until(lambda: worker.peers_by_role().get("trainer"), 30)
            with pytest.raises(ValidationError, match="not the run's model weights"):
                await worker_feed.fetch_version(0)
            assert 0 not in worker_feed.store.versions()
            # The trainer's announcement of that v0 is refused at once, with nothing fetched.
            announced = sign(
                PolicyAnnouncement(worker.run_id, 0, manifest.id, wall_clock_ms()), trainer.key
            )
            with pytest.raises(ValidationError, match="refused before"):
                await worker_feed.fetch(announced)
            assert 0 not in worker_feed.store.versions()
            nursery.cancel_scope.cancel()
