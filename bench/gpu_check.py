"""GPU check for a machine with CUDA (and optionally vllm, extra ``gpu``).

    python bench/gpu_check.py [--json PATH] [--model node/model/default]

1. torch engine on CUDA in bf16: generate, then verify on the CPU in fp32 (a validator on other
   hardware): sampling check and TOPLOC must pass for every sample.
2. vllm engine (when installed): the same, generation through vllm with the hidden-state hook.
Prints a table last and writes JSON. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.compute.engine import Engine
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR
from node.model import tokenizer as tok
from node.tasks import default_suite
from node.verify import SampleClaim, verify_samples
from swarm.toploc import build_proofs

T, MAX, N = 1.0, 16, 256


def check(engine: Engine, validator: TorchEngine) -> dict[str, float]:
    suite = default_suite()
    prompts = [tok.encode(suite.task(i).prompt) for i in range(N)]
    seeds = list(range(N))
    t0 = time.perf_counter()
    gens = engine.generate(prompts, seeds, T, MAX)
    t_gen = time.perf_counter() - t0
    claims = [
        SampleClaim(p, g.tokens, s, i, g.finish_reason, build_proofs(g.hidden))
        for i, (p, g, s) in enumerate(zip(prompts, gens, seeds, strict=True))
    ]
    verdicts = verify_samples(validator, claims, temperature=T, max_tokens=MAX)
    return {
        "samples": N,
        "generate_s": t_gen,
        "rejected": sum(not v.ok for v in verdicts),
        "worst_mant_err_mean": max(
            (c.mant_err_mean for v in verdicts for c in v.proofs), default=0
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="GPU engine check")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        sys.exit(2)
    validator = TorchEngine.from_dir(args.model, dtype="float32", device="cpu")
    results: dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    results["torch_cuda_bf16"] = check(
        TorchEngine.from_dir(args.model, dtype="bfloat16", device="cuda"), validator
    )
    from node.compute.vllm_engine import VllmEngine, vllm_available

    if vllm_available():
        results["vllm_bf16"] = check(VllmEngine(str(args.model), dtype="bfloat16"), validator)
    else:
        results["vllm_bf16"] = "vllm not installed (pip install 'swarm-node[gpu]')"
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    failed = False
    print(f"{'engine':<20}{'samples':>8}{'rejected':>10}{'gen s':>10}{'worst mean':>12}")
    for name in ("torch_cuda_bf16", "vllm_bf16"):
        r = results[name]
        if isinstance(r, dict):
            failed = failed or bool(r["rejected"])
            print(
                f"{name:<20}{r['samples']:>8}{r['rejected']:>10}{r['generate_s']:>10.2f}"
                f"{r['worst_mant_err_mean']:>12.3f}"
            )
        else:
            print(f"{name:<20}{r}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
