"""``--metrics-port`` on every role (issues 15 and 28): a live swarm on 127.0.0.1 (a bootstrap
peer, a trainer, a validator and a worker, each serving metrics) trains a version, and a scrape of
each answers over HTTP from another thread (the metrics thread reads a snapshot the event loop
takes, never the loop's SQLite connections) with the counters an operator would graph, moving with
what the role does: a refused submission shows under the validator's check, the worker's
accepted work and fetched bytes, the trainer's steps and published versions, the bootstrap
peer's connections."""

from __future__ import annotations

import re
import urllib.request
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.roles.launch import launch
from node.run import create_genesis
from node.runtime import Node, RuntimeConfig
from swarm.errors import SwarmError
from swarm.identity import NodeKey
from swarm.messages import RolloutSubmission, RunParams, Sample, sign
from swarm.net.names import SUBMIT
from swarm.net.protocols import SUBMIT_LIMITS
from tests.netfactory import LOOPBACK, key_named, loopback_config, wait_until

pytestmark = pytest.mark.slow

OWNER, TRAINER, VALIDATOR, WORKER, PROBE = (
    key_named(n) for n in ("m-owner", "m-trainer", "m-validator", "m-worker", "m-probe")
)
GENESIS = create_genesis(
    OWNER,
    name="metrics",
    trainers=[TRAINER.peer_id],
    validators=[VALIDATOR.peer_id],
    params=RunParams(group_size=2, batch_prompts=1, max_tokens=8, eval_every=0),
    created_at=1,
)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def value(text: str, sample: str) -> float:
    """The value of one sample line (``name{labels}``), or -1 when absent."""
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else -1.0


async def test_every_role_answers_a_scrape_with_its_counters(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(
            BootstrapPeer.start(
                BootstrapConfig(
                    key=key_named("m-boot"),
                    listen=LOOPBACK,
                    heartbeat=0.2,
                    genesis=(GENESIS,),
                    metrics_port=0,
                )
            )
        )

        def config(key: NodeKey, role: str, metrics_port: int | None = 0) -> RuntimeConfig:
            return loopback_config(
                key,
                GENESIS,
                role,
                boot.addrs()[:1],
                heartbeat=0.2,
                discover_every_s=0.5,
                metrics_port=metrics_port,
            )

        ports: dict[str, int] = {}
        for key, role in ((TRAINER, "trainer"), (VALIDATOR, "validator"), (WORKER, "inference")):
            node = await stack.enter_async_context(Node.start(config(key, role)))
            await stack.enter_async_context(
                launch(
                    node,
                    tmp_path / role,
                    engine_factory=lambda: TorchEngine.from_dir(DEFAULT_MODEL_DIR),
                    data_channel=False,
                    max_versions=2,
                )
            )
            assert node.metrics_port
            ports[role] = node.metrics_port
        assert boot.metrics_port
        ports["bootstrap"] = boot.metrics_port
        probe = await stack.enter_async_context(Node.start(config(PROBE, "inference", None)))

        async def scraped(role: str, sample: str, at_least: float = 0.0) -> str | None:
            text = await trio.to_thread.run_sync(scrape, ports[role])
            return text if value(text, sample) >= at_least else None

        # The swarm trains: the trainer steps and publishes, the worker is credited.
        trainer = await wait_until(
            lambda: scraped("trainer", "swarm_node_trainer_versions_published_total", 2), 180
        )
        assert value(trainer, "swarm_node_trainer_steps_total") >= 1
        assert value(trainer, "swarm_node_trainer_submissions_in_total") >= 1
        assert value(trainer, "swarm_node_shardcast_published_bytes_total") > 0
        assert value(trainer, "swarm_node_engine_restarts_total") == 0
        worker = await wait_until(
            lambda: scraped(
                "inference", 'swarm_node_worker_submissions_total{outcome="accepted"}', 1
            ),
            120,
        )
        assert value(worker, "swarm_node_worker_samples_generated_total") >= 1
        assert value(worker, "swarm_node_worker_generate_seconds_total") > 0
        assert value(worker, 'swarm_node_worker_submissions_total{outcome="stale"}') >= 0
        assert value(worker, "swarm_node_shardcast_fetched_bytes_total") > 0
        assert value(worker, "swarm_node_shardcast_fetch_seconds_total") > 0
        assert value(worker, "swarm_node_engine_restarts_total") == 0
        assert value(worker, "swarm_node_connections_high") == 48  # an inference node's default
        assert value(worker, "swarm_node_connections_trimmed_total") == 0  # a small swarm

        validator = await trio.to_thread.run_sync(scrape, ports["validator"])
        for name in (
            "swarm_node_validator_claims",
            "swarm_node_evidence_bytes",
            "swarm_node_status_age_seconds",
            "swarm_node_evidence_summarized_objects",
            "swarm_node_validator_newcomer_judge_seconds_total",
        ):
            assert value(validator, name) >= 0, name
        assert 'swarm_node_disk_bytes{entry="ledger.db"}' in validator
        garbage = RolloutSubmission("cd" * 16, 0, 0, ("1",), (Sample("1", (1,), 0, (), "stop"),), 1)
        await wait_until(
            lambda: VALIDATOR.peer_id in probe.peers_by_role().get("validator", []), 20
        )
        with pytest.raises(SwarmError, match="refused"):
            await probe.request(VALIDATOR.peer_id, SUBMIT, sign(garbage, PROBE).raw, SUBMIT_LIMITS)
        validator = await wait_until(
            lambda: scraped("validator", 'swarm_node_validator_refusals_total{check="run"}', 1), 10
        )
        assert value(validator, 'swarm_node_validator_judged_total{outcome="accepted"}') >= 1

        bootstrap = await trio.to_thread.run_sync(scrape, ports["bootstrap"])
        assert value(bootstrap, "swarm_node_connected_peers") >= 4
        assert value(bootstrap, "swarm_node_bootstrap_runs_routed") == 1
        for name in (
            "swarm_node_relay_reservations",
            "swarm_node_relay_circuits",
            "swarm_node_relay_bytes_total",
            "swarm_node_bootstrap_dht_peers",
            "swarm_node_uptime_seconds",
            "swarm_node_warnings",
        ):
            assert value(bootstrap, name) >= 0, name
