"""Rank 0 of a trainer larger than one device: the training child's side of the FSDP2 group.

:class:`RankGroup` stands where a :class:`~node.compute.grpo.GRPOTrainer` stands in
``node.compute.train_child`` (same calls), for ``--nproc N`` > 1. Decisions this module owns:

- **Start**: the ranks are started first thing (:func:`start_ranks`, before this process
  imports torch, so both load it at once). Rank 0 then opens the group's ``TCPStore`` on
  127.0.0.1 at a port the kernel picks and hands it to ranks 1..N-1 in their ``init`` frame (no
  port is guessed, so none is raced for). The ranks are ``python -m node.compute.fsdp``
  children of the training child, in its process group.
- **Calls**: each call is sent to every worker rank first (a msgpack frame on its stdin: its
  share of the batch, never pickle), then run here, then every rank's reply is read; the ranks
  meet in the collectives inside the call. Rank 0 splits the batch
  (:func:`node.compute.fsdp.split`) and reports the step's statistics for the whole batch.
- **Failure**: an averaging round that fails (``RoundFailed``) fails on every rank and changes
  nothing; any other failure, or a rank that dies, stops the whole group (:class:`EngineError`,
  and every later call says so): a group missing a rank cannot take another collective step.
- **Death**: ``close`` ends the ranks' stdin, waits briefly, then kills them. The ranks also die
  with the training child (``PR_SET_PDEATHSIG``, the child's process group, end of stdin), so a
  kill -9 of the node leaves no rank behind.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.compute.child import _ROOT, PARENT_ENV, read_frame, write_frame
from node.compute.groups import Group, RoundFailed, StepStats
from swarm.errors import EngineError

if TYPE_CHECKING:
    from node.compute.fsdp import ShardedGRPOTrainer
    from node.compute.grpo import GradientAverager

CLOSE_WAIT_S = 5.0
DEATH_WAIT_S = 1.0
"""The training child's pid, given to each worker rank: it exits when that process is gone."""


def has_signal(group: Group) -> bool:
    return len(group.rewards) > 1 and max(group.rewards) != min(group.rewards)


def split(groups: list[Group], world: int, version: int) -> list[list[Group]]:
    """Each rank's share of the groups with signal (round-robin); when some rank would get
    none but others have some, it gets an empty group of this version, which trains nothing."""
    kept = [g for g in groups if has_signal(g)]
    parts = [kept[r::world] for r in range(world)]
    if kept:
        empty = Group(kept[0].prompt, [[], []], [0.0, 1.0], version)
        parts = [p or [empty] for p in parts]
    return parts


def start_ranks(nproc: int) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..N-1, started first thing so that they load torch while this process does;
    each waits for its ``init`` frame from :class:`RankGroup`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env[PARENT_ENV] = str(os.getpid())
    return [
        subprocess.Popen(
            [sys.executable, "-m", "node.compute.fsdp"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        for _ in range(1, nproc)
    ]


class RankGroup:
    """Ranks 0..N-1 of one trainer; this process is rank 0, ``ranks`` the others."""

    def __init__(self, spec: dict[str, Any], ranks: list[subprocess.Popen[bytes]]) -> None:
        self.ranks = ranks
        self.world = nproc = len(ranks) + 1
        self.broken: str | None = None
        import torch.distributed as dist  # here: start_ranks runs before this process has torch

        from node.compute.fsdp import build

        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False
            )
            port = store.port
            self._send(
                "init",
                [{"spec": spec, "rank": r, "world": nproc, "port": port} for r in range(1, nproc)],
            )
            # Every rank answers before it joins the group: one that failed to start is named
            # here, instead of rank 0 waiting for it in the rendezvous.
            self._replies("start")
            self.local: ShardedGRPOTrainer = build(spec, 0, nproc, store)
            self._replies("init")
        except BaseException:
            self.close()
            raise

    @property
    def version(self) -> int:
        return self.local.version

    # -- mirrored calls --------------------------------------------------------------------------

    def _send(self, op: str, args: list[dict[str, Any]]) -> None:
        if self.broken is not None:
            raise EngineError(f"the trainer's rank group stopped ({self.broken}); restart the node")
        try:
            for proc, mine in zip(self.ranks, args, strict=True):
                assert proc.stdin is not None
                write_frame(proc.stdin, {"op": op, "args": mine})
        except (BrokenPipeError, OSError) as exc:
            raise self._stop(f"a rank is gone ({exc})") from exc

    def _replies(self, op: str) -> list[Any]:
        out = []
        for rank, proc in enumerate(self.ranks, start=1):
            assert proc.stdout is not None
            try:
                reply = read_frame(proc.stdout)
            except EngineError as exc:
                raise self._stop(f"rank {rank}: {exc}") from exc
            if reply is None:
                raise self._stop(f"rank {rank} exited during {op!r} (code {proc.poll()})")
            if not reply.get("ok"):
                raise self._stop(f"rank {rank} failed {op!r}: {reply.get('error')}")
            out.append(reply.get("result"))
        return out

    def _dead(self) -> list[str]:
        codes = [(r, p.poll()) for r, p in enumerate(self.ranks, 1)]
        return [f"rank {r} exited ({code})" for r, code in codes if code is not None]

    def _stop(self, why: str) -> EngineError:
        """Stop the group; the error names the ranks that died (a dying rank's sockets close a
        moment before it can be reaped, so wait that moment), else ``why``."""
        deadline = time.monotonic() + DEATH_WAIT_S
        while not (dead := self._dead()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.broken = why = "; ".join(dead) or why.splitlines()[0]
        self.close()
        return EngineError(f"the trainer's rank group stopped: {why}")

    def _mirror(self, op: str, args: dict[str, Any], local: Any) -> Any:
        """Send ``op`` to every worker rank, run ``local()`` here, then read their replies."""
        self._send(op, [args] * len(self.ranks))
        return self._run(op, local)

    def _run(self, op: str, local: Any) -> Any:
        try:
            result = local()
        except RoundFailed:
            self._replies(op)
            raise
        except Exception as exc:
            raise self._stop(f"rank 0 failed {op!r}: {type(exc).__name__}: {exc}") from exc
        self._replies(op)
        return result

    def step(self, groups: list[Group], average: GradientAverager | None = None) -> StepStats:
        version = self.local.version
        parts = split(groups, self.world, version)
        kept = [g for g in groups if has_signal(g)]
        samples = sum(len(g.completions) for g in kept)
        replay = sorted({g.version for g in kept} - {version})
        common = {"samples": samples, "replay": replay, "averaging": average is not None}
        self._send("step", [{"groups": [g.to_wire() for g in p], **common} for p in parts[1:]])
        stats, sums = self._run(
            "step",
            lambda: self.local.step_part(parts[0], samples, replay, average, average is not None),
        )
        loss, tokens, clipped, entropy = sums
        rewards = [r for g in groups for r in g.rewards]
        return StepStats(
            version=stats.version,
            sampled_by=max((g.version for g in groups), default=version),
            mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
            kept_groups=len(kept),
            total_groups=len(groups),
            samples=samples,
            tokens=int(tokens),
            loss=loss,
            grad_norm=stats.grad_norm,
            clip_fraction=clipped / max(tokens, 1.0),
            entropy=entropy / max(tokens, 1.0),
        )

    def weights(self) -> dict[str, Any]:
        return dict(self._mirror("weights", {}, self.local.weights))

    def load_version(self, version: int, weights: dict[str, Any]) -> None:
        names = set(self.local.model.state_dict())
        if set(weights) != names:  # checked here, before any rank waits in a collective
            missing, extra = sorted(names - set(weights)), sorted(set(weights) - names)
            raise EngineError(f"weights of v{version} do not fit the model: {missing=} {extra=}")
        self._mirror(
            "load_version", {"version": version}, lambda: self.local.load_version(version, weights)
        )

    def undo(self, version: int) -> None:
        self._mirror("undo", {"version": version}, lambda: self.local.undo(version))

    def relabel(self, version: int) -> None:
        self._mirror("relabel", {"version": version}, lambda: self.local.relabel(version))

    def rollback(self, version: int) -> int:
        return int(
            self._mirror("rollback", {"version": version}, lambda: self.local.rollback(version))
        )

    def save_checkpoint(self, path: Path) -> None:
        self._mirror(
            "save_checkpoint", {"path": str(path)}, lambda: self.local.save_checkpoint(path)
        )

    def load_checkpoint(self, path: Path) -> None:
        self._mirror(
            "load_checkpoint", {"path": str(path)}, lambda: self.local.load_checkpoint(path)
        )

    def close(self) -> None:
        """End the worker ranks (stdin first, then SIGKILL after ``CLOSE_WAIT_S``)."""
        for proc in self.ranks:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
        for proc in self.ranks:
            try:
                proc.wait(timeout=CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                if dist.is_initialized():
                    dist.destroy_process_group()
