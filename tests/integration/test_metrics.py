"""``--metrics-port`` on a role node (issue 15): a validator started with a metrics port answers
a scrape over HTTP from another thread (it used to answer "A server error occurred": the
metrics thread read SQLite through the event loop's connection), and its counters move with
what it does: a refused submission shows under its check."""

from __future__ import annotations

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

OWNER, VALIDATOR, WORKER = (key_named(n) for n in ("m-owner", "m-validator", "m-worker"))
GENESIS = create_genesis(
    OWNER,
    name="metrics",
    trainers=[OWNER.peer_id],
    validators=[VALIDATOR.peer_id],
    params=RunParams(group_size=2, batch_prompts=1, max_tokens=8),
    created_at=1,
)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


async def test_a_validator_with_a_metrics_port_answers_a_scrape(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(
            BootstrapPeer.start(
                BootstrapConfig(
                    key=key_named("m-boot"), listen=LOOPBACK, heartbeat=0.2, genesis=(GENESIS,)
                )
            )
        )

        def config(key: NodeKey, role: str, metrics_port: int | None = None) -> RuntimeConfig:
            return loopback_config(
                key,
                GENESIS,
                role,
                boot.addrs()[:1],
                heartbeat=0.2,
                discover_every_s=0.5,
                metrics_port=metrics_port,
            )

        node = await stack.enter_async_context(Node.start(config(VALIDATOR, "validator", 0)))
        await stack.enter_async_context(
            launch(
                node,
                tmp_path / "validator",
                engine_factory=lambda: TorchEngine.from_dir(DEFAULT_MODEL_DIR),
                data_channel=False,
            )
        )
        worker = await stack.enter_async_context(Node.start(config(WORKER, "inference")))
        port = node.metrics_port
        assert port

        async def scraped(wanted: str) -> str | None:
            text = await trio.to_thread.run_sync(scrape, port)
            return text if wanted in text else None

        text = await wait_until(lambda: scraped("swarm_node_validator_claims"), timeout=20)
        assert "swarm_node_evidence_bytes" in text and "swarm_node_status_age_seconds" in text
        assert 'swarm_node_disk_bytes{entry="ledger.db"}' in text
        assert "swarm_node_evidence_summarized_objects" in text
        assert "swarm_node_validator_newcomer_judge_seconds_total" in text

        garbage = RolloutSubmission("cd" * 16, 0, 0, ("1",), (Sample("1", (1,), 0, (), "stop"),), 1)
        await wait_until(
            lambda: VALIDATOR.peer_id in worker.peers_by_role().get("validator", []), 20
        )
        with pytest.raises(SwarmError, match="refused"):
            await worker.request(
                VALIDATOR.peer_id, SUBMIT, sign(garbage, WORKER).raw, SUBMIT_LIMITS
            )
        text = await wait_until(
            lambda: scraped('swarm_node_validator_refusals_total{check="run"} 1.0'), timeout=10
        )
        assert 'swarm_node_validator_judged_total{outcome="accepted"} 0.0' in text
