"""One rank of a trainer larger than one device: GRPO on a torch.distributed group (FSDP2).

``join --role trainer --nproc N``: the training child (``node.compute.train_child``) is rank 0
and drives the group through :class:`node.compute.ranks.RankGroup`; ranks 1..N-1 run
``python -m node.compute.fsdp`` (:func:`main`), each reading the same calls as frames on its
stdin. Decisions this module owns:

- **Sharding**: ``torch.distributed.fsdp.fully_shard`` (FSDP2) on every decoder layer and on the
  root module, over a one-dimensional device mesh of all ranks; ``gloo`` on the CPU (how the
  tests run it), ``nccl`` on CUDA (rank r uses ``cuda:(first + r)``, one device per rank). The
  optimizer's state and the held versions' weights (``logp_old``) are sharded the same way:
  each rank holds 1/N of them. The old-policy model is a second sharded copy, deep-copied
  before sharding (FSDP2 refuses to copy a sharded module).
- **Data**: rank 0 splits the groups that carry signal round-robin
  (``node.compute.ranks.split``); a rank left without one gets a group of two empty
  completions (no token counts, zero gradient), because every rank must run each forward and
  backward pass: they are collectives. For the same reason every rank replays the same list of
  older versions (``_versions_to_replay``). FSDP averages gradients over ranks, so each rank
  normalises its loss by the kept samples of *all* ranks and scales it by the world size: the
  group's update equals one process's update on the whole batch. Per-token statistics (loss,
  tokens, clipping, entropy) are summed over ranks.
- **Averaging between trainers** (hivemind, ``node.compute.averaging``): rank 0 gathers the
  *full* gradient (``DTensor.full_tensor``, one parameter at a time into host memory), averages
  it with the other trainers exactly as a one-process trainer would, and scatters the result
  back (``distribute_tensor`` from rank 0). Averaging the shards instead would need one
  hivemind averager per rank and every trainer of the group sharded alike; the full gradient
  lets trainers with different ``--nproc`` average together, at the cost of one gather and one
  scatter of the gradient per round. A failed round fails on every rank (rank 0 broadcasts the
  outcome first): nothing changes anywhere.
- **State out and in**: rank 0 gathers full tensors for each version's safetensors and for the
  checkpoint, which has the one-process trainer's layout (so ``--nproc`` may change between
  restarts); every rank reads a checkpoint itself (memory-mapped) and keeps its slice. Weights
  adopted from another trainer (``load_version``) are scattered from rank 0.

Limits: the ranks run on one host. Each rank loads the full model on the CPU, twice (the policy
and the old-policy copy), before sharding: host memory for 2N copies during start-up;
``fully_shard`` then moves 1/N of each to the rank's device. nccl is written but has not run
(no multi-GPU machine here).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from node.compute.child import PARENT_ENV, read_frame, write_frame
from node.compute.groups import Group, RoundFailed, StepStats
from node.compute.grpo import GradientAverager, GRPOConfig, GRPOTrainer
from swarm.errors import EngineError

COLLECTIVE_TIMEOUT_S = 600.0
"""A rank that waits this long in a collective (or for the others to start) gives up. Ranks
meet only inside a call from rank 0, and an averaging round ends within seconds."""


def device_of(spec: dict[str, Any], rank: int) -> str:
    device = str(spec.get("device") or "cpu")
    if not device.startswith("cuda"):
        return "cpu"
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


def _gather(obj: Any) -> Any:
    """Full CPU copies of every tensor in ``obj`` (a collective: every rank walks the same
    structure in the same order). Plain tensors and other values are copied as they are."""
    if isinstance(obj, DTensor):
        if obj.device.type != obj.device_mesh.device_type:  # a held version kept on the CPU
            obj = obj.to(obj.device_mesh.device_type)
        return obj.full_tensor().detach().to("cpu").contiguous()
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _gather(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_gather(v) for v in obj)
    return obj


def _slice_like(full: Any, like: Any) -> Any:
    """This rank's slice of ``full`` (present on every rank), placed as ``like``; no messages."""
    return distribute_tensor(
        full.to(like.device_mesh.device_type), like.device_mesh, like.placements, src_data_rank=None
    )


def build(spec: dict[str, Any], rank: int, world: int, store: Any) -> ShardedGRPOTrainer:
    """Join the process group (``store``: rank 0's TCPStore) and shard the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from node.model import load_causal_lm

    device = device_of(spec, rank)
    if device != "cpu":
        torch.cuda.set_device(device)
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if device == "cpu":  # the ranks share one host: gloo over loopback, whatever the hostname
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo" if device == "cpu" else "nccl",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    mesh = init_device_mesh("cpu" if device == "cpu" else "cuda", (world,))
    model = load_causal_lm(Path(spec["model_dir"]), dtype="float32", device="cpu")
    models = [model, copy.deepcopy(model)]  # the policy, and the old policy for logp_old
    for m in models:
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return ShardedGRPOTrainer(
        models[0],
        models[1],
        GRPOConfig(**spec["config"]),
        keep_versions=int(spec["keep_versions"]),
        pad_id=int(spec["pad_id"]),
        rank=rank,
        world=world,
        device=device,
    )


class ShardedGRPOTrainer(GRPOTrainer):
    """One rank's :class:`GRPOTrainer` over a sharded model. The calls that move tensors
    between ranks (``step``, ``weights``, ``load_version``, ``save_checkpoint``) must be made
    on every rank in the same order; rank 0's :class:`~node.compute.ranks.RankGroup` sees to
    that."""

    def __init__(
        self,
        model: Any,
        old_model: Any,
        config: GRPOConfig,
        *,
        keep_versions: int,
        pad_id: int,
        rank: int,
        world: int,
        device: str,
    ) -> None:
        super().__init__(model, config, keep_versions=keep_versions, pad_id=pad_id)
        self._old_model = old_model.eval()
        self.rank, self.world, self.device = rank, world, device
        self._replay: list[int] = []

    def _versions_to_replay(self, versions: set[int]) -> list[int]:
        return [v for v in self._replay if v != self.version]

    def step_part(
        self,
        part: list[Group],
        samples: int,
        replay: list[int],
        average: GradientAverager | None,
        averaging: bool,
    ) -> tuple[StepStats, list[float]]:
        """This rank's share of one step. ``samples``: kept samples of all ranks; ``replay``:
        older versions in the whole batch; ``average`` (rank 0) averages the full gradient with
        the other trainers when ``averaging``. Returns the rank's stats and the per-token sums
        of all ranks: [loss, tokens, clipped tokens, entropy]."""
        self._replay = sorted(replay)

        def share(grads: list[torch.Tensor], _local: int) -> int:
            return self._average_full(grads, samples, average)

        stats = self.step(
            part, share if averaging else None, norm_samples=samples or None, grad_scale=self.world
        )
        tokens = max(stats.tokens, 1)
        sums = torch.tensor(
            [stats.loss, stats.tokens, stats.clip_fraction * tokens, stats.entropy * tokens],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(sums)
        return stats, [float(x) for x in sums]

    def _average_full(
        self, grads: list[torch.Tensor], samples: int, average: GradientAverager | None
    ) -> int:
        fulls = []
        for g in grads:  # one parameter at a time: a full copy of one layer on the device
            full = g.full_tensor() if isinstance(g, DTensor) else g
            if self.rank == 0:
                fulls.append(full.detach().to("cpu", copy=True))
        outcome = torch.zeros(2, dtype=torch.int64, device=self.device)  # [ok, group samples]
        error: BaseException | None = None
        if self.rank == 0:
            try:
                if average is None:
                    raise EngineError("rank 0 of a trainer group was given no averager")
                outcome[:] = torch.tensor([1, average(fulls, samples)])
            except Exception as exc:  # every rank must hear the outcome before anything else
                error = exc
        dist.broadcast(outcome, src=0)
        if not int(outcome[0]):
            if error is not None:
                raise error
            raise RoundFailed("the averaging round failed on rank 0")
        with torch.no_grad():
            for i, g in enumerate(grads):
                assert isinstance(g, DTensor)  # every parameter is sharded (fully_shard)
                if self.rank == 0:
                    src = fulls[i].to(self.device)
                else:
                    src = torch.empty(g.shape, dtype=g.dtype, device=self.device)
                g.copy_(distribute_tensor(src, g.device_mesh, g.placements))
        return int(outcome[1])

    def weights(self) -> dict[str, torch.Tensor]:
        """The current policy's full weights on rank 0 (empty elsewhere); a collective."""
        full: dict[str, torch.Tensor] = _gather(self.model.state_dict())
        return full if self.rank == 0 else {}

    def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """``weights``: the full state on rank 0 (ignored elsewhere), scattered to every rank."""
        sharded: dict[str, torch.Tensor] = {}
        for name, like in self.model.state_dict().items():
            if self.rank == 0:
                src = weights[name].to(device=self.device, dtype=like.dtype)
            else:
                src = torch.empty(like.shape, dtype=like.dtype, device=self.device)
            sharded[name] = distribute_tensor(src, like.device_mesh, like.placements)
        self._restore(version, sharded)

    def save_checkpoint(self, path: Path) -> None:
        """The one-process trainer's layout, gathered and written by rank 0."""
        state = {
            "version": self.version,
            "model": _gather(self.model.state_dict()),
            "optimizer": _gather(self.optimizer.state_dict()),
            "snapshots": {v: _gather(self._snapshots[v]) for v in sorted(self._snapshots)},
        }
        if self.rank == 0:
            self._save(path, state)

    def load_checkpoint(self, path: Path) -> None:
        """Every rank maps the file and keeps its slice (no messages between ranks)."""
        state = self._read(path, mmap=True)
        like = self.model.state_dict()
        self.model.load_state_dict({k: _slice_like(v, like[k]) for k, v in state["model"].items()})
        params = list(self.model.parameters())
        saved = state["optimizer"]
        per_param = {}
        for i, values in saved["state"].items():
            p = params[int(i)]
            per_param[i] = {
                k: _slice_like(v, p) if torch.is_tensor(v) and v.shape == p.shape else v
                for k, v in values.items()
            }
        self.optimizer.load_state_dict({"state": per_param, "param_groups": saved["param_groups"]})
        self.version = int(state["version"])
        self._snapshots = {
            int(v): {k: _slice_like(t, like[k]).to("cpu", copy=True) for k, t in held.items()}
            for v, held in state["snapshots"].items()
        }


# -- ranks 1..N-1 ----------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGKILL this rank when the training child that started it dies (it was started from
    that child's main thread, which lives as long as the child), and exit now if it already
    did. The child's process group and the end of stdin are the other two ways out."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def serve(trainer: ShardedGRPOTrainer, op: str, args: dict[str, Any]) -> Any:
    """One call mirrored from rank 0 (see ``RankGroup``)."""
    if op == "step":
        trainer.step_part(
            [Group.from_wire(g) for g in args["groups"]],
            int(args["samples"]),
            [int(v) for v in args["replay"]],
            None,
            bool(args["averaging"]),
        )
        return None
    if op == "weights":
        trainer.weights()
        return None
    if op == "load_version":
        trainer.load_version(int(args["version"]), {})
        return None
    if op == "undo":
        trainer.undo(int(args["version"]))
        return None
    if op == "relabel":
        trainer.relabel(int(args["version"]))
        return None
    if op == "rollback":
        return trainer.rollback(int(args["version"]))
    if op == "save_checkpoint":
        trainer.save_checkpoint(Path(args["path"]))
        return None
    if op == "load_checkpoint":
        trainer.load_checkpoint(Path(args["path"]))
        return None
    raise EngineError(f"unknown rank request {op!r}")


def main() -> None:
    """A worker rank: ``init`` {spec, rank, world, port} first, then mirrored calls until
    stdin ends. A call that fails (other than an averaging round, which fails on every rank)
    ends the rank: the group cannot go on without it, and rank 0 then reports the error."""
    _die_with_parent(int(os.environ[PARENT_ENV]))
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s rank %(name)s %(message)s"
    )
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the channel
    init = read_frame(stdin)
    if init is None or init.get("op") != "init":
        raise SystemExit("a trainer rank must be started by its training child")
    args = init["args"]
    write_frame(stdout, {"ok": True, "result": "joining"})  # torch loaded: about to meet rank 0
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", int(args["port"]), int(args["world"]), is_master=False
    )
    trainer = build(args["spec"], int(args["rank"]), int(args["world"]), store)
    write_frame(stdout, {"ok": True, "result": None})
    try:
        while (request := read_frame(stdin)) is not None:
            try:
                result = serve(trainer, request["op"], request.get("args") or {})
                write_frame(stdout, {"ok": True, "result": result})
            except RoundFailed as exc:
                write_frame(stdout, {"ok": True, "result": None, "failed": str(exc)})
            except Exception as exc:
                write_frame(stdout, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                raise
    except BaseException:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        raise
    # stdin ended: rank 0 is closing the group. Leave now (no destroy_process_group: that
    # waits on rank 0, which is waiting for this rank to exit).
    os._exit(0)


if __name__ == "__main__":
    main()
