"""Policy versions as patches (issue 25): how small is one GRPO step's patch, how fast is it made
and applied, and how long does a node 10 versions behind take to catch up.

    .venv/bin/python bench/delta.py [--json PATH] [--steps 3] [--behind 10] [--lrs 1e-6,3e-6]
                                    [--no-catch-up] [--quick] [--dir DIR]

The model: a Qwen2-0.5B-shaped causal LM (transformers ``Qwen2Config``: hidden 896, MLP 4864,
24 layers, 14 heads / 2 KV heads, 151,936 vocabulary rows, tied embeddings, rope theta 1e6),
random weights from a fixed seed (its init: normal std 0.02, biases 0, norms 1; a released
checkpoint's magnitudes differ, and with them the share of weights a step moves across a bf16
rounding boundary). ``--quick``: a tiny model of the same kind, to test this script.

Phase 1, per learning rate (``--lrs``): the project's own GRPO step (``node.compute.grpo``,
``GRPOTrainer`` with ``GRPOConfig.from_params`` of the genesis defaults, learning rate
replaced; AdamW, float32 masters) on batches of the embedded task suite (``default_suite``),
prompts encoded by the one tokenizer path (``node.model.text.ModelText`` over the embedded byte
model's tokenizer). Completions are not sampled (a random-weight model never solves a task):
each group holds the exact answer and ``--group`` - 1 near misses (a letter replaced, two
swapped, one dropped, the word as given), each ended by EOS; the rewards are the task's own
verifier on the decoded completion, so the advantages are real and non-zero. The samples are
the current version's (their ``logp_old`` is the masters' own pass, as for every sample of the
current version), the trainer serves bfloat16 (the genesis default ``serve_dtype``), and every
version is written as the training child writes it: ``served_weights(weights, "bfloat16")``
saved with safetensors. A step trains on ``--prompts`` 4 groups of ``--group`` 4 (the genesis
default, 8 x 16, is minutes a step on 2 cores; AdamW moves each weight by about the learning
rate whatever the batch). Peak RSS is about 13 GB for the 0.5B model (float32 masters, their
gradients, AdamW's two moments, the trainer's held copy). For each step's pair v-1 -> v, with
``swarm.shardcast.delta``:

  patch_over_full   patch bytes / full safetensors bytes (``PatchStats.share``); goal <= 1/20
                    at lr 1e-6
  changed_share     the share of bf16 weights whose bit pattern changed (also per tensor kind,
                    and the share of the changed ones that moved by one ulp)
  encode_s_per_gib  wall seconds of ``encode_patch`` per GiB of the full file (zstd is
                    single-threaded: one core); goal <= 2
  apply_s_per_gib   the same for ``apply_patch`` (which checks every tensor's sha256); goal <= 2
  write_s_per_gib   writing and fsyncing as many bytes in the same folder, nothing else: the
                    floor under ``apply_s_per_gib`` on this disk
                    Every reconstruction is compared byte for byte with the version; any
                    difference ends the benchmark with an error.
  codecs            on step ``--steps``'s pair: the XOR chunks compressed by zlib-1 and
                    zstd-1 with and without byte planes, zstd-9 with planes, and sparse
                    (uint32 index, uint16 value) pairs under zstd-1 (share, s/GiB of compression
                    alone)

Each figure is the median over the first ``--steps`` steps of each lr, and the codecs are
compared on step ``--steps``'s pair, so that the lrs compare alike; the first lr runs
``--behind`` steps when the catch-up runs, and the medians over all of them are added
(``steps_1_<behind>``).

Phase 2 (``--catch-up``, on by default): real libp2p nodes on 127.0.0.1 in one trio run, a
trainer and a node with a ``PolicyFeed`` each (``tests.netfactory``, the data channel on as in
the product). The node fetches v0, then the trainer publishes the first lr's v1 .. v``behind``
(``PolicyFeed.publish``) and the node fetches v``behind`` (``PolicyFeed.fetch_version``), timed:
once under a genesis with ``snapshot_every`` = 1 (every version whole: it fetches the newest
whole) and once with ``snapshot_every`` = ``behind`` + 1 (v0 then patches: it fetches every patch
and reconstructs each version in turn). ``catch_up_10_s``: {"full": s, "patches": s,
"full_bytes": n, "patch_bytes": n} (bytes that travelled). Loopback has no bandwidth limit, so
the seconds price the reconstruction, the bytes price the link.

Prints a table last; writes JSON with those keys under ``per_lr``, and ``catch_up_10_s``.
Temporary files (about 1.3 GB per 0.5B version, up to ``behind`` + 1 of them, and the two
nodes' stores) live under one temporary directory (``--dir``), removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.compute.groups import Group  # noqa: E402
from node.compute.grpo import GRPOConfig, GRPOTrainer, served_weights  # noqa: E402
from node.model import DEFAULT_MODEL_DIR  # noqa: E402
from node.model.text import ModelText  # noqa: E402
from node.tasks import Task, default_suite  # noqa: E402
from swarm.messages import RunParams  # noqa: E402
from swarm.shardcast.delta import (  # noqa: E402
    CHUNK,
    apply_patch,
    encode_patch,
    hash_tensors,
    header_sha256,
    tensor_layout,
)

GIB = 2**30
QWEN2_05B: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "max_position_embeddings": 32_768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY = {
    **QWEN2_05B,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
}
KINDS = ("embedding", "attention", "attention_bias", "mlp", "norm")


class ReconstructionError(SystemExit):
    """A patch applied to its base gave other bytes than the version: the benchmark is void."""


# --- phase 1: versions made by GRPO steps -----------------------------------------------------


def build_model(shape: dict[str, Any], seed: int, text: ModelText) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **shape, bos_token_id=None, eos_token_id=text.eos_id, pad_token_id=text.pad_id
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def near_miss(task: Task, rng: random.Random) -> str:
    """A wrong-looking answer to ``task`` (the verifier decides whether it is wrong)."""
    answer = list(task.answer)
    how = rng.randrange(4)
    if how == 0:
        answer[rng.randrange(len(answer))] = rng.choice("abcdefghijklmnopqrstuvwxyz")
    elif how == 1:
        i, j = rng.sample(range(len(answer)), 2)
        answer[i], answer[j] = answer[j], answer[i]
    elif how == 2:
        del answer[rng.randrange(len(answer))]
    else:
        return task.prompt.split(":", 1)[1].rstrip("=")  # the word as given
    return "".join(answer)


def batch(
    text: ModelText, step: int, prompts: int, group: int, version: int, seed: int
) -> list[Group]:
    """``prompts`` groups of the embedded suite: the answer and ``group`` - 1 near misses each,
    rewarded by the task's verifier."""
    suite = default_suite()
    rng = random.Random(seed * 1_000_003 + step)
    out = []
    for j in range(prompts):
        task = suite.task(step * prompts + j)
        answers = [task.answer] + [near_miss(task, rng) for _ in range(group - 1)]
        rng.shuffle(answers)
        completions = [
            [int(i) for i in text.tokenizer(a, add_special_tokens=False)["input_ids"]]
            + [text.eos_id]
            for a in answers
        ]
        rewards = [task.reward(text.decode(c)) for c in completions]
        out.append(Group(text.encode_prompt(task.prompt), completions, rewards, version))
    return out


def save_version(trainer: GRPOTrainer, path: Path) -> None:
    """As the training child writes a version (``node.compute.train_child._Training._write``)."""
    from safetensors.torch import save_file

    from node.compute.train_child import tied_copies

    tied = tied_copies(trainer.model)  # a tied embedding is stored once
    weights = {k: v for k, v in trainer.weights().items() if k not in tied}
    tmp = path.with_name(path.name + ".tmp")
    save_file(served_weights(weights, "bfloat16"), str(tmp))
    tmp.replace(path)


def kind_of(name: str) -> str:
    if "embed_tokens" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norm"
    if "self_attn" in name:
        return "attention_bias" if name.endswith(".bias") else "attention"
    return "mlp"


def _pread(fd: int, n: int, offset: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise OSError(f"short read at {offset + len(data)}")
        data += more
    return bytes(data)


def tensor_pairs(old: Path, new: Path) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(name, old bits, new bits) of every bf16 tensor, as uint16, one tensor at a time."""
    before = {t.name: t for t in tensor_layout(old)}
    a, b = os.open(old, os.O_RDONLY), os.open(new, os.O_RDONLY)
    try:
        for t in tensor_layout(new):
            was = before[t.name]
            assert t.dtype == was.dtype == "BF16" and t.nbytes == was.nbytes, t.name
            yield (
                t.name,
                np.frombuffer(_pread(a, was.nbytes, was.start), dtype=np.uint16),
                np.frombuffer(_pread(b, t.nbytes, t.start), dtype=np.uint16),
            )
    finally:
        os.close(a)
        os.close(b)


def changed_counts(old: Path, new: Path) -> dict[str, Any]:
    """The share of bf16 weights whose bits changed, overall and per tensor kind, and the share
    of the changed ones that moved by exactly one ulp (same sign, adjacent bit patterns)."""
    total = {k: 0 for k in KINDS}
    changed = {k: 0 for k in KINDS}
    one_ulp = 0
    for name, a, b in tensor_pairs(old, new):
        kind = kind_of(name)
        diff = a != b
        n = int(diff.sum())
        total[kind] += a.size
        changed[kind] += n
        if n:
            step = np.abs(a[diff].astype(np.int32) - b[diff].astype(np.int32))
            one_ulp += int((step == 1).sum())
    weights, moved = sum(total.values()), sum(changed.values())
    return {
        "changed_share": moved / weights,
        "one_ulp_share_of_changed": one_ulp / max(1, moved),
        "by_kind": {k: changed[k] / total[k] for k in KINDS if total[k]},
        "weights_by_kind": {k: total[k] for k in KINDS if total[k]},
    }


def same_bytes(a: Path, b: Path, block: int = 1 << 24) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


def measure_pair(old: Path, new: Path, work: Path) -> dict[str, Any]:
    """Encode, apply (checked against the tensor hashes, then byte for byte) and count."""
    patch, rebuilt = work / "patch", work / "rebuilt.safetensors"
    full = new.stat().st_size
    t0 = time.perf_counter()
    stats = encode_patch(old, new, patch)
    encode_s = time.perf_counter() - t0
    tensors, header = hash_tensors(new), header_sha256(new)
    t0 = time.perf_counter()
    apply_patch(old, patch, rebuilt, tensors=tensors, header_sha256=header)
    apply_s = time.perf_counter() - t0
    if not same_bytes(rebuilt, new):
        raise ReconstructionError(
            f"apply_patch({old.name} + patch) is not {new.name} byte for byte: the patch format"
            " or its reconstruction is broken; this benchmark's figures are void"
        )
    rebuilt.unlink()
    patch.unlink()
    # The floor under apply on this disk: writing (and fsyncing) as many bytes, nothing else.
    t0 = time.perf_counter()
    with open(rebuilt, "wb") as f:
        block = os.urandom(4 << 20)
        for at in range(0, full, len(block)):
            f.write(block[: full - at])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    rebuilt.unlink()
    return {
        "write_s_per_gib": write_s / (full / GIB),
        "patch_over_full": stats.share,
        "patch_bytes": stats.patch_bytes,
        "full_bytes": full,
        "changed_chunks": stats.changed_chunks,
        "chunks": stats.chunks,
        "encode_s": encode_s,
        "apply_s": apply_s,
        "encode_s_per_gib": encode_s / (full / GIB),
        "apply_s_per_gib": apply_s / (full / GIB),
        **changed_counts(old, new),
    }


def planes(x: np.ndarray) -> bytes:
    return bytes(np.ascontiguousarray(x.view(np.uint8).reshape(-1, 2).T))


def compare_codecs(old: Path, new: Path) -> dict[str, dict[str, float]]:
    """The XOR of every changed ``CHUNK`` compressed several ways (unchanged chunks cost 0, as
    in ``encode_patch``): share of the full file and seconds per GiB of it (compression only)."""
    import zstandard

    z1, z9 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=9)
    codecs = {
        "zlib1_raw": lambda x: zlib.compress(x.tobytes(), 1),
        "zlib1_planes": lambda x: zlib.compress(planes(x), 1),
        "zstd1_raw": lambda x: z1.compress(x.tobytes()),
        "zstd1_planes": lambda x: z1.compress(planes(x)),
        "zstd9_planes": lambda x: z9.compress(planes(x)),
        "sparse_zstd1": lambda x: z1.compress(
            np.flatnonzero(x).astype(np.uint32).tobytes() + x[x != 0].tobytes()
        ),
    }
    size = {k: 0 for k in codecs}
    seconds = {k: 0.0 for k in codecs}
    items = CHUNK // 2
    for _, a, b in tensor_pairs(old, new):
        xor = np.bitwise_xor(a, b)
        for lo in range(0, xor.size, items):
            x = xor[lo : lo + items]
            if not x.any():
                continue
            for name, codec in codecs.items():
                t0 = time.perf_counter()
                size[name] += len(codec(x))
                seconds[name] += time.perf_counter() - t0
    full = new.stat().st_size
    return {k: {"share": size[k] / full, "s_per_gib": seconds[k] / (full / GIB)} for k in codecs}


def medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "patch_over_full",
        "changed_share",
        "encode_s_per_gib",
        "apply_s_per_gib",
        "write_s_per_gib",
        "one_ulp_share_of_changed",
        "step_s",
    )
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in keys}
    out["changed_share_by_kind"] = {
        k: statistics.median(r["by_kind"][k] for r in rows) for k in rows[0]["by_kind"]
    }
    return out


def run_lr(
    lr: float, steps: int, args: argparse.Namespace, text: ModelText, work: Path, keep: bool
) -> tuple[dict[str, Any], list[Path]]:
    """``steps`` GRPO steps at ``lr`` from the seeded model; each pair measured. ``keep``: keep
    every version's file (for the catch-up), else only the newest."""
    shape = TINY if args.quick else QWEN2_05B
    model = build_model(shape, args.seed, text)
    params = replace(RunParams(), learning_rate=lr)
    trainer = GRPOTrainer(
        model,
        GRPOConfig.from_params(params),
        keep_versions=1,
        pad_id=text.pad_id,
        serve_dtype="bfloat16",
    )
    files = [work / f"lr{lr:g}-v0.safetensors"]
    save_version(trainer, files[0])
    rows = []
    for step in range(1, steps + 1):
        groups = batch(text, step, args.prompts, args.group, trainer.version, args.seed)
        # Memory: every sample is the current version's, so its held float32 copy (2.5 GB,
        # kept to replay logp_old) is never read; dropped before the step makes the next one.
        # The gradients are dropped after it (the next step does so first). Peak RSS stays at
        # ~13 GB (13.4 without this): the allocator keeps what the step freed.
        trainer.forget(trainer.version)
        t0 = time.perf_counter()
        stats = trainer.step(groups)
        step_s = time.perf_counter() - t0
        trainer.optimizer.zero_grad(set_to_none=True)
        path = work / f"lr{lr:g}-v{trainer.version}.safetensors"
        save_version(trainer, path)
        row = {
            "version": trainer.version,
            "step_s": step_s,
            "kept_groups": stats.kept_groups,
            "mean_reward": stats.mean_reward,
            "grad_norm": stats.grad_norm,
            **measure_pair(files[-1], path, work),
        }
        rows.append(row)
        print(
            f"lr {lr:g} v{row['version']}: step {step_s:.1f} s, patch/full"
            f" {row['patch_over_full']:.4f}, changed {row['changed_share']:.4f}, encode"
            f" {row['encode_s_per_gib']:.2f} s/GiB, apply {row['apply_s_per_gib']:.2f} s/GiB",
            flush=True,
        )
        if step == args.steps and not args.no_codecs:
            row["codecs"] = compare_codecs(files[-1], path)
        if not keep:
            files[-1].unlink()
        files.append(path)
    del trainer, model
    gc.collect()
    summary = medians(rows[: args.steps])
    if len(rows) > args.steps:
        summary[f"steps_1_{len(rows)}"] = medians(rows)
    summary["steps"] = rows
    if not args.no_codecs:
        summary["codecs"] = rows[args.steps - 1]["codecs"]
    return summary, [f for f in files if f.exists()]


# --- phase 2: a node 10 versions behind, on loopback ----------------------------------------


async def catch_up(files: list[Path], root: Path, snapshot_every: int) -> dict[str, Any]:
    """Under a genesis with ``snapshot_every``: a node fetches v0, the trainer publishes the
    rest of ``files``, the node fetches the newest; seconds, bytes that travelled, kinds."""
    import trio

    from node.policy_feed import PolicyFeed
    from node.run import create_genesis
    from node.runtime import Node
    from swarm.messages import ModelSpec
    from tests.netfactory import NetFactory

    # libp2p sets its own level when imported; its DHT warns of every stream cut at teardown.
    logging.getLogger("libp2p").setLevel(logging.ERROR)

    @asynccontextmanager
    async def feed(node: Node, where: Path) -> AsyncIterator[PolicyFeed]:
        f = PolicyFeed(node, where)
        async with trio.open_nursery() as nursery:
            await nursery.start(f.run)
            yield f
            nursery.cancel_scope.cancel()

    net = NetFactory()
    net.genesis = create_genesis(
        net.owner,
        name="bench-delta",
        trainers=[k.peer_id for k in net.trainer_keys],
        validators=[k.peer_id for k in net.validator_keys],
        params=RunParams(snapshot_every=snapshot_every),
        # No bound weights: v0 is this benchmark's model, not the embedded one.
        model=ModelSpec(name="bench-delta-qwen2"),
        created_at=1,
    )
    newest = len(files) - 1
    async with net:
        trainer = await net.node("trainer", bootstrap=[])
        joiner = await net.node("inference", bootstrap=[], connect_found_peers=False)
        async with feed(trainer, root / "trainer") as source:
            await source.publish(0, files[0])
            assert await joiner.overlay.connect(trainer.peer_id, trainer.overlay.addrs()) is None
            async with feed(joiner, root / "joiner") as late:
                with trio.fail_after(600):
                    t0 = time.perf_counter()
                    await late.fetch_version(0)
                    v0_s = time.perf_counter() - t0
                kinds = ["whole"]
                t0 = time.perf_counter()
                for v in range(1, newest + 1):
                    manifest = await source.publish(v, files[v])
                    kinds.append("patch" if manifest.message.is_patch else "whole")
                publish_s = time.perf_counter() - t0
                with trio.fail_after(600):
                    t0 = time.perf_counter()
                    got = await late.fetch_version(newest)
                    seconds = time.perf_counter() - t0
                if not same_bytes(got, files[newest]):
                    raise ReconstructionError(
                        f"the node's v{newest} (snapshot_every={snapshot_every}) is not the"
                        " trainer's file byte for byte"
                    )
                moved = sum(int(t["bytes"]) for v, t in late.transfers.items() if v > 0)
                fetched = sorted(v for v in late.transfers if v > 0)
    return {
        "seconds": seconds,
        "bytes": moved,
        "fetched_versions": fetched,
        "kinds": kinds,
        "v0_s": v0_s,
        "publish_s": publish_s,
    }


def run_catch_up(files: list[Path], work: Path) -> dict[str, Any]:
    import trio

    out: dict[str, Any] = {}
    for name, every in (("full", 1), ("patches", len(files))):
        root = work / f"catch-up-{name}"
        try:
            out[name] = trio.run(catch_up, files, root, every)
        except ReconstructionError:
            raise
        except Exception:  # report what failed and keep the phase-1 figures
            out[name] = {"error": traceback.format_exc()}
            print(out[name]["error"], file=sys.stderr)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    full, patches = out["full"], out["patches"]
    if "error" in full or "error" in patches:
        return {"error": {k: v["error"] for k, v in out.items() if "error" in v}, "runs": out}
    return {
        "full": full["seconds"],
        "patches": patches["seconds"],
        "full_bytes": full["bytes"],
        "patch_bytes": patches["bytes"],
        "behind": len(files) - 1,
        "runs": out,
    }


# --- report ---------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"Delta SHARDCAST: {result['model']['name']}, median over steps")
    t.add_column("measure")
    for lr in result["per_lr"]:
        t.add_column(f"lr {lr}", justify="right")
    t.add_column("goal")
    per = result["per_lr"].values()
    goals = {
        "patch_over_full": "<= 0.05 at lr 1e-6",
        "changed_share": "",
        "encode_s_per_gib": "<= 2",
        "apply_s_per_gib": "<= 2",
        "write_s_per_gib": "(floor under apply)",
    }
    for key, goal in goals.items():
        t.add_row(key, *(f"{p[key]:.4f}" for p in per), goal)
    for kind in KINDS:
        if all(kind in p["changed_share_by_kind"] for p in per):
            t.add_row(
                f"  changed_share {kind}",
                *(f"{p['changed_share_by_kind'][kind]:.4f}" for p in per),
                "",
            )
    t.add_row(
        "  one ulp, of the changed", *(f"{p['one_ulp_share_of_changed']:.3f}" for p in per), ""
    )
    t.add_row("step_s", *(f"{p['step_s']:.1f}" for p in per), "")
    for p in per:
        for key, more in p.items():
            if key.startswith("steps_1_"):
                t.add_row(
                    f"{key}: patch_over_full",
                    *(f"{more['patch_over_full']:.4f}" if q is p else "" for q in per),
                    "",
                )
                t.add_row(
                    f"{key}: changed_share",
                    *(f"{more['changed_share']:.4f}" if q is p else "" for q in per),
                    "",
                )
    if all("codecs" in p for p in per):
        for codec in next(iter(per))["codecs"]:
            t.add_row(
                f"codec {codec} (step {result['steps']})",
                *(
                    f"{p['codecs'][codec]['share']:.4f} @ {p['codecs'][codec]['s_per_gib']:.2f}"
                    for p in per
                ),
                "share @ s/GiB",
            )
    c = result.get("catch_up_10_s")
    if c is not None:
        if "error" in c:
            t.add_row("catch_up_10_s", "failed (see JSON)", *[""] * len(result["per_lr"]))
        else:
            blanks = [""] * (len(result["per_lr"]) - 1)
            t.add_row(f"catch_up_{c['behind']}_s full", f"{c['full']:.2f}", *blanks, "")
            t.add_row(f"catch_up_{c['behind']}_s patches", f"{c['patches']:.2f}", *blanks, "")
            t.add_row("  full_bytes", f"{c['full_bytes']:,}", *blanks, "")
            t.add_row("  patch_bytes", f"{c['patch_bytes']:,}", *blanks, "")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per learning rate")
    ap.add_argument("--lrs", default="1e-6,3e-6", help="comma-separated learning rates")
    ap.add_argument("--prompts", type=int, default=4, help="groups per step")
    ap.add_argument("--group", type=int, default=4, help="completions per group")
    ap.add_argument("--behind", type=int, default=10, help="versions the catch-up node misses")
    ap.add_argument("--catch-up", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--no-codecs", action="store_true", help="skip the codec comparison")
    ap.add_argument("--quick", action="store_true", help="a tiny model, to test the script")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, help="where the temporary files go (default: /tmp)")
    args = ap.parse_args()
    started, load_start = time.perf_counter(), os.getloadavg()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    text = ModelText(DEFAULT_MODEL_DIR)
    lrs = [float(x) for x in args.lrs.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-delta-", dir=args.dir))
    free = shutil.disk_usage(work).free
    print(f"temporary files under {work} ({free / GIB:.0f} GiB free)", flush=True)
    result: dict[str, Any] = {
        "model": {
            "name": "tiny Qwen2 (--quick)" if args.quick else "Qwen2-0.5B shape, random init",
            "shape": TINY if args.quick else QWEN2_05B,
            "seed": args.seed,
            "prompts_per_step": args.prompts,
            "group": args.group,
        },
        "per_lr": {},
        "steps": args.steps,
    }
    try:
        chain: list[Path] = []
        for i, lr in enumerate(lrs):
            first = i == 0 and args.catch_up
            steps = max(args.steps, args.behind) if first else args.steps
            summary, files = run_lr(lr, steps, args, text, work, keep=first)
            result["per_lr"][f"{lr:g}"] = summary
            if first:
                chain = files[: args.behind + 1]
            else:
                for f in files:
                    f.unlink()
        if args.catch_up:
            result["catch_up_10_s"] = run_catch_up(chain, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # The key names at the top level: the figures of the first (goal) learning rate.
    goal_lr = result["per_lr"][f"{lrs[0]:g}"]
    for key in ("patch_over_full", "changed_share", "encode_s_per_gib", "apply_s_per_gib"):
        result[key] = goal_lr[key]
    result.update(
        {
            "wall_s": time.perf_counter() - started,
            "command": " ".join([".venv/bin/python", *sys.argv]),
            "machine": f"{platform.platform()}, {os.cpu_count()} cores, torch threads"
            f" {args.threads}",
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        }
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    Console(width=110).print(table(result))


if __name__ == "__main__":
    main()
