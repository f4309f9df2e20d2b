"""Benchmark of verifiable inference on the embedded default model (CPU).

    .venv/bin/python bench/toploc.py [--json PATH] [--samples 1024] [--batch 256] [--repeats 7]

Measures, for the default sampling (T = 1, max_tokens 32, sampler gumbel-2, the genesis
defaults of the tie tolerances and the near-tie bound):
  proof_bytes_per_token   proof bytes / generated tokens (goal 258/32: one proof per 32 tokens)
  build_over_generate     build_proofs time / generation time (median of --repeats)
  verify_over_generate    (batched prefill + proof check + sampling check) / generation time,
                          the median of --repeats generations of one batch (goal <= 1.0)
  false_positive_rate     honest samples rejected, generation and verification in mixed
                          precision (bf16 <-> fp32), over --samples samples (goal 0)
  detection               {cheat: fraction rejected} (goal 1.0 each)
Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.compute.engine import Generation
from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR, load_causal_lm
from node.model import tokenizer as tok
from node.roles.judge import tie_tolerance
from node.tasks import default_suite
from node.verify import DEFAULT_MODEL_SUBMISSION_MANT_ERR as SUBMISSION
from node.verify import SampleClaim, verify_samples
from swarm.messages import RunParams
from swarm.toploc import build_proofs, build_proofs_batch

T, MAX = 1.0, 32
DEFAULTS = RunParams()


def claims_of(
    gens: list[Generation], prompts: list[list[int]], seeds: list[int], proofs: bool = True
) -> list[SampleClaim]:
    return [
        SampleClaim(p, g.tokens, s, i, g.finish_reason, build_proofs(g.hidden) if proofs else [])
        for i, (p, g, s) in enumerate(zip(prompts, gens, seeds, strict=True))
    ]


def settings(worker: str, validator: str) -> dict[str, object]:
    """The genesis defaults for this pair of precisions, as the judge picks them."""
    return {
        "tie_tolerance": tie_tolerance(DEFAULTS, worker, validator),
        "max_tolerated_per_1k": DEFAULTS.max_tolerated_per_1k,
        "sampler": DEFAULTS.sampler,
    }


def rejected(engine: TorchEngine, claims: list[SampleClaim], worker: str = "float32") -> float:
    verdicts = verify_samples(
        engine,
        claims,
        temperature=T,
        max_tokens=MAX,
        submission_mant_err_mean=SUBMISSION,
        **settings(worker, engine.info.dtype),  # type: ignore[arg-type]
    )
    return sum(not v.ok for v in verdicts) / len(verdicts)


def main() -> None:
    ap = argparse.ArgumentParser(description="TOPLOC and verifiable-inference benchmark")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    suite = default_suite()
    fp32 = TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="float32")
    bf16 = TorchEngine.from_dir(DEFAULT_MODEL_DIR, dtype="bfloat16")
    b = args.batch

    # -- speed, on one batch, fp32 ----------------------------------------------------------
    prompts = [tok.encode(suite.task(i).prompt) for i in range(b)]
    seeds = list(range(b))
    fp32.generate(prompts[:4], seeds[:4], T, MAX)  # warm-up
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        gens = fp32.generate(prompts, seeds, T, MAX)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        proofs = build_proofs_batch([g.hidden for g in gens])
        t_build = time.perf_counter() - t0
        claims = [
            SampleClaim(p, g.tokens, s, i, g.finish_reason, pr)
            for i, (p, g, s, pr) in enumerate(zip(prompts, gens, seeds, proofs, strict=True))
        ]
        t0 = time.perf_counter()
        verdicts = verify_samples(
            fp32,
            claims,
            temperature=T,
            max_tokens=MAX,
            **settings("float32", "float32"),  # type: ignore[arg-type]
        )
        t_verify = time.perf_counter() - t0
        assert all(v.ok for v in verdicts), [v.reasons for v in verdicts if not v.ok][:3]
        runs.append((t_gen, t_build, t_verify))
    t_gen, t_build, t_verify = (statistics.median(r[k] for r in runs) for k in range(3))
    verify_ratio = statistics.median(v / g for g, _, v in runs)
    build_ratio = statistics.median(b / g for g, b, _ in runs)
    n_tokens = sum(len(g.tokens) for g in gens)
    proof_bytes = sum(len(p) for pr in proofs for p in pr)

    # -- false positives: mixed precision, >= --samples honest samples ----------------------
    fp_rejects, fp_total, near_ties, fp_tokens = 0, 0, 0, 0
    worst = {"exp_mismatches": 0, "mant_err_mean": 0.0, "mant_err_median": 0.0}
    start = 10_000
    while fp_total < args.samples:
        gen_engine, ver_engine = (bf16, fp32) if (fp_total // b) % 2 == 0 else (fp32, bf16)
        ps = [tok.encode(suite.task(start + fp_total + i).prompt) for i in range(b)]
        ss = [start + fp_total + i for i in range(b)]
        gs = gen_engine.generate(ps, ss, T, MAX)
        vs = verify_samples(
            ver_engine,
            claims_of(gs, ps, ss),
            temperature=T,
            max_tokens=MAX,
            submission_mant_err_mean=SUBMISSION,
            **settings(gen_engine.info.dtype, ver_engine.info.dtype),  # type: ignore[arg-type]
        )
        fp_rejects += sum(not v.ok for v in vs)
        fp_total += len(vs)
        for v in vs:
            near_ties += v.sampling.near_ties if v.sampling else 0
            fp_tokens += v.sampling.n_tokens if v.sampling else 0
            for c in v.proofs:
                worst["exp_mismatches"] = max(worst["exp_mismatches"], c.exp_mismatches)
                worst["mant_err_mean"] = max(worst["mant_err_mean"], c.mant_err_mean)
                worst["mant_err_median"] = max(worst["mant_err_median"], c.mant_err_median)

    # -- detection ---------------------------------------------------------------------------
    base = claims_of(gens, prompts, seeds)
    detection: dict[str, float] = {}
    for noise_seed in (1, 2):
        model = load_causal_lm(DEFAULT_MODEL_DIR)
        g = torch.Generator().manual_seed(noise_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-2 * torch.randn(p.shape, generator=g))
        other = TorchEngine(model, eos_id=tok.EOS_ID, pad_id=tok.PAD_ID)
        detection[f"different_model_seed{noise_seed}"] = rejected(
            fp32, claims_of(other.generate(prompts, seeds, T, MAX), prompts, seeds)
        )
    changed_prompts = [tok.encode(suite.task(50_000 + i).prompt) for i in range(b)]
    detection["changed_prompt"] = rejected(fp32, claims_of(gens, changed_prompts, seeds))
    one_token = []
    for c in base:
        tokens = list(c.tokens)
        pos = len(tokens) // 2
        tokens[pos] = ord("7") if tokens[pos] != ord("7") else ord("3")
        one_token.append(replace(c, tokens=tokens))
    detection["one_changed_token"] = rejected(fp32, one_token)
    edited = []
    for c in base:
        tokens = list(c.tokens)
        tokens[0] = ord("9") if tokens[0] != ord("9") else ord("8")
        pre = fp32.prefill(c.prompt, tokens)
        edited.append(replace(c, tokens=tokens, proofs=build_proofs(pre.hidden)))
    detection["edited_tokens_recomputed_proofs"] = rejected(fp32, edited)
    # Seeds: sample with other seeds, claim the assigned ones. Where the seed does not change the
    # output (a confident policy) the claim is true and nothing is gained; the rate is over the
    # samples whose tokens differ from the honest ones.
    for kind, used in (("wrong_seed", [s + 1 for s in seeds]), ("reused_seed", [seeds[0]] * b)):
        cheat = fp32.generate(prompts, used, T, MAX, sample_indices=[0] * b)
        changed = [
            c
            for c, x, h in zip(claims_of(cheat, prompts, seeds), cheat, gens, strict=True)
            if x.tokens != h.tokens
        ]
        detection[kind] = rejected(fp32, changed)
        detection[f"{kind}_changed_samples"] = len(changed)
    cut = []
    for c in base:
        full = [t for t in c.tokens if t != tok.EOS_ID]
        if len(full) < 2:
            continue  # nothing to cut
        body = full[: len(full) // 2]
        cut.append(replace(c, tokens=[*body, tok.EOS_ID], finish_reason="stop"))
        cut.append(replace(c, tokens=body, finish_reason="stop"))
    detection["cut_short_reported_finished"] = rejected(fp32, cut)

    result = {
        "machine": "CPU, torch threads 2",
        "samples_per_batch": b,
        "tokens_per_batch": n_tokens,
        "proof_bytes_per_token": proof_bytes / n_tokens,
        "proof_bytes_per_full_chunk_token": 258 / 32,
        "generate_s": t_gen,
        "build_s": t_build,
        "verify_s": t_verify,
        "repeats": args.repeats,
        "build_over_generate": build_ratio,
        "verify_over_generate": verify_ratio,
        "verify_over_generate_runs": [round(v / g, 4) for g, _, v in runs],
        "false_positive_rate": fp_rejects / fp_total,
        "false_positive_samples": fp_total,
        "near_ties_per_token": near_ties / max(fp_tokens, 1),
        "worst_honest_proof_check": worst,
        "detection": detection,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'metric':<40}{'value':>14}  goal")
    rows = [
        ("proof_bytes_per_token", result["proof_bytes_per_token"], "258/32 = 8.06"),
        ("build_over_generate", result["build_over_generate"], "<= 0.01"),
        ("verify_over_generate", result["verify_over_generate"], "<= 1.0 (median)"),
        ("false_positive_rate", result["false_positive_rate"], f"0 (n={fp_total})"),
        ("near_ties_per_token", result["near_ties_per_token"], "(reported)"),
    ] + [(f"detection.{k}", v, "1.0") for k, v in detection.items() if not k.endswith("_samples")]
    for name, value, goal in rows:
        print(f"{name:<40}{value:>14.4f}  {goal}")


if __name__ == "__main__":
    main()
