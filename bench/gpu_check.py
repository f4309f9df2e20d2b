"""GPU check of issue 24: the torch engine on CUDA with the run's seeded sampler and TOPLOC proofs,
against plain transformers sampling, and >= 10,000 honest samples verified on the GPU and the CPU.

    python bench/gpu_check.py --json OUT.json                       # a CUDA machine, minutes
    .venv/bin/python bench/gpu_check.py --device cpu --small --json OUT.json   # CPU smoke, < 1 min

1. Makes two random-weight Qwen2 models with a real tokenizer on the machine
   (``scripts/make_test_model.py``; nothing is downloaded): the **throughput model**, the shape of
   Qwen2-0.5B (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, a 32,000-entry byte-level
   BPE, embedding padded to 151,936 rows), and the **false-positive model** (hidden 256, 4
   layers, 4,096 ids), small so that 10,000 samples verify on the CPU in minutes. Random
   weights give logits of std ~0.3, far flatter than a trained model's, which would hide the
   precision noise the check must survive; each model's final norm is scaled so that its
   next-token logits have std ``--logit-std`` (default 3, what trained models of this size show)
   and the measured std is reported.
2. ``seeded_over_plain`` (goal >= 0.95): the throughput model generates ``--samples`` completions
   of ``--max-tokens`` tokens for task prompts (chat template applied), ``--batch`` at a time,
   with our engine (bf16 on the GPU, the run's sampler ``--sampler``, hidden states kept, TOPLOC
   proofs built) and with plain ``model.generate(do_sample=True)`` on the same prompts and
   batches; the figure is our tokens/s over plain tokens/s, over ``--rounds`` interleaved rounds.
3. ``verify_over_generate`` (goal <= 0.1): the validator's work on those samples on the same GPU
   (:func:`node.verify.verify_samples`: prefill, sampling check, TOPLOC check) over our
   generation time.
4. False positives (goal 0): ``--fp-samples`` (default 10,240) honest samples of the
   false-positive model generated on the GPU in bf16 and verified on the GPU (bf16) and
   ``--fp-cpu-samples`` of them (default: all) on the CPU in float32, plus ``--cpu-samples`` of
   the throughput model's samples on the CPU, under the run's defaults (``RunParams``: tie
   tolerance 1.1 when either side ran bf16, 0.001 when both ran float32; at most 30 tolerated
   positions per 1,000 tokens, per sample and per batch). ``false_positives`` counts every
   rejected honest sample.

Imports only torch, transformers, tokenizers, numpy, safetensors and this repository's engine,
sampling, TOPLOC, verification, model and task modules (no libp2p, trio or msgpack). Prints a
table last, writes JSON; exits 1 when an honest sample was rejected.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.compute.torch_engine import TorchEngine  # noqa: E402
from node.tasks.suite import FAMILIES, make_task  # noqa: E402
from node.verify import SampleClaim, SampleVerdict, verify_samples  # noqa: E402
from swarm.sampling import GUMBEL_2, SAMPLERS  # noqa: E402
from swarm.toploc import build_proofs_batch  # noqa: E402

QWEN2_05B = {
    "hidden": 896,
    "layers": 24,
    "heads": 14,
    "kv_heads": 2,
    "intermediate": 4864,
    "vocab": 32000,
    "model_vocab": 151_936,
}
FP_MODEL = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 1024}
FP_MODEL["vocab"] = 4096
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512}
TEMPERATURE = 1.0
TIE_TOLERANCE = {"float32": 0.001, "bfloat16": 1.1}
"""``RunParams.tie_tol_fp32`` and ``tie_tol_bf16``: the bf16 one applies when either side ran
bf16 (the bench does not import ``swarm.messages``, which needs msgpack)."""
MAX_TOLERATED_PER_1K = 30
"""``RunParams.max_tolerated_per_1k``, the run's default."""
FORGED = 64
"""Claims of the false-positive run forged (one token swapped) as a control."""
GOALS = {"seeded_over_plain": 0.95, "verify_over_generate": 0.1, "false_positives": 0}


# -- models --------------------------------------------------------------------------------------


def make_model(out: Path, shape: dict[str, int], logit_std: float, device: str) -> Path:
    """A model directory of ``shape`` at ``out`` (reused when already there), calibrated."""
    if (out / "config.json").exists():
        return out
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_test_model", ROOT / "scripts/make_test_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path: Path = module.make_model(out, dtype="bfloat16", **shape)
    if logit_std > 0:
        calibrate(path, logit_std, device)
    return path


def logits_std(engine: TorchEngine, n: int = 8) -> float:
    """Std over the vocabulary of next-token logits at the last position of task prompts."""
    prompts = engine.encode_prompts([make_task(1, i, FAMILIES[i % 4], 1).prompt for i in range(n)])
    pres = engine.prefill_batch([(p[:-1], p[-1:]) for p in prompts])
    return float(sum(float(p.logits.std()) for p in pres) / len(pres))


def calibrate(path: Path, target_std: float, device: str) -> None:
    """Scale the final norm so the logits' std is ``target_std`` (the LM head is linear in it)."""
    from safetensors.torch import load_file, save_file

    engine = TorchEngine.from_dir(path, dtype="float32", device=device, chat_template=True)
    scale = target_std / logits_std(engine)
    del engine
    file = path / "model.safetensors"
    state = load_file(str(file))
    state["model.norm.weight"] = (state["model.norm.weight"].float() * scale).to(torch.bfloat16)
    save_file(state, str(file), metadata={"format": "pt"})


# -- generation ----------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batches(n: int, size: int) -> list[range]:
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def generate_ours(
    engine: TorchEngine, prompts: list[list[int]], args: argparse.Namespace, max_tokens: int,
    batch: int,
) -> tuple[list[SampleClaim], float, int]:  # fmt: skip
    """Our engine with the run's sampler, proofs built per batch: (claims, seconds, tokens)."""
    claims: list[SampleClaim] = []
    sync(engine.device)
    start = time.perf_counter()
    for rows in batches(len(prompts), batch):
        ps = [prompts[i] for i in rows]
        seeds = [args.seed] * len(ps)
        gens = engine.generate(ps, seeds, TEMPERATURE, max_tokens, list(rows), sampler=args.sampler)
        proofs = build_proofs_batch([g.hidden for g in gens])
        for i, p, g, pr in zip(rows, ps, gens, proofs, strict=True):
            claims.append(SampleClaim(p, g.tokens, args.seed, i, g.finish_reason, pr))
    sync(engine.device)
    return claims, time.perf_counter() - start, sum(len(c.tokens) for c in claims)


def generate_plain(
    engine: TorchEngine, prompts: list[list[int]], max_tokens: int, batch: int
) -> tuple[float, int]:
    """transformers' own sampling (do_sample, T = 1) on the same prompts and batches."""
    model, pad, dev = engine.model, engine.info.pad_id, engine.device
    stops = sorted(engine.info.stop_ids)
    tokens = 0
    sync(dev)
    start = time.perf_counter()
    with torch.inference_mode():
        for rows in batches(len(prompts), batch):
            ps = [prompts[i] for i in rows]
            width = max(len(p) for p in ps)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps], device=dev)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=dev)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=TEMPERATURE,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_tokens,
                eos_token_id=stops,
                pad_token_id=pad,
            )
            for row in out[:, width:].tolist():
                end = next((t + 1 for t, tok in enumerate(row) if tok in stops), len(row))
                tokens += end
    sync(dev)
    return time.perf_counter() - start, tokens


# -- verification --------------------------------------------------------------------------------


def verify(
    engine: TorchEngine, claims: list[SampleClaim], worker_dtype: str, max_tokens: int,
    args: argparse.Namespace, batch: int, *, quiet: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The validator's checks of ``claims``, a submission (``batch`` claims) per call; the
    first rejections' reasons go to stderr unless ``quiet``."""
    dtypes = {worker_dtype, engine.info.dtype}
    tolerance = TIE_TOLERANCE["bfloat16" if "bfloat16" in dtypes else "float32"]
    verdicts: list[SampleVerdict] = []
    sync(engine.device)
    start = time.perf_counter()
    for rows in batches(len(claims), batch):
        verdicts += verify_samples(
            engine,
            [claims[i] for i in rows],
            temperature=TEMPERATURE,
            max_tokens=max_tokens,
            tie_tolerance=tolerance,
            sampler=args.sampler,
            max_tolerated_per_1k=MAX_TOLERATED_PER_1K,
        )
    sync(engine.device)
    seconds = time.perf_counter() - start
    rejected = [v for v in verdicts if not v.ok]
    for v in [] if quiet else rejected[:5]:
        print("REJECTED:", "; ".join(v.reasons[:2]), file=sys.stderr)
    checks = [v.sampling for v in verdicts if v.sampling is not None]
    return {
        "checked": len(verdicts),
        "rejected": len(rejected),
        "seconds": round(seconds, 3),
        "tolerance": tolerance,
        "tolerated_positions": sum(c.tolerated for c in checks),
        "near_ties": sum(c.near_ties for c in checks),
        "max_gap": round(max((c.max_gap for c in checks), default=0.0), 4),
        "worst_mant_err_mean": round(
            max((p.mant_err_mean for v in verdicts for p in v.proofs), default=0.0), 3
        ),
    }


def forge(claims: list[SampleClaim], stop_ids: frozenset[int], vocab: int) -> list[SampleClaim]:
    """Each claim with its middle token swapped for the next id that is no stop id (what a
    cheater does): the control that shows the verifier rejects what it should."""
    out = []
    for c in claims:
        if len(c.tokens) < 2:
            continue
        k = (len(c.tokens) - 1) // 2
        other = next(
            t % vocab for t in range(c.tokens[k] + 1, c.tokens[k] + 1 + vocab)
            if t % vocab not in stop_ids
        )  # fmt: skip
        tokens = [*c.tokens[:k], other, *c.tokens[k + 1 :]]
        out.append(SampleClaim(c.prompt, tokens, c.seed, c.sample_index, c.finish_reason, c.proofs))
    return out


def task_prompts(engine: TorchEngine, n: int, seed: int) -> list[list[int]]:
    texts = [make_task(seed, i, FAMILIES[i % 4], 1 + i % 3).prompt for i in range(n)]
    return engine.encode_prompts(texts)


def cpu_engine(path: Path, threads: int) -> TorchEngine:
    torch.set_num_threads(threads)
    return TorchEngine.from_dir(path, dtype="float32", device="cpu")


# -- the run -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--small", action="store_true", help="tiny models and counts (a smoke run)")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="the device engines' dtype: bfloat16 on CUDA, float32 on the CPU",
    )
    ap.add_argument("--sampler", default=GUMBEL_2, choices=SAMPLERS)
    ap.add_argument("--samples", type=int, default=None, help="throughput samples (1024)")
    ap.add_argument("--max-tokens", type=int, default=None, help="throughput tokens (64)")
    ap.add_argument("--batch", type=int, default=None, help="samples per submission (64)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (2)")
    ap.add_argument("--cpu-samples", type=int, default=None, help="throughput samples on CPU (64)")
    ap.add_argument("--fp-samples", type=int, default=None, help="false-positive samples (10240)")
    ap.add_argument("--fp-cpu-samples", type=int, default=None, help="of those, on CPU (all)")
    ap.add_argument("--fp-max-tokens", type=int, default=None, help="tokens per fp sample (32)")
    ap.add_argument("--fp-batch", type=int, default=256, help="fp samples per submission")
    ap.add_argument("--logit-std", type=float, default=3.0, help="calibrated logits std (0: off)")
    ap.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--work", type=Path, default=None, help="model directory cache")
    args = ap.parse_args()
    small = args.small
    defaults = {
        "samples": (16, 1024), "max_tokens": (16, 64), "batch": (8, 64), "rounds": (1, 2),
        "cpu_samples": (8, 64), "fp_samples": (64, 10_240), "fp_max_tokens": (16, 32),
    }  # fmt: skip
    for key, (if_small, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, if_small if small else full)
    if args.fp_cpu_samples is None:
        args.fp_cpu_samples = args.fp_samples
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main() -> None:
    args = parse_args()
    device = args.device
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    made = time.perf_counter()
    big_dir = make_model(
        work / ("tiny" if args.small else "qwen2-0.5b"),
        TINY if args.small else QWEN2_05B,
        args.logit_std,
        device,
    )
    fp_dir = make_model(
        work / ("tiny" if args.small else "fp"), TINY if args.small else FP_MODEL, args.logit_std,
        device,
    )  # fmt: skip
    made = time.perf_counter() - made

    # 2-3: throughput and the validator's share, on the throughput model.
    engine = TorchEngine.from_dir(big_dir, dtype=dtype, device=device, chat_template=True)
    n_params = sum(p.numel() for p in engine.model.parameters())
    std = logits_std(engine)
    prompts = task_prompts(engine, args.samples, 0)
    warm = prompts[: min(args.batch, len(prompts))]  # kernels, caches, TOPLOC's tables
    warm_claims, _, _ = generate_ours(engine, warm, args, args.max_tokens, args.batch)
    generate_plain(engine, warm, args.max_tokens, args.batch)
    verify(engine, warm_claims, dtype, args.max_tokens, args, args.batch)
    gen_s = plain_s = 0.0
    gen_tokens = plain_tokens = 0
    claims: list[SampleClaim] = []
    for _ in range(args.rounds):
        claims, s, t = generate_ours(engine, prompts, args, args.max_tokens, args.batch)
        gen_s, gen_tokens = gen_s + s, gen_tokens + t
        s, t = generate_plain(engine, prompts, args.max_tokens, args.batch)
        plain_s, plain_tokens = plain_s + s, plain_tokens + t
    big_device = verify(engine, claims, dtype, args.max_tokens, args, args.batch)
    round_s = gen_s / args.rounds  # the claims verified are one round's
    del engine

    # 4: false positives, on the small model: generated on the device, verified there and on CPU.
    fp_engine = TorchEngine.from_dir(fp_dir, dtype=dtype, device=device, chat_template=True)
    fp_std = logits_std(fp_engine)
    fp_prompts = task_prompts(fp_engine, args.fp_samples, 1)
    fp_claims, fp_gen_s, fp_tokens = generate_ours(
        fp_engine, fp_prompts, args, args.fp_max_tokens, args.fp_batch
    )
    fp_device = verify(fp_engine, fp_claims, dtype, args.fp_max_tokens, args, args.fp_batch)
    forged = forge(fp_claims[:FORGED], fp_engine.info.stop_ids, fp_engine.info.vocab_size)
    caught = verify(fp_engine, forged, dtype, args.fp_max_tokens, args, args.fp_batch, quiet=True)

    del fp_engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    cpu = cpu_engine(fp_dir, args.cpu_threads)
    fp_cpu = verify(
        cpu, fp_claims[: args.fp_cpu_samples], dtype, args.fp_max_tokens, args, args.fp_batch
    )
    cpu = cpu_engine(big_dir, args.cpu_threads)
    big_cpu = verify(cpu, claims[: args.cpu_samples], dtype, args.max_tokens, args, args.batch)

    ours_tps, plain_tps = gen_tokens / gen_s, plain_tokens / plain_s
    parts = {"big_device": big_device, "big_cpu": big_cpu, "fp_device": fp_device}
    parts["fp_cpu"] = fp_cpu
    false_device = big_device["rejected"] + fp_device["rejected"]
    false_cpu = big_cpu["rejected"] + fp_cpu["rejected"]
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "smoke": args.small or not device.startswith("cuda"),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu_threads": args.cpu_threads,
        "load_avg": os.getloadavg(),
        "sampler": args.sampler,
        "dtype": dtype,
        "params": n_params,
        "logits_std": round(std, 3),
        "samples": len(claims),
        "max_tokens": args.max_tokens,
        "batch": args.batch,
        "rounds": args.rounds,
        "model_make_s": round(made, 2),
        "generate_s": round(gen_s, 3),
        "generated_tokens": gen_tokens,
        "tokens_per_s": round(ours_tps, 1),
        "plain_s": round(plain_s, 3),
        "plain_tokens": plain_tokens,
        "plain_tokens_per_s": round(plain_tps, 1),
        "seeded_over_plain": round(ours_tps / plain_tps, 3),
        "verify_s": big_device["seconds"],
        "verify_over_generate": round(big_device["seconds"] / round_s, 3),
        "fp_model_logits_std": round(fp_std, 3),
        "fp_samples": len(fp_claims),
        "fp_max_tokens": args.fp_max_tokens,
        "fp_generate_s": round(fp_gen_s, 3),
        "fp_generated_tokens": fp_tokens,
        "false_positives_device": false_device,
        "false_positives_cpu": false_cpu,
        "false_positives": false_device + false_cpu,
        "false_positive_checks": sum(p["checked"] for p in parts.values()),
        "forged": len(forged),
        "forged_rejected": caught["rejected"],
        "verification": parts,
        "goals": {
            "seeded_over_plain": f">= {GOALS['seeded_over_plain']}",
            "verify_over_generate": f"<= {GOALS['verify_over_generate']}",
            "false_positives": "0 over >= 10,000 samples on the GPU and on the CPU",
        },
    }
    result["goals_met"] = {
        "seeded_over_plain": result["seeded_over_plain"] >= GOALS["seeded_over_plain"],
        "verify_over_generate": result["verify_over_generate"] <= GOALS["verify_over_generate"],
        "false_positives": result["false_positives"] == 0
        and min(fp_device["checked"], fp_cpu["checked"]) >= 10_000,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'measure':<26}{'value':>22}")
    for key in (
        "device", "sampler", "params", "samples", "max_tokens", "tokens_per_s",
        "plain_tokens_per_s", "seeded_over_plain", "generate_s", "verify_s",
        "verify_over_generate", "fp_samples", "false_positives_device", "false_positives_cpu",
        "false_positive_checks", "false_positives", "forged", "forged_rejected",
    ):  # fmt: skip
        print(f"{key:<26}{result[key]!s:>22}")
    for name, part in parts.items():
        print(
            f"{name:<12} checked {part['checked']:>6}  rejected {part['rejected']:>3}  "
            f"tolerated {part['tolerated_positions']:>5}  max gap {part['max_gap']:>7}  "
            f"{part['seconds']:>8} s"
        )
    if result["smoke"]:
        print("(smoke run: the throughput figures mean nothing for a GPU)")
    sys.exit(1 if result["false_positives"] else 0)


if __name__ == "__main__":
    main()
