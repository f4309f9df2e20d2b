"""The audit replays only on the weights the trainer signed: every tensor is checked against the
version's manifest before a replay uses the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from node.audit_weights import checked_source, store_manifests
from swarm.errors import ValidationError
from swarm.shardcast import ShardStore, publish
from tests.shardcast_util import TRAINER, genesis


def test_a_policy_file_that_is_not_the_signed_version_fails_the_replay(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    weights = {"a": np.arange(64, dtype=np.float32), "b": np.ones(8, dtype=np.uint16)}
    for v in (1, 2):
        save_file(weights, str(policies / f"v{v}.safetensors"))
        publish(
            policies / f"v{v}.safetensors",
            key=TRAINER,
            genesis=genesis(),
            version=v,
            store=ShardStore(tmp_path / "shards"),
        )
    save_file({**weights, "a": weights["a"] + 1}, str(policies / "v2.safetensors"))

    def source(v: int) -> Path | None:
        path = policies / f"v{v}.safetensors"
        return path if path.exists() else None

    check = checked_source(source, store_manifests(tmp_path / "shards"))
    assert check(1) == policies / "v1.safetensors"
    with pytest.raises(ValidationError, match=r"policy v2 .* tensor 'a' differs"):
        check(2)
    assert check(3) is None
    # No manifest known (an old trainer folder): used as before.
    assert checked_source(source, store_manifests(tmp_path / "none"))(2) is not None
