"""Assignments nobody chooses (issue 24): a worker makes requests ``0 .. quota - 1`` of a policy
version and then waits for the next version; a counter past the quota is refused at the door
with nothing stored; what each worker submitted of its quota shows in the ledger, in ``ledger
show`` and on the dashboard. Real hosts on 127.0.0.1: a trainer that publishes v0 only, a
validator and one worker, all with the embedded model."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from bootstrap.service import BootstrapConfig, BootstrapPeer
from cli.app import main
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.roles.launch import RoleHandle, launch
from node.run import create_genesis, suite_for
from node.runtime import Node
from node.web.queries import LedgerQueries
from swarm.assignment import assign
from swarm.errors import PeerError
from swarm.ledger.views import read_quota_use
from swarm.messages import RunParams, sign
from swarm.net.names import SUBMIT
from swarm.net.protocols import SUBMIT_LIMITS
from tests.netfactory import LOOPBACK, key_named, loopback_config, wait_until

QUOTA = 3
PARAMS = RunParams(group_size=2, batch_prompts=2, max_tokens=8, async_level=2, quota=QUOTA)


@pytest.mark.slow
async def test_a_worker_stops_at_its_quota_and_the_ledger_shows_what_it_submitted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    owner, trainer_key, validator_key, worker_key = (
        key_named(n) for n in ("owner", "trainer", "validator", "quota-worker")
    )
    genesis = create_genesis(
        owner,
        name="quota",
        trainers=[trainer_key.peer_id],
        validators=[validator_key.peer_id],
        params=PARAMS,
        created_at=1,
    )

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
                key, genesis, role, boot.addrs()[:1], heartbeat=0.2, discover_every_s=0.5
            )
            node = await stack.enter_async_context(Node.start(config))
            return await stack.enter_async_context(
                launch(
                    node,
                    tmp_path / key.peer_id[-8:],
                    engine_factory=lambda: TorchEngine.from_dir(DEFAULT_MODEL_DIR),
                    ledger_sync_every_s=1.0,
                    **kw,
                )
            )

        await start(trainer_key, "trainer", max_versions=0)  # v0 only: one quota to use
        validator = await start(validator_key, "validator")
        worker = await start(worker_key, "inference")
        assert worker.worker is not None and validator.validator is not None
        stats = worker.worker.stats
        await wait_until(lambda: stats.quota_waits >= 1, 240, poll=0.2)
        assert (stats.submitted, stats.accepted) == (QUOTA, QUOTA), stats
        assert stats.quota_used == {"v0": f"{QUOTA} of {QUOTA}"}
        counters = json.loads((tmp_path / worker_key.peer_id[-8:] / "worker.counters").read_text())
        assert counters == {"0": QUOTA}  # stored: a restarted worker does not start again at 0
        assert "quota" not in validator.validator.stats.refusals  # it never went past its quota

        # A worker that grinds: counter QUOTA of v0, a real assignment, signed. Refused at the
        # door (the validator's precheck), nothing stored or claimed.
        manifest = worker.feed.manifest_id(0)
        assert manifest is not None and manifest == validator.feed.manifest_id(0)
        suite = suite_for(genesis.message)
        engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR)
        a = assign(
            worker.node.run_id,
            0,
            worker_key.peer_id,
            QUOTA,
            n_prompts=PARAMS.batch_prompts,
            suite_size=suite.size,
            excluded=suite.excluded,
            manifest_id=manifest,
        )
        extra = build_submission(
            generate_groups(engine, suite, a, PARAMS),
            run_id=worker.node.run_id,
            version=0,
            counter=QUOTA,
        )
        signed = sign(extra, worker_key)
        with pytest.raises(PeerError, match=r"refused \(quota\): request counter 3 is outside"):
            await worker.node.request(validator_key.peer_id, SUBMIT, signed.raw, SUBMIT_LIMITS)
        assert validator.validator.stats.refusals.get("quota") == 1
        assert validator.evidence.store.get(signed.id) is None
        assert not validator.validator.claims.of(worker_key.peer_id, 0, QUOTA)
        ledger_path = validator.ledger.path

    tally = read_quota_use(ledger_path, QUOTA, PARAMS.async_level + 1)
    [use] = tally.of(worker_key.peer_id)
    assert (use.version, use.submitted, use.accepted, use.quota) == (0, QUOTA, QUOTA, QUOTA)
    assert use.describe() == f"submitted {QUOTA} of {QUOTA} ({QUOTA} accepted)"

    with pytest.raises(SystemExit):
        main(["ledger", "show", "--db", str(ledger_path), "--json"])
    shown = json.loads(capsys.readouterr().out)["quota_use"]
    assert shown["quota"] == QUOTA and shown["versions"] == [0]
    assert shown["workers"] == [use.as_dict()]
    with pytest.raises(SystemExit):
        main(["ledger", "show", "--db", str(ledger_path)])
    assert f"submitted {QUOTA} of {QUOTA}" in capsys.readouterr().out

    queries = LedgerQueries(
        ledger_path, initial_balance=100, ban_threshold=0, quota=QUOTA, window=3
    )
    try:
        page = queries.contributors(roles={}, live_seen_ms={}, limit=200)
    finally:
        queries.close()
    [row] = [r for r in page["items"] if r["peer"] == worker_key.peer_id]
    assert row["requests"]["text"] == f"{QUOTA} of {QUOTA} (v0)"
