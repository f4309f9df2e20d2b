"""Every decoder under random and mutated inputs raises only typed errors (``SwarmError``),
and never hangs. 200 cases per target in CI; ``bench/fuzz.py`` runs 10,000."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz.targets import Tally, Target, check, decoder_targets

CI_CASES = 200
CI_HANG_S = 10.0  # a shared CI machine stalls for seconds; a loop never ends
TARGETS = decoder_targets()


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_decoder_raises_only_typed_errors_on_fuzzed_input(target: Target) -> None:
    tally = Tally()

    @settings(
        max_examples=CI_CASES,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=target.inputs())
    def case(data: bytes) -> None:
        outcome = check(target, data, tally, hang_s=CI_HANG_S)
        assert outcome != "untyped", tally.examples[-1]
        assert outcome != "hang", f"{target.name} took over {CI_HANG_S} s on {data[:80]!r}"

    case()
    assert tally.cases >= CI_CASES // 2
