"""The trainer's compute child: model, optimizer, checkpoints and each version's safetensors,
and (several trainers) hivemind; the node process keeps the queue, networking and publishing.

Run as ``python -m node.compute.train_child``; frames as in ``node.compute.child`` (msgpack, no
pickle). Parent side: :class:`TrainerChild`. Requests:

- ``init`` {model_dir, device, config, keep_versions, pad_id, checkpoint, policies, threads, group,
  chat_template, nproc, serve_dtype} -> {version, hivemind_addrs}. ``serve_dtype`` (the run's,
  float32 when absent): the precision each version's safetensors are written in; the model, the
  optimizer, the held versions and the checkpoint stay float32 (``node.compute.grpo``; the
  sharded trainer of ``nproc`` > 1 replays ``logp_old`` with the float32 masters for now).
  ``group`` (several genesis trainers) starts hivemind (``node.compute.averaging``) and is
  ``None`` for a lone trainer, which never loads hivemind.
  ``nproc`` > 1 (``join --nproc``): this child is rank 0 of an FSDP2 group and starts the other
  ranks (``node.compute.ranks``, ``node.compute.fsdp``); every request below runs on all ranks.
- ``step`` {groups, version} -> {stats, round, weights}: one GRPO step from ``version`` (which
  must be the child's), gradient averaged with the live trainers when in a group; writes the
  new version's safetensors (``policies/v<N>.safetensors``) and the checkpoint. Groups that
  carry their prompt's text instead of its tokens are tokenized here (``tokenize_prompts``):
  the node process imports no tokenizer.
- ``load`` {version, path}: continue from another trainer's published copy of ``version``
  (upcast to float32; where the masters here round to the copy, they are kept: ``keep_masters``).
- ``discard`` {version}: undo a void round (back to the held weights of ``version`` and, with
  training states, to its kept state: the optimizer's moments too, its state file unchanged).
- ``relabel`` {version}: the current weights become ``version`` (a lost copy republished).
- ``rollback`` {version} -> {taken, weights}; ``connect`` {addrs}; ``wanted`` {version};
  ``void`` {version}; ``live``; ``record_round`` {version, members}; ``round_members``
  {version}; ``mark_lost`` {version}; ``lost`` {version}; ``status``.

The checkpoint is written after every change of version, atomically; the node's sample queue
releases reservations of steps at or after the version a restarted child reports.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from node.compute.child import FramedChild, read_frame, write_frame
from node.compute.groups import Group, RoundFailed, remove_stale_sockets
from node.compute.step_inputs import tied_copies, tokenize_prompts
from swarm.errors import EngineError, SwarmError


class TrainerChild(FramedChild):
    """Parent side of the training child. Calls block: run them with ``trio.to_thread``."""

    module = "node.compute.train_child"
    what = "trainer child"

    def __init__(self, spec: dict[str, Any], log_path: Path | None = None) -> None:
        self._lock_init()
        self.log_path = log_path
        self.spec = spec
        self._spawn()
        info = self._call("init", spec)
        self.version: int = int(info["version"])
        self.hivemind_addrs: list[str] = list(info["hivemind_addrs"])
        self.internals_missing: list[str] = list(info.get("internals_missing") or [])
        """hivemind internals this child did not find (``swarm.internals.HIVEMIND``)."""

    def close(self) -> None:
        """Stop the child and its process group; remove the hivemind sockets it left."""
        super().close()
        if self.hivemind_addrs:
            remove_stale_sockets()

    def step(
        self,
        groups: list[Group],
        version: int,
        seed: int = 0,
        cheat: str | None = None,
        cited: list[tuple[bytes, int]] | None = None,
    ) -> dict[str, Any]:
        """One step; ``{"failed": why}`` when the averaging round failed (nothing changed).
        ``cited`` (a group member: the verdicts of its samples, with their versions) goes into
        the member's signed gradient commitment."""
        out: dict[str, Any] = self._call(
            "step",
            {
                "groups": [g.to_wire() for g in groups],
                "version": version,
                "seed": seed,
                "cheat": cheat,
                "cited": [list(c) for c in cited or []],
            },
        )
        if "stats" in out:
            self.version = int(out["stats"]["version"])
        return out

    def load(self, version: int, path: Path) -> None:
        self._call("load", {"version": version, "path": str(path)})
        self.version = version

    def discard(self, version: int) -> None:
        self._call("discard", {"version": version})
        self.version = version

    def rollback(self, version: int) -> dict[str, Any]:
        out: dict[str, Any] = self._call("rollback", {"version": version})
        self.version = int(out["version"])
        return out

    def relabel(self, version: int) -> None:
        self._call("relabel", {"version": version})
        self.version = version

    def connect(self, addrs: list[str], again: bool = False) -> list[str]:
        """Connect the child's DHT to these (``again``: those reached before too); returns the
        addresses it could not reach."""
        return [str(a) for a in self._call("connect", {"addrs": addrs, "again": again}) or []]

    def wanted(self, version: int) -> list[str]:
        return [str(p) for p in self._call("wanted", {"version": version})]

    def void(self, version: int) -> bool:
        return bool(self._call("void", {"version": version}))

    def live(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self._call("live", {}).items()}

    def record_round(self, version: int, members: list[str]) -> None:
        self._call("record_round", {"version": version, "members": members})

    def round_members(self, version: int) -> list[str] | None:
        found = self._call("round_members", {"version": version})
        return None if found is None else [str(p) for p in found]

    def mark_lost(self, version: int) -> None:
        self._call("mark_lost", {"version": version})

    def lost(self, version: int) -> bool:
        return bool(self._call("lost", {"version": version}))

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = self._call("status", {})
        return out

    def step_state(self, version: int, seed: int) -> dict[str, Any]:
        """The commitments of the step to ``version`` read from its files (the states before
        and after it, the weights written): the record of a step whose child died before it
        answered (its checkpoint already at ``version``). Empty without training states."""
        out: dict[str, Any] = self._call("step_state", {"version": version, "seed": seed})
        return out


class ReplayChild(FramedChild):
    """An auditor's child that replays training steps (``node.compute.train_state.replay``):
    the node process of a validator or of ``swarm-node audit`` imports no torch."""

    module = "node.compute.train_child"
    what = "training replay child"

    def __init__(self, log_path: Path | None = None) -> None:
        self._lock_init()
        self.log_path = log_path
        self._spawn()

    def replay(self, args: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self._call("replay", args)
        return out

    def gradient(self, args: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self._call("gradient", args)
        return out

    def average(self, args: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self._call("average", args)
        return out


# -- prompts: the node process queues their text, this child tokenizes them --------------------


def keep_masters(copy: dict[str, Any], masters: dict[str, Any]) -> dict[str, Any]:
    """A published ``copy`` of a version (``serve_dtype``) as float32 weights to continue from:
    where a float32 master here rounds to the copy's value, the master itself, elsewhere the
    copy's value upcast. The trainers of a round compute the same step, and the one that did not
    publish it would otherwise lose, every round, each update smaller than the copy's rounding
    step; the result still rounds to exactly ``copy``, so every trainer serves the same policy.
    A float32 copy is taken as it is."""
    import torch

    out = {}
    for name, value in copy.items():
        master = masters.get(name)
        if (
            master is None
            or not value.is_floating_point()
            or value.dtype == master.dtype
            or value.shape != master.shape
        ):
            out[name] = value
            continue
        master = master.to("cpu")
        out[name] = torch.where(master.to(value.dtype) == value, master, value.to(master.dtype))
    return out


class _Training:
    def __init__(self, args: dict[str, Any]) -> None:
        nproc = int(args.get("nproc") or 1)
        ranks: list[Any] = []
        if nproc > 1:
            from node.compute.ranks import start_ranks

            ranks = start_ranks(nproc)
        import torch

        from node.compute.grpo import GRPOConfig, GRPOTrainer
        from node.model import load_causal_lm, torch_dtype
        from node.model.text import ModelText

        if args.get("threads"):
            torch.set_num_threads(int(args["threads"]))
        # Deterministic steps (node.compute.train_state): the thread count is fixed here and
        # written in every training record, so a replay runs with the same one.
        self.threads = torch.get_num_threads()
        torch.use_deterministic_algorithms(True)
        self.group: Any = None
        self.key: Any = None
        self.run_id = ""
        self.serve_dtype = str(args.get("serve_dtype") or "float32")
        torch_dtype(self.serve_dtype)  # a ConfigError before anything is loaded
        device = str(args.get("device") or "cpu")
        if nproc > 1:  # the ranks load it: only the shapes here (hivemind averages full tensors)
            model = _shapes_only(Path(args["model_dir"]))
        else:
            model = load_causal_lm(Path(args["model_dir"]), dtype="float32", device=device)
        self.text = ModelText(args["model_dir"], chat_template=bool(args.get("chat_template")))
        self.tied = tied_copies(model)
        if args.get("group"):
            remove_stale_sockets()  # left by trainers killed before
            # Before any thread or other fork: hivemind forks its DHT and averager now.
            from node.compute.averaging import TrainerGroup

            g = args["group"]
            self.group = TrainerGroup(
                g["peer"], g["run_id"], g["host"], list(model.parameters()), int(g["trainers"])
            )
            if g.get("key"):  # the member signs its gradient commitments here, where it computes
                from swarm.identity import NodeKey

                self.key = NodeKey.from_seed(bytes(g["key"]))
                self.run_id = str(g["run_id"])
        self.grpo: Any
        if nproc > 1:
            from node.compute.ranks import RankGroup

            self.grpo = RankGroup(args, ranks)
        else:
            self.grpo = GRPOTrainer(
                model,
                GRPOConfig(**args["config"]),
                keep_versions=int(args["keep_versions"]),
                pad_id=int(args["pad_id"]),
                serve_dtype=self.serve_dtype,
            )
        self.checkpoint = Path(args["checkpoint"])
        self.policies = Path(args["policies"])
        self.policies.mkdir(parents=True, exist_ok=True)
        if self.checkpoint.exists():
            self.grpo.load_checkpoint(self.checkpoint)
        if self.group is not None:
            self.group.version = self.grpo.version
        self.states = Path(args["states"]) if args.get("states") and nproc == 1 else None
        """Where each version's training state is kept for audits (None: not committed; a
        sharded trainer's state lives on its ranks)."""
        self.state_keep = int(args.get("state_keep") or 8)
        self.state_digest = b""
        self.served = b""
        """The commitment to the served tensors of the version written last (``_write``)."""
        self._write(self.grpo.version, again=False)
        self._keep_state(again=False)

    def _write(self, version: int, *, again: bool = True) -> str:
        """The version's safetensors, in the run's ``serve_dtype`` (cast here, at save time)."""
        from safetensors.torch import save_file

        from node.compute.grpo import served_weights

        path = self.policies / f"v{version}.safetensors"
        if again or not path.exists():
            tmp = path.with_name(path.name + ".tmp")
            weights = {k: v for k, v in self.grpo.weights().items() if k not in self.tied}
            served = served_weights(weights, self.serve_dtype)
            save_file(served, str(tmp))
            tmp.replace(path)
            if self.states is not None:  # the record's commitment, from the tensors just cast
                from node.compute.train_state import digest

                self.served = digest(served)
        return str(path)

    def _settle(self, *, again: bool = True) -> str:
        """After a change of version: the checkpoint, the version's weights file and its
        training state (``again=False``: the state file kept is the current state)."""
        if self.group is not None:
            self.group.version = self.grpo.version
        self.grpo.save_checkpoint(self.checkpoint)
        path = self._write(self.grpo.version)
        self._keep_state(again=again)
        return path

    def _restore_state(self, version: int) -> bool:
        """Put the kept training state of ``version`` (weights and AdamW moments) back into the
        model and the optimizer: a void round is found after its step, and undoing its weights
        alone would leave its gradient in the moments, so the state file of ``version``, which
        a published record committed to, would be rewritten with other bytes. False when no
        state of ``version`` is kept (no states: a sharded trainer, or one without audits)."""
        if self.states is None:
            return False
        path = self.states / f"s{version}.safetensors"
        if not path.exists():
            return False
        from node.compute.train_state import load_state, read_state

        load_state(self.grpo.model, self.grpo.optimizer, read_state(path), self.tied)
        return True

    def _keep_state(self, *, again: bool = True) -> None:
        """Write the current version's training state (``states/s<N>.safetensors``), keep its
        commitment in ``state_digest``, and drop states past the retention window."""
        if self.states is None:
            return
        from node.compute.train_state import digest, read_state, state_of, write_state

        version = self.grpo.version
        path = self.states / f"s{version}.safetensors"
        if again or not path.exists():
            state = state_of(self.grpo.model, self.grpo.optimizer, self.tied)
            write_state(path, state, version)
        else:
            state = read_state(path)
        self.state_digest = digest(state)
        held = sorted(int(f.stem[1:]) for f in self.states.glob("s*.safetensors"))
        for old in held[: -self.state_keep]:
            (self.states / f"s{old}.safetensors").unlink(missing_ok=True)
        floor = held[-self.state_keep :][0] if held else 0
        for grad in self.states.glob("g*-*.safetensors"):  # kept while its state before is
            made = grad.stem[1:].partition("-")[0]
            if made.isdigit() and int(made) <= floor:
                grad.unlink(missing_ok=True)

    def _commit(
        self, grads: list[Any], samples: int, version: int, seed: int, cited: list[Any]
    ) -> bytes:
        """A group member's signed commitment of its own gradient for the step from
        ``version`` (before averaging), its file kept beside the states (``gradient_file``) to
        be served to auditors; b"" where nothing is committed (no states, no key)."""
        if self.states is None or self.key is None:
            return b""
        from node.compute.train_state import digest, gradient_of, write_state
        from swarm.messages import GradientCommitment, gradient_file, sign

        named = gradient_of(self.grpo.model, grads)
        committed = digest(named)
        write_state(self.states / gradient_file(version + 1, committed), named, version + 1)
        commitment = GradientCommitment(
            run_id=self.run_id,
            version=version + 1,
            samples=samples,
            verdicts=tuple(bytes(v) for v, _ in cited),
            sample_versions=tuple(int(sv) for _, sv in cited),
            seed=seed,
            threads=self.threads,
            state_before=self.state_digest,
            gradient=committed,
            created_at=int(time.time() * 1000),
        )
        return sign(commitment, self.key).raw

    def _step_state(self, version: int, seed: int) -> dict[str, Any]:
        if self.states is None:
            return {}
        from node.compute.train_state import digest, published_digest, read_state

        return {
            "before": digest(read_state(self.states / f"s{version - 1}.safetensors")),
            "after": digest(read_state(self.states / f"s{version}.safetensors")),
            "weights": published_digest(self.policies / f"v{version}.safetensors", self.tied),
            "threads": self.threads,
            "seed": seed,
            "deterministic": True,
        }

    def serve(self, op: str, args: dict[str, Any]) -> Any:
        if op == "step":
            groups = tokenize_prompts([Group.from_wire(g) for g in args["groups"]], self.text)
            return self.step(
                groups,
                int(args["version"]),
                int(args.get("seed") or 0),
                args.get("cheat"),
                list(args.get("cited") or []),
            )
        if op == "load":
            import torch

            from node.model.loading import read_weights

            version = int(args["version"])
            published = read_weights(args["path"])  # one file, or a sharded v0's directory
            for copy, stored in self.tied.items():  # a tied tensor is stored once
                if copy not in published and stored in published:
                    published[copy] = published[stored]
            if any(v.dtype != torch.float32 for v in published.values() if v.is_floating_point()):
                published = keep_masters(published, self.grpo.weights())  # a full gather
            self.grpo.load_version(version, published)
            self._settle()
            return None
        if op == "discard":
            undone, version = self.grpo.version, int(args["version"])
            self.grpo.undo(version)
            (self.policies / f"v{undone}.safetensors").unlink(missing_ok=True)
            # The void step moved the optimizer too: back to the state kept for ``version``,
            # whose file its record's ``state_after`` names (an auditor may fetch it later).
            kept = self._restore_state(version)
            if self.states is not None:  # no record commits to the undone step's state
                (self.states / f"s{undone}.safetensors").unlink(missing_ok=True)
            self._settle(again=not kept)
            return None
        if op == "relabel":
            self.grpo.relabel(int(args["version"]))
            return self._settle()
        if op == "rollback":
            before = self.state_digest
            taken = self.grpo.rollback(int(args["version"]))
            weights = self._settle()
            served = self.served
            state = {"before": before, "after": self.state_digest, "weights": served}
            return {
                "taken": taken,
                "version": self.grpo.version,
                "weights": weights,
                "state": state,
            }
        if op == "status":
            return None if self.group is None else asdict(self.group.stats)
        if op == "step_state":
            return self._step_state(int(args["version"]), int(args["seed"]))
        if self.group is None:
            raise EngineError(f"{op!r} needs a trainer group (the genesis names one trainer)")
        if op == "connect":
            return self.group.connect(
                [str(a) for a in args["addrs"]], again=bool(args.get("again", False))
            )
        if op == "wanted":
            return self.group.wanted(int(args["version"]))
        if op == "void":
            return self.group.void(int(args["version"]))
        if op == "live":
            return self.group.live()
        if op == "record_round":
            self.group.record_round(int(args["version"]), [str(m) for m in args["members"]])
            return None
        if op == "round_members":
            return self.group.round_members(int(args["version"]))
        if op == "mark_lost":
            self.group.mark_lost(int(args["version"]))
            return None
        if op == "lost":
            return self.group.lost(int(args["version"]))
        raise EngineError(f"unknown trainer request {op!r}")

    def step(
        self,
        groups: list[Group],
        version: int,
        seed: int = 0,
        cheat: str | None = None,
        cited: list[Any] | None = None,
    ) -> dict[str, Any]:
        if version != self.grpo.version:
            raise EngineError(f"step from v{version} asked of a child at v{self.grpo.version}")
        round_info: dict[str, Any] | None = None
        average = None
        if self.group is not None:
            group = self.group

            def average(grads: list[Any], samples: int) -> int:
                nonlocal round_info
                if cheat == "forge-gradient":  # tests only: a gradient its samples never gave
                    for grad in grads:
                        grad.neg_().add_(0.0)  # -g, and +0.0 where g is 0: no signal, no cheat
                commitment = self._commit(grads, samples, version, seed, cited or [])
                result = group.average(grads, samples, version, commitment)
                round_info = asdict(result)
                return int(result.group_samples)

        from node.compute.train_state import deterministic

        before = self.state_digest
        deterministic(self.threads, seed)
        if cheat == "learning-rate":  # tests only: a rogue trainer steps with another rate
            for group in self.grpo.optimizer.param_groups:
                group["lr"] = self.grpo.config.learning_rate * 10
        try:
            stats = self.grpo.step(groups, average)
        except RoundFailed as exc:  # nothing changed here: the caller releases the samples
            return {"failed": str(exc)}
        finally:
            if cheat == "learning-rate":
                for group in self.grpo.optimizer.param_groups:
                    group["lr"] = self.grpo.config.learning_rate
        weights = self._settle()
        served = self.served
        if cheat == "perturb-weights":  # tests only: publish weights no step produced
            _perturb(Path(weights))
        return {
            "stats": asdict(stats),
            "round": round_info,
            "weights": weights,
            "state": {
                "before": before,
                "after": self.state_digest,
                "weights": served,
                "threads": self.threads,
                "seed": seed,
                "deterministic": True,
            },
        }

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        if hasattr(self.grpo, "close"):  # the worker ranks of a sharded trainer
            self.grpo.close()


def _perturb(path: Path) -> None:
    """Tests only (a rogue trainer): add a small perturbation to one tensor of a published
    version's file, rewritten in place (its serving dtype kept)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    name = sorted(k for k, v in tensors.items() if v.is_floating_point())[0]
    t = tensors[name]
    tensors[name] = (t.float() + 1e-2 * t.float().abs().mean()).to(t.dtype)
    save_file(tensors, str(path))


def _shapes_only(model_dir: Path) -> Any:
    """The model built on torch's meta device in float32 (what the ranks train in):
    parameters with shapes and no storage."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        return AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32
        )


def _watch_parent(parent: int) -> None:
    """End this child and everything it forked once the node is gone, even while a request
    keeps the main thread busy (stdin's end is noticed only between requests). Started after
    hivemind has forked its helpers: hivemind wants no threads before that."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)  # this child leads its process group (start_new_session)


def main() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the channel
    training: _Training | None = None
    try:
        while True:
            try:
                request = read_frame(stdin)
            except EngineError as exc:
                print(f"trainer child: {exc}", file=sys.stderr)
                return
            if request is None or request.get("op") == "close":
                return
            try:
                op, args = request["op"], request.get("args") or {}
                if op == "init":
                    training = _Training(args)
                    threading.Thread(
                        target=_watch_parent, args=(os.getppid(),), daemon=True
                    ).start()
                    addrs = training.group.addrs() if training.group is not None else []
                    result: Any = {"version": training.grpo.version, "hivemind_addrs": addrs}
                    if training.group is not None:  # hivemind lives here only
                        from swarm.internals import HIVEMIND, check

                        result["internals_missing"] = check(HIVEMIND)
                elif op in ("replay", "gradient", "average"):  # an auditor's child
                    from node.compute import train_state

                    replays = {
                        "replay": train_state.replay,
                        "gradient": train_state.member_gradient,
                        "average": train_state.replay_average,
                    }
                    result = replays[op](args)
                elif training is None:
                    raise EngineError("trainer child got a request before init")
                else:
                    result = training.serve(op, args)
                write_frame(stdout, {"ok": True, "result": result})
            except (SwarmError, KeyError, TypeError, ValueError, RuntimeError) as exc:
                write_frame(stdout, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if training is not None:
            training.close()


if __name__ == "__main__":
    main()
