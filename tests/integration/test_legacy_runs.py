"""Runs made before issue 24 still load and verify; a genesis naming rules this version does
not know is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.rl.rollout import generate_groups
from node.rl.submission import build_submission
from node.roles.judge import JudgeContext, judge
from node.run import create_genesis, load_genesis
from node.tasks.suite import default_suite
from swarm.assignment import assign
from swarm.errors import ConfigError
from swarm.identity import NodeKey
from swarm.ledger import Balances
from swarm.messages import LEGACY_PARAMS, RunGenesis, RunParams, decode, sign
from swarm.sampling import GUMBEL_1
from swarm.wire import canonical, seal

OWNER = NodeKey.from_seed(b"\x31" * 32)
WORKER = NodeKey.from_seed(b"\x32" * 32)


def resigned(genesis: RunGenesis, params: dict[str, object]) -> bytes:
    """``genesis`` signed again with ``params`` as its parameter map, as an older (or newer)
    swarm-node would have written it, bypassing this version's checks."""
    wire = genesis.to_wire()
    wire["params"] = params
    payload = canonical(wire)
    return seal(RunGenesis.KIND, payload, OWNER.public, OWNER.signature(RunGenesis.KIND, payload))


@pytest.fixture(scope="module")
def genesis() -> RunGenesis:
    g = create_genesis(OWNER, name="legacy", trainers=[OWNER.peer_id], validators=[OWNER.peer_id])
    return g.message


def test_a_genesis_from_before_issue_24_means_the_old_rules(genesis: RunGenesis) -> None:
    old = {k: v for k, v in genesis.params.to_wire().items() if k not in LEGACY_PARAMS}
    params = decode(resigned(genesis, old), RunGenesis).message.params
    assert params.sampler == GUMBEL_1 and params.quota == 0
    assert params.tie_tol_fp32 == params.tie_tol_bf16 == 0.25
    assert params.max_tolerated_per_1k == 0
    assert RunParams().sampler == "gumbel-2" and RunParams().quota > 0  # new runs


def test_work_of_a_legacy_run_verifies_with_its_own_sampler(genesis: RunGenesis) -> None:
    old = {k: v for k, v in genesis.params.to_wire().items() if k not in LEGACY_PARAMS}
    old.update(group_size=4, batch_prompts=2, max_tokens=16)
    params = decode(resigned(genesis, old), RunGenesis).message.params
    engine = TorchEngine.from_dir(DEFAULT_MODEL_DIR)
    suite = default_suite()
    run = "ef" * 16
    a = assign(run, 1, WORKER.peer_id, 5000, n_prompts=2, suite_size=suite.size)  # no quota
    sub = build_submission(
        generate_groups(engine, suite, a, params), run_id=run, version=1, counter=5000
    )
    ctx = JudgeContext(run, params, suite, 1, Balances(100, 0, {}))
    verdict = judge(sign(sub, WORKER), ctx, engine, counter_seen=False)
    assert verdict.accepted, verdict.reasons
    # The same tokens judged as if the run used gumbel-2 are not the seeded choice.
    newer = JudgeContext(
        run,
        RunParams.from_map({**params.to_wire(), "sampler": "gumbel-2"}),
        suite,
        1,
        Balances(100, 0, {}),
    )
    assert not judge(sign(sub, WORKER), newer, engine, counter_seen=False).accepted


def test_a_genesis_naming_an_unknown_sampler_is_refused_in_one_line(
    genesis: RunGenesis, tmp_path: Path
) -> None:
    path = tmp_path / "future.genesis"
    path.write_bytes(resigned(genesis, {**genesis.params.to_wire(), "sampler": "gumbel-9"}))
    with pytest.raises(ConfigError) as err:
        load_genesis(path)
    message = str(err.value)
    assert "\n" not in message
    assert "sampler 'gumbel-9'" in message and "upgrade swarm-node" in message
    assert "changed after signing" not in message
