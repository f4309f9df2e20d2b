from __future__ import annotations

from pathlib import Path

from node.compute.groups import Group
from node.roles.sample_queue import SampleQueue


def groups(version: int) -> list[Group]:
    return [Group([1, 2], [[3], [4, 5]], [1.0, 0.0], version)]


def test_each_submission_is_queued_once(tmp_path: Path) -> None:
    q = SampleQueue(tmp_path / "q.db")
    assert q.put(b"a", 0, groups(0)) and not q.put(b"a", 0, groups(0))
    assert q.pending() == 1


def test_take_reserves_oldest_inside_the_window(tmp_path: Path) -> None:
    q = SampleQueue(tmp_path / "q.db")
    for i, v in enumerate([0, 1, 2, 2]):
        q.put(bytes([i]), v, groups(v))
    batch = q.take(step=2, max_submissions=2, min_version=1)
    assert [sid for sid, _ in batch] == [b"\x01", b"\x02"]
    assert batch[0][1] == groups(1)
    assert q.pending(min_version=1) == 1  # the version-0 one is outside the window


def test_a_crash_before_the_checkpoint_releases_the_batch(tmp_path: Path) -> None:
    q = SampleQueue(tmp_path / "q.db")
    q.put(b"a", 0, groups(0))
    q.take(step=0, max_submissions=8, min_version=0)
    q.close()
    q = SampleQueue(tmp_path / "q.db")  # restarted; checkpoint still at version 0
    assert q.recover(checkpoint_version=0) == 1
    assert [sid for sid, _ in q.take(step=0, max_submissions=8, min_version=0)] == [b"a"]


def test_a_crash_after_the_checkpoint_keeps_the_batch_used(tmp_path: Path) -> None:
    q = SampleQueue(tmp_path / "q.db")
    q.put(b"a", 0, groups(0))
    q.take(step=0, max_submissions=8, min_version=0)
    q.close()
    q = SampleQueue(tmp_path / "q.db")  # the checkpoint of version 1 was written
    assert q.recover(checkpoint_version=1) == 0
    assert q.take(step=1, max_submissions=8, min_version=0) == []
    assert q.used_by(0) == [b"a"]


def test_prune_drops_versions_outside_the_window_but_not_an_unfinished_step(
    tmp_path: Path,
) -> None:
    q = SampleQueue(tmp_path / "q.db")
    for i, v in enumerate([0, 0, 1, 3]):
        q.put(bytes([i]), v, groups(v))
    q.take(step=3, max_submissions=1, min_version=0)  # b"\x00" reserved by step 3
    assert q.prune(min_version=2, checkpoint_version=3) == 2  # b"\x01" and b"\x02"
    assert q.used_by(3) == [b"\x00"]  # the step the checkpoint does not cover keeps its rows
    assert q.prune(min_version=2, checkpoint_version=4) == 1
    assert q.pending() == 1 and not q.put(b"\x03", 3, groups(3))  # the window's rows stay


def test_a_group_trainer_keeps_settled_rounds_and_releases_the_rest(tmp_path: Path) -> None:
    q = SampleQueue(tmp_path / "q.db")
    for i in range(3):
        q.put(bytes([i]), 0, groups(0))
    q.take(step=0, max_submissions=1, min_version=0)
    q.take(step=1, max_submissions=1, min_version=0)
    q.settle(0)  # round 0 went into a published version
    q.close()
    q = SampleQueue(tmp_path / "q.db")  # a restart
    assert q.unsettled_steps() == [1]
    assert q.release(1) == 1
    assert q.pending() == 2 and q.used_by(0) == [b"\x00"]
