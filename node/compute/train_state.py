"""A trainer's training state as something others can check: its commitment, its file, and the
replay of one step from it (imported by the training and replay children only: it needs torch).

Decisions this module owns:

- **What the state is.** The float32 master weights (``w/<name>``, the model's ``state_dict``
  less tied copies, which are stored once) and AdamW's per-parameter state: ``m/<name>``
  (``exp_avg``), ``v/<name>`` (``exp_avg_sq``) and ``s/<name>`` (its step count), named by the
  model's parameter names. Parameters the optimizer never stepped have no ``m/v/s`` entries.
  The versions a step's ``logp_old`` replays are not part of it: they are published versions,
  which every auditor fetches by SHARDCAST (``GRPOTrainer`` rounds its own copies through the
  serving dtype, which gives the published tensors bit for bit).
- **The commitment** (``digest``): sha256 over the tensors in name order, each as its name, its
  dtype, its shape and its raw little-endian bytes, so it does not depend on how a file lays them
  out. The same function commits to a version's served weights (``TrainingRecord.weights``).
- **The file**: one safetensors file per version (``states/s<version>.safetensors``), written
  atomically; safetensors because it is what the project moves weights in and it holds no code.
- **Deterministic mode** (``deterministic``): ``torch.use_deterministic_algorithms(True)``, a
  fixed thread count recorded in the step's record, and a seed for anything random in the
  forward pass (dropout), set before each step. On the CPU the same inputs then give the same
  bits in another process on the same kind of machine (tests/unit/test_train_replay.py; the cost
  is in docs/BENCHMARKS.md, "Training audit").
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from swarm.errors import StorageError

STATE_FORMAT = "swarm-node/train-state/1"


def deterministic(threads: int, seed: int) -> None:
    """The deterministic mode (module docstring): call before each step and each replay."""
    torch.use_deterministic_algorithms(True)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)


def digest(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The commitment to ``tensors`` (module docstring)."""
    h = hashlib.sha256(STATE_FORMAT.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(struct.pack(">I", len(name)) + name.encode())
        h.update(str(t.dtype).encode() + b"|" + ",".join(map(str, t.shape)).encode() + b"|")
        # Bytes through an untyped view: numpy has no bfloat16.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def state_of(
    model: Any, optimizer: torch.optim.Optimizer, tied: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """The training state of ``model`` and its AdamW ``optimizer`` (CPU tensors, not copies
    where they already live on the CPU)."""
    out = {f"w/{k}": v.detach().to("cpu") for k, v in model.state_dict().items() if k not in tied}
    names = _param_names(model)
    for param in optimizer.param_groups[0]["params"]:
        state = optimizer.state.get(param)
        if not state:
            continue
        name = names[id(param)]
        out[f"m/{name}"] = state["exp_avg"].detach().to("cpu")
        out[f"v/{name}"] = state["exp_avg_sq"].detach().to("cpu")
        step = state["step"]
        out[f"s/{name}"] = (step if torch.is_tensor(step) else torch.tensor(float(step))).to("cpu")
    return out


def load_state(
    model: Any,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, torch.Tensor],
    tied: Mapping[str, str],
) -> None:
    """Put ``state`` (``state_of``'s form) into ``model`` and ``optimizer``."""
    weights = {k[2:]: v for k, v in state.items() if k.startswith("w/")}
    for copy, stored in tied.items():
        if stored in weights:
            weights[copy] = weights[stored]
    model.load_state_dict(weights)
    names = _param_names(model)
    params = optimizer.param_groups[0]["params"]
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for index, param in enumerate(params):
        name = names[id(param)]
        if f"m/{name}" in state:
            opt_state[index] = {
                "step": state[f"s/{name}"].clone(),
                "exp_avg": state[f"m/{name}"].clone(),
                "exp_avg_sq": state[f"v/{name}"].clone(),
            }
    sd = optimizer.state_dict()
    optimizer.load_state_dict({"state": opt_state, "param_groups": sd["param_groups"]})


def _param_names(model: Any) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in model.named_parameters():  # tied copies: the first (stored) name
        names.setdefault(id(param), name)
    return names


def gradient_of(model: Any, grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gradient (one tensor per parameter, ``model.parameters()`` order) by parameter name,
    ``g/<name>``: the form a group member commits to and serves (``node.roles.training_audit``)."""
    names = _param_names(model)
    return {
        f"g/{names[id(p)]}": g.detach().to("cpu")
        for p, g in zip(model.parameters(), grads, strict=True)
    }


def write_state(path: Path, state: Mapping[str, torch.Tensor], version: int) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            str(tmp),
            metadata={"format": STATE_FORMAT, "version": str(version)},
        )
        tmp.replace(path)
    except OSError as exc:
        raise StorageError(f"cannot write training state {path}: {exc.strerror}") from exc


def read_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise StorageError(f"cannot read training state {path}: {exc}") from exc


def update_error(
    after: Mapping[str, torch.Tensor],
    other: Mapping[str, torch.Tensor],
    before: Mapping[str, torch.Tensor],
) -> float:
    """``|other - after| / |after - before|`` over the weights both hold (float32): how far
    ``other`` is from the replayed step ``before -> after``, relative to the step itself (0: the
    same bits). The tolerance across hardware is stated on this number (docs/RELIABILITY.md)."""
    num = 0.0
    den = 0.0
    for name, a in after.items():
        if name[:2] in ("m/", "v/", "s/"):  # the weights only, not the optimizer's moments
            continue
        if name not in other or name not in before or not a.is_floating_point():
            continue
        a32 = a.float()
        num += float((other[name].float() - a32).pow(2).sum())
        den += float((a32 - before[name].float()).pow(2).sum())
    if num == 0.0:
        return 0.0
    return float(math.sqrt(num) / max(math.sqrt(den), 1e-30))


class _Setup:
    """A replay's trainer at the state before a step (``replay`` and ``member_gradient``)."""

    def __init__(self, args: Mapping[str, Any]) -> None:
        import time

        from node.compute.groups import Group
        from node.compute.grpo import GRPOConfig, GRPOTrainer
        from node.compute.step_inputs import tied_copies, tokenize_prompts
        from node.model import load_causal_lm
        from node.model.loading import read_weights
        from node.model.text import ModelText

        self.started = time.perf_counter()
        self.model = load_causal_lm(Path(args["model_dir"]), dtype="float32", device="cpu")
        self.tied = tied_copies(self.model)
        parent = int(args["parent"])
        old = {int(v): str(p) for v, p in dict(args.get("old") or {}).items()}
        self.trainer = GRPOTrainer(
            self.model,
            GRPOConfig(**args["config"]),
            version=parent,
            keep_versions=len(old) + 1,
            pad_id=int(args["pad_id"]),
            serve_dtype=str(args["serve_dtype"]),
        )
        self.state = read_state(Path(args["state"]))
        self.before = digest(self.state)
        load_state(self.model, self.trainer.optimizer, self.state, self.tied)
        snapshots = {parent: self.trainer._cpu_state()}
        for version, path in old.items():
            weights = read_weights(path)
            for copy, stored in self.tied.items():
                if copy not in weights and stored in weights:
                    weights[copy] = weights[stored]
            snapshots[version] = {
                k: v.float() if v.is_floating_point() else v for k, v in weights.items()
            }
        self.trainer._snapshots = snapshots
        text = ModelText(args["model_dir"], chat_template=bool(args.get("chat_template")))
        self.groups = tokenize_prompts([Group.from_wire(g) for g in args["groups"]], text)
        self.loaded = time.perf_counter()
        deterministic(int(args["threads"]), int(args["seed"]))


def replay(args: Mapping[str, Any]) -> dict[str, Any]:
    """Replay one step (the replay child's ``replay`` request; ``node.roles.training_audit``).

    ``args``: ``model_dir``, ``chat_template``, ``config`` (``GRPOConfig`` fields),
    ``serve_dtype``, ``pad_id``, ``threads``, ``seed``, ``parent`` (the version stepped from),
    ``groups`` (wire form, prompts as text), ``state`` (the state file before the step),
    ``old`` ({version: published weights file} of the older versions the step's samples came
    from), and optionally ``published`` (the next version's published weights file) and
    ``after`` (the trainer's own state after the step, for the tolerance across hardware).
    Answers the commitments of the state before and after, of the served weights, of the
    published file, and the update's relative error of the trainer's state after."""
    import time

    from node.compute.grpo import served_weights

    run = _Setup(args)
    stats = run.trainer.step(run.groups)
    stepped = time.perf_counter()
    after = state_of(run.model, run.trainer.optimizer, run.tied)
    served = served_weights(
        {k[2:]: v for k, v in after.items() if k.startswith("w/")}, str(args["serve_dtype"])
    )
    out: dict[str, Any] = {
        "before": run.before,
        "after": digest(after),
        "weights": digest(served),
        "published": None,
        "update_error": None,
        "load_seconds": run.loaded - run.started,
        "step_seconds": stepped - run.loaded,
        "kept_groups": stats.kept_groups,
    }
    if args.get("published"):
        out["published"] = published_digest(Path(args["published"]), run.tied)
    if args.get("after"):
        theirs = read_state(Path(args["after"]))
        out["their_after"] = digest(theirs)
        out["update_error"] = update_error(after, theirs, run.state)
    return out


def published_digest(path: Path, tied: Mapping[str, str]) -> bytes:
    from node.model.loading import read_weights

    published = read_weights(str(path))
    return digest({k: v for k, v in published.items() if k not in tied})


def member_gradient(args: Mapping[str, Any]) -> dict[str, Any]:
    """Replay one group member's gradient (the replay child's ``gradient`` request): ``args``
    as ``replay``'s, the state being the member's own before the step, and optionally
    ``theirs`` (the gradient file the member served). Answers the commitments of the state and
    of the replayed gradient, and its relative error against ``theirs`` (0: the same bits)."""
    import time

    run = _Setup(args)
    captured: dict[str, torch.Tensor] = {}

    def capture(grads: list[torch.Tensor], samples: int) -> int:
        captured.update({k: v.clone() for k, v in gradient_of(run.model, grads).items()})
        return samples  # the step goes on; only the gradient before averaging is answered

    run.trainer.step(run.groups, capture)
    out: dict[str, Any] = {
        "before": run.before,
        "gradient": digest(captured),
        "error": None,
        "step_seconds": time.perf_counter() - run.loaded,
    }
    if args.get("theirs"):
        out["error"] = relative_error(captured, read_state(Path(args["theirs"])))
    return out


def relative_error(mine: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor]) -> float:
    """``|theirs - mine| / |mine|`` over all tensors (a name missing on one side: infinite)."""
    if set(mine) != set(theirs):
        return float("inf")
    num = sum(float((theirs[k].float() - mine[k].float()).pow(2).sum()) for k in mine)
    den = sum(float(mine[k].float().pow(2).sum()) for k in mine)
    return (num**0.5) / (den**0.5) if den else (0.0 if num == 0 else float("inf"))


def replay_average(args: Mapping[str, Any]) -> dict[str, Any]:
    """Replay a group round's averaging and the publisher's optimizer step (the replay child's
    ``average`` request) from the members' committed gradients.

    ``args``: ``model_dir``, ``config``, ``serve_dtype``, ``state`` (the publisher's state
    before), ``members`` ([{path, samples}], the gradient files the members served), ``after``
    (the publisher's own state after) and ``published`` (the version's published weights).
    The optimizer steps on the sample-weighted mean of the gradients, clipped as the trainer
    clips it (no step when no member had samples). Answers the commitment of each gradient file,
    of the state before, of the publisher's state after and of it served, of the published
    file, and the update's relative error of the publisher's state after against the replay
    (hivemind's all-reduce sums in its own order, so it is a tolerance, not bits)."""
    from node.compute.grpo import GRPOConfig, GRPOTrainer, served_weights
    from node.compute.step_inputs import tied_copies
    from node.model import load_causal_lm

    model = load_causal_lm(Path(args["model_dir"]), dtype="float32", device="cpu")
    tied = tied_copies(model)
    config = GRPOConfig(**args["config"])
    trainer = GRPOTrainer(model, config, serve_dtype=str(args["serve_dtype"]))
    state = read_state(Path(args["state"]))
    load_state(model, trainer.optimizer, state, tied)
    members = [(read_state(Path(m["path"])), int(m["samples"])) for m in args["members"]]
    total = sum(w for _, w in members)
    names = _param_names(model)
    if total > 0:
        for param in model.parameters():
            key = f"g/{names[id(param)]}"
            mean = torch.zeros_like(param)
            for grads, weight in members:
                if key not in grads or grads[key].shape != param.shape:
                    raise StorageError(f"a member's gradient file has no tensor {key}")
                mean += grads[key].float() * weight
            param.grad = mean / total
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        trainer.optimizer.step()
    after = state_of(model, trainer.optimizer, tied)
    theirs = read_state(Path(args["after"]))
    served = served_weights(
        {k[2:]: v for k, v in theirs.items() if k.startswith("w/")}, str(args["serve_dtype"])
    )
    return {
        "gradients": [digest(grads) for grads, _ in members],
        "before": digest(state),
        "their_after": digest(theirs),
        "their_weights": digest(served),
        "published": published_digest(Path(args["published"]), tied),
        "update_error": update_error(after, theirs, state),
    }
