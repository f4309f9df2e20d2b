"""GPU check of issue 11: the torch engine on CUDA in bf16 with seeded sampling and TOPLOC proofs,
against plain transformers sampling, verified on the GPU and (for a sample) on the CPU.

    python bench/gpu_check.py --json OUT.json            # a CUDA machine: ~0.5B model, minutes
    python bench/gpu_check.py --tiny --json OUT.json     # anywhere: tiny model on the CPU

1. Makes a random-weight model with a real tokenizer on the machine
   (``scripts/make_test_model.py``: Qwen2 shape of Qwen2-0.5B by default, hidden 896, 24
   layers, 14 heads / 2 KV heads, MLP 4864, vocabulary padded to 151,936 rows; a byte-level BPE
   trained with ``tokenizers`` on task text, ChatML template). Nothing is downloaded.
2. Generates ``--samples`` completions of ``--max-tokens`` tokens for task prompts (chat
   template applied) in batches of ``--batch``: with our engine (bf16 on the GPU, seeded
   Gumbel-max, hidden states, TOPLOC proofs built) and with plain ``model.generate(do_sample=
   True)`` on the same prompts, same batches. ``proofs_over_plain`` = our tokens/s over plain
   tokens/s (goal >= 0.8).
3. Verifies every sample on the GPU (the validator's chunked check and TOPLOC, bf16) and
   ``--cpu-samples`` of them on the CPU in float32 (other hardware). ``verify_over_generate`` =
   GPU verification time over our generation time (goal <= 0.1); ``false_positive_rate`` =
   honest samples rejected over samples checked, GPU and CPU together (goal 0 over >= 1,000).

Imports only torch, transformers, tokenizers, numpy, safetensors and this repository's engine,
sampling and TOPLOC modules (no libp2p, no msgpack). Prints a table last, writes JSON.
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
from node.verify import SampleClaim, VerifySettings  # noqa: E402
from swarm.toploc import build_proofs  # noqa: E402

QWEN2_05B = {
    "hidden": 896,
    "layers": 24,
    "heads": 14,
    "kv_heads": 2,
    "intermediate": 4864,
    "vocab": 32000,
    "model_vocab": 151_936,
}
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512}
TEMPERATURE = 1.0


def make_model(out: Path, shape: dict[str, int]) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_test_model", ROOT / "scripts/make_test_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path: Path = module.make_model(out, dtype="bfloat16", **shape)
    return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def batches(n: int, size: int) -> list[range]:
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def generate_ours(
    engine: TorchEngine, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[list[SampleClaim], float, int]:
    claims: list[SampleClaim] = []
    sync(engine.device)
    start = time.perf_counter()
    for rows in batches(len(prompts), args.batch):
        ps = [prompts[i] for i in rows]
        gens = engine.generate(ps, [args.seed] * len(ps), TEMPERATURE, args.max_tokens, list(rows))
        for i, p, g in zip(rows, ps, gens, strict=True):
            claims.append(
                SampleClaim(p, g.tokens, args.seed, i, g.finish_reason, build_proofs(g.hidden))
            )
    sync(engine.device)
    return claims, time.perf_counter() - start, sum(len(c.tokens) for c in claims)


def generate_plain(
    engine: TorchEngine, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[float, int]:
    """transformers' own sampling (do_sample, T = 1) on the same prompts and batches."""
    model, pad = engine.model, engine.info.pad_id
    tokens = 0
    sync(engine.device)
    start = time.perf_counter()
    with torch.inference_mode():
        for rows in batches(len(prompts), args.batch):
            ps = [prompts[i] for i in rows]
            width = max(len(p) for p in ps)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps], device=engine.device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in ps], device=engine.device
            )
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=TEMPERATURE,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_tokens,
                eos_token_id=engine.info.eos_id,
                pad_token_id=pad,
            )
            new = out[:, width:]
            tokens += int((new != pad).sum())
    sync(engine.device)
    return time.perf_counter() - start, tokens


def verify(
    engine: TorchEngine, claims: list[SampleClaim], args: argparse.Namespace
) -> tuple[int, float, float]:
    """(rejected, seconds, worst per-chunk mantissa error mean)."""
    settings = VerifySettings(temperature=TEMPERATURE, max_tokens=args.max_tokens)
    sync(engine.device)
    start = time.perf_counter()
    verdicts = []
    for rows in batches(len(claims), args.batch):
        verdicts += engine.verify([claims[i] for i in rows], settings)
    sync(engine.device)
    seconds = time.perf_counter() - start
    worst = max((c.mant_err_mean for v in verdicts for c in v.proofs), default=0.0)
    for v in verdicts:
        if not v.ok:
            print("REJECTED:", "; ".join(v.reasons[:2]), file=sys.stderr)
    return sum(not v.ok for v in verdicts), seconds, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (a dry run)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--samples", type=int, default=None, help="default 1024 (tiny: 64)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 (tiny: 32)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cpu-samples", type=int, default=None, help="default 32 (tiny: 16)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--model", type=Path, default=None, help="reuse a model directory")
    args = ap.parse_args()
    args.samples = args.samples or (64 if args.tiny else 1024)
    args.max_tokens = args.max_tokens or (32 if args.tiny else 64)
    args.cpu_samples = args.cpu_samples or (16 if args.tiny else 32)
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = "bfloat16" if device.startswith("cuda") else "float32"

    made = time.perf_counter()
    model_dir = args.model or make_model(
        Path(tempfile.mkdtemp(prefix="gpu-check-")) / "model", TINY if args.tiny else QWEN2_05B
    )
    made = time.perf_counter() - made
    engine = TorchEngine.from_dir(model_dir, dtype=dtype, device=device, chat_template=True)
    n_params = sum(p.numel() for p in engine.model.parameters())
    texts = [make_task(0, i, FAMILIES[i % 4], 1 + i % 3).prompt for i in range(args.samples)]
    prompts = engine.encode_prompts(texts)

    generate_ours(engine, prompts[: min(8, len(prompts))], args)  # warm-up (kernels, caches)
    claims, gen_s, gen_tokens = generate_ours(engine, prompts, args)
    plain_s, plain_tokens = generate_plain(engine, prompts, args)
    gpu_rejected, verify_s, gpu_worst = verify(engine, claims, args)
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    cpu = TorchEngine.from_dir(model_dir, dtype="float32", device="cpu")
    cpu_rejected, cpu_s, cpu_worst = verify(cpu, claims[: args.cpu_samples], args)

    ours_tps, plain_tps = gen_tokens / gen_s, plain_tokens / plain_s
    checked = len(claims) + min(args.cpu_samples, len(claims))
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0)
        if device.startswith("cuda")
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "tiny": args.tiny,
        "params": n_params,
        "vocab": cpu.info.vocab_size,
        "dtype": dtype,
        "samples": len(claims),
        "max_tokens": args.max_tokens,
        "batch": args.batch,
        "model_make_s": round(made, 2),
        "generate_s": round(gen_s, 3),
        "generated_tokens": gen_tokens,
        "tokens_per_s": round(ours_tps, 1),
        "plain_s": round(plain_s, 3),
        "plain_tokens": plain_tokens,
        "plain_tokens_per_s": round(plain_tps, 1),
        "proofs_over_plain": round(ours_tps / plain_tps, 3),
        "verify_s": round(verify_s, 3),
        "verify_over_generate": round(verify_s / gen_s, 3),
        "gpu_rejected": gpu_rejected,
        "gpu_worst_mant_err_mean": round(gpu_worst, 3),
        "cpu_checked": min(args.cpu_samples, len(claims)),
        "cpu_verify_s": round(cpu_s, 3),
        "cpu_rejected": cpu_rejected,
        "cpu_worst_mant_err_mean": round(cpu_worst, 3),
        "false_positive_rate": (gpu_rejected + cpu_rejected) / checked,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'measure':<28}{'value':>16}")
    for key in (
        "device", "params", "vocab", "samples", "max_tokens", "tokens_per_s",
        "plain_tokens_per_s", "proofs_over_plain", "generate_s", "verify_s",
        "verify_over_generate", "cpu_checked", "false_positive_rate",
    ):  # fmt: skip
        print(f"{key:<28}{result[key]!s:>16}")
    sys.exit(1 if gpu_rejected + cpu_rejected else 0)


if __name__ == "__main__":
    main()
