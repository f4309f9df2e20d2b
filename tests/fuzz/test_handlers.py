"""The stream handlers of running nodes (submit on a validator; samples, policy, ledger-sync,
manifest, shard and run-files on a trainer) and the admin socket, fed random and mutated
requests through real libp2p streams: every handler fails only with typed errors, and afterwards
every protocol still serves an honest peer correctly."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz.live import LiveSwarm
from tests.fuzz.targets import Tally, Target, check

CI_CASES = 200
NAMES = [
    "stream.submit",
    "stream.samples",
    "stream.policy",
    "stream.ledger-sync",
    "stream.manifest",
    "stream.shard",
    "stream.run-files",
    "admin.request_line",
]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSwarm]:
    with LiveSwarm(tmp_path_factory.mktemp("fuzz-swarm")) as live:
        yield live


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_handler_fails_only_typed_and_keeps_serving_honest_peers(
    swarm: LiveSwarm, name: str
) -> None:
    target: Target = next(t for t in swarm.targets() if t.name == name)
    tally = Tally()

    @settings(
        max_examples=CI_CASES, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(data=target.inputs())
    def case(data: bytes) -> None:
        outcome = check(target, data, tally)
        assert outcome != "untyped", tally.examples[-1]

    case()
    assert tally.cases >= CI_CASES // 2
    swarm.call(swarm.honest_round)
