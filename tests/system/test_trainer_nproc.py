"""A trainer joined with ``--nproc 2`` (two gloo ranks) in a real swarm of processes: it
publishes versions that the workers generate with and the validator accepts; a kill -9 of the
trainer node leaves neither its training child nor its second rank behind; restarted, it
trains on from its checkpoint, and Ctrl-C stops it whole."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from node.up import DEMO_PARAMS, LocalSwarm, UpConfig
from swarm.ledger import LedgerStore
from swarm.messages import Verdict, decode
from tests.netfactory import wait_until

PARAMS = replace(DEMO_PARAMS, group_size=4, batch_prompts=4, max_tokens=8)


def compute_of(node_pid: int) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """The node's training child(ren) and their rank processes."""
    below = psutil.Process(node_pid).children(recursive=True)
    named = [(p, " ".join(p.cmdline())) for p in below]
    return (
        [p for p, cmd in named if "node.compute.train_child" in cmd],
        [p for p, cmd in named if "node.compute.fsdp" in cmd],
    )


def accepted_versions(ledger_path: Path) -> set[int]:
    store = LedgerStore.open_existing(ledger_path)
    try:
        verdicts = (decode(raw, Verdict).message for raw in store.raw_verdicts())
        return {v.policy_version for v in verdicts if v.accepted}
    finally:
        store.close()


@pytest.mark.slow
async def test_a_two_rank_trainer_publishes_accepted_versions_and_dies_whole(
    tmp_path: Path,
) -> None:
    swarm = LocalSwarm(
        UpConfig(
            out=tmp_path / "up",
            workers=1,
            with_cheater=False,
            params=PARAMS,
            versions=1000,
            minutes=10,
            http=None,
            trainer_args=("--nproc", "2"),
        )
    )
    swarm.prepare()
    await swarm.start()
    try:

        async def version_at_least(v: int) -> bool:
            await swarm.poll()
            return swarm.version() >= v

        await wait_until(lambda: version_at_least(2), 240, poll=0.5)
        # Work made with a version this trainer published was judged and accepted (a worker may
        # skip a version that was already superseded when it fetched, so not necessarily each).
        await wait_until(
            lambda: max(accepted_versions(swarm.validator_ledger()), default=0) >= 1, 120, poll=0.5
        )
        node = swarm.proc("trainer").popen
        assert node is not None
        children, ranks = compute_of(node.pid)
        assert len(children) == 1 and len(ranks) == 1
        assert ranks[0].ppid() == children[0].pid
        before = swarm.version()
        swarm.kill("trainer")
        _, alive = psutil.wait_procs([*children, *ranks], timeout=15)
        assert not alive, f"left behind after kill -9 of the node: {alive}"

        # Restarted, it resumes from its checkpoint on two ranks and trains on; Ctrl-C (SIGINT)
        # then stops the node with its child and ranks.
        swarm.respawn("trainer")
        node = swarm.proc("trainer").popen
        assert node is not None
        pid = node.pid

        def two_ranks_up() -> tuple[list[psutil.Process], list[psutil.Process]] | None:
            with contextlib.suppress(psutil.Error):
                children, ranks = compute_of(pid)
                return (children, ranks) if len(children) == 1 and len(ranks) == 1 else None
            return None

        children, ranks = await wait_until(two_ranks_up, 120, poll=0.5)
        await wait_until(lambda: version_at_least(before + 1), 180, poll=0.5)
    finally:
        swarm.stop()
    _, alive = psutil.wait_procs([*children, *ranks], timeout=15)
    assert not alive, f"left behind after Ctrl-C of the node: {alive}"
