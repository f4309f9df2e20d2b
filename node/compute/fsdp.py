"""A GRPO step on a torch.distributed group (FSDP2), for a trainer larger than one device.

    python -m node.compute.fsdp SPEC.msgpack     # one process per rank: RANK, WORLD_SIZE,
                                                 # MASTER_ADDR, MASTER_PORT in the environment

Decisions this module owns:

- **Sharding**: ``torch.distributed.fsdp.fully_shard`` (FSDP2) on every decoder layer and on the
  root module, over a one-dimensional device mesh of all ranks; ``gloo`` on the CPU (how the
  tests run it), ``nccl`` on CUDA devices (rank r uses ``cuda:r`` of the host).
- **Data**: rank r trains on groups ``r, r + world, ...`` of the batch. FSDP averages gradients
  over ranks, so each rank normalises its loss by the kept samples of *all* ranks and scales it
  by the world size (``GRPOTrainer.step(norm_samples=, grad_scale=)``): the group's update equals
  one process's update on the whole batch, whatever the split.
- **Output**: rank 0 gathers the full weights (``DTensor.full_tensor``) and writes them as
  safetensors; the spec (msgpack, no pickle) names the model, the GRPO config and the groups.

Limits: every rank must run forward and backward (the collectives are in them), so a batch must
give every rank at least one group with signal; the caller checks that. Wiring this into
``join --role trainer --nproc N`` (the training child as rank 0 of the group) is not done yet.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import msgpack

from node.compute.groups import Group


def has_signal(group: Group) -> bool:
    return len(group.rewards) > 1 and max(group.rewards) != min(group.rewards)


def rank_step(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from node.compute.grpo import GRPOConfig, GRPOTrainer
    from node.model import load_causal_lm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and spec.get("device", "cpu") == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(int(spec.get("threads") or 1))
        device = f"cuda:{rank}" if cuda else "cpu"
        model = load_causal_lm(Path(spec["model_dir"]), dtype="float32").to(device)
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        trainer = GRPOTrainer(
            model, GRPOConfig(**spec["config"]), keep_versions=1, pad_id=int(spec["pad_id"])
        )
        groups = [Group.from_wire(g) for g in spec["groups"]][rank::world]
        kept = torch.tensor([sum(len(g.completions) for g in groups if has_signal(g))])
        dist.all_reduce(kept)
        trainer.step(groups, norm_samples=int(kept), grad_scale=float(world))
        full = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().contiguous()
            for k, v in model.state_dict().items()
        }
        if rank == 0:
            save_file(full, spec["out"])
    finally:
        dist.destroy_process_group()


def main() -> None:
    spec = msgpack.unpackb(Path(sys.argv[1]).read_bytes(), raw=False)
    rank_step(spec)


if __name__ == "__main__":
    main()
