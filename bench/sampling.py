"""Speed of seeded gumbel-2 sampling and of the validator's sampling check (issue 24, "Speed").

    .venv/bin/python bench/sampling.py [--json PATH] [--batch 8] [--new-tokens 32] [--repeats 5]

On a Qwen2-0.5B-shaped model with random weights (``scripts/make_test_model.py``: hidden 896,
24 layers, 14 heads / 2 KV heads, MLP 4864, tied embeddings, 151,936 vocabulary rows; nothing is
downloaded), in the torch engine on the CPU, the median of ``--repeats`` runs of each:

  seeded_over_plain   tokens/s of ``TorchEngine.generate`` (seeded gumbel-2, noise drawn where the
                      logits are) plus TOPLOC proofs (``build_proofs_batch`` on its hidden states)
                      over tokens/s of plain transformers sampling (``model.generate(do_sample=True,
                      temperature=1, top_k=0, top_p=1, min_new_tokens = max_new_tokens)``), same
                      prompts, same batch (goal >= 0.9)
  check_over_prefill  the validator's sampling check (``check_positions`` on every position: noise,
                      scores, top two, gap; logits precomputed) over the prefill of the same
                      samples including the LM head (``prefill_stream`` + ``logits``) (goal <= 0.1)
  noise_row_ms        ms per 151,936-entry row: gumbel-2 (``draw_noise``, all positions of the
                      batch in one call) against gumbel-1 (numpy Philox, ``gumbel_noise`` per row)

Prints a table last and writes JSON with those keys (plus the timings behind them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.compute.torch_engine import TorchEngine  # noqa: E402
from node.tasks import default_suite  # noqa: E402
from swarm.sampling import check_positions, draw_noise, gumbel_noise  # noqa: E402
from swarm.toploc import build_proofs_batch  # noqa: E402

QWEN2_05B = {
    "hidden": 896,
    "layers": 24,
    "heads": 14,
    "kv_heads": 2,
    "intermediate": 4864,
    "vocab": 512,
    "model_vocab": 151_936,
}
T = 1.0


def make_model(out: Path, shape: dict[str, int]) -> Path:
    spec = importlib.util.spec_from_file_location("mtm", ROOT / "scripts/make_test_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path: Path = module.make_model(out, **shape)
    return path


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float], Any]:
    """(median seconds, every run's seconds, the last result) of ``repeats`` calls."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, result


def plain_generate(engine: TorchEngine, prompts: list[list[int]], new: int) -> int:
    """transformers' own multinomial sampling on the same left-padded batch; tokens made."""
    pad = engine.info.pad_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = engine.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=T,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad,
        )
    return int(out[:, width:].numel())


def seeded_generate(engine: TorchEngine, prompts: list[list[int]], new: int) -> tuple[int, Any]:
    gens = engine.generate(prompts, list(range(len(prompts))), T, new)
    proofs = build_proofs_batch([g.hidden for g in gens])
    return sum(len(g.tokens) for g in gens), (gens, proofs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--model", type=Path, help="a model directory (default: make the 0.5B shape)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--noise-rows", type=int, default=64, help="rows per gumbel-2 noise call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    tmp = None
    if args.model is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-sampling-"))
        args.model = make_model(tmp / "qwen2-0.5b", QWEN2_05B)
    made = time.perf_counter() - started
    try:
        result = run(args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result["seconds"] = {"make_model": made, "total": time.perf_counter() - started}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        ("seeded_over_plain", result["seeded_over_plain"], ">= 0.9"),
        ("check_over_prefill", result["check_over_prefill"], "<= 0.1"),
        ("noise_row_ms.gumbel2_torch", result["noise_row_ms"]["gumbel2_torch"], ""),
        ("noise_row_ms.gumbel1_numpy", result["noise_row_ms"]["gumbel1_numpy"], ""),
        ("seeded tokens/s (with proofs)", result["details"]["seeded_tokens_per_s"], ""),
        ("plain tokens/s", result["details"]["plain_tokens_per_s"], ""),
        ("proofs share of seeded time", result["details"]["proofs_share_of_seeded"], ""),
        ("prefill s (LM head included)", result["details"]["prefill_s"], ""),
        ("sampling check s", result["details"]["check_s"], ""),
        ("seconds total", result["seconds"]["total"], ""),
    ]
    print(f"{'metric':<34}{'value':>14}  goal")
    for name, value, goal in rows:
        print(f"{name:<34}{value:>14.4g}  {goal}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = TorchEngine.from_dir(args.model, dtype=args.dtype)
    suite = default_suite()
    b, new, reps = args.batch, args.new_tokens, args.repeats
    prompts = engine.encode_prompts([suite.task(i).prompt for i in range(b)])
    vocab, cfg = engine.info.vocab_size, engine.model.config

    # -- generation: seeded gumbel-2 + proofs against plain multinomial sampling -------------
    seeded_generate(engine, prompts, 2)  # warm-up
    plain_generate(engine, prompts, 2)
    seeded_times, plain_times = [], []
    for _ in range(reps):  # interleaved, so a burst of load hits both alike
        t0 = time.perf_counter()
        seeded_tokens, (gens, _) = seeded_generate(engine, prompts, new)
        seeded_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plain_tokens = plain_generate(engine, prompts, new)
        plain_times.append(time.perf_counter() - t0)
    proofs_s, _, _ = median_time(lambda: build_proofs_batch([g.hidden for g in gens]), reps)
    seeded_s, plain_s = statistics.median(seeded_times), statistics.median(plain_times)

    # -- the validator: prefill with the LM head against the sampling check ------------------
    items = [(p, g.tokens) for p, g in zip(prompts, gens, strict=True)]

    def prefill() -> list[torch.Tensor]:
        with torch.inference_mode():
            states = engine.prefill_stream(items)
            return [st.logits(0, len(t)) for st, (_, t) in zip(states, items, strict=True)]

    prefill_s, prefill_times, logits = median_time(prefill, reps)
    flat = torch.cat(logits)
    tokens = [t for _, ts in items for t in ts]
    seeds = [i for i, (_, ts) in enumerate(items) for _ in ts]
    steps = [s for _, ts in items for s in range(len(ts))]

    def check() -> Any:
        return check_positions(flat, tokens, seeds, seeds, steps, T, tolerance=0.25)

    check_s, check_times, pos = median_time(check, reps)
    assert float(pos.gap.max()) <= 0.25, "the engine's own samples must pass its own check"

    # -- noise per row ------------------------------------------------------------------------
    n = args.noise_rows
    g2_s, g2_times, _ = median_time(lambda: draw_noise([7] * n, range(n), range(n), vocab), reps)
    g1_s, g1_times, _ = median_time(lambda: gumbel_noise(7, 0, 0, vocab), max(reps, 20))

    return {
        "seeded_over_plain": (seeded_tokens / seeded_s) / (plain_tokens / plain_s),
        "check_over_prefill": check_s / prefill_s,
        "noise_row_ms": {"gumbel2_torch": 1e3 * g2_s / n, "gumbel1_numpy": 1e3 * g1_s},
        "details": {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
            "threads": torch.get_num_threads(),
            "dtype": args.dtype,
            "model": {
                k: getattr(cfg, k)
                for k in (
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "intermediate_size",
                    "vocab_size",
                    "tie_word_embeddings",
                )
            }
            | {"params": sum(p.numel() for p in engine.model.parameters())},
            "batch": b,
            "new_tokens": new,
            "repeats": reps,
            "positions_checked": len(tokens),
            "seeded_tokens": seeded_tokens,
            "plain_tokens": plain_tokens,
            "seeded_s": seeded_times,
            "plain_s": plain_times,
            "seeded_tokens_per_s": seeded_tokens / seeded_s,
            "plain_tokens_per_s": plain_tokens / plain_s,
            "proofs_s": proofs_s,
            "proofs_share_of_seeded": proofs_s / seeded_s,
            "prefill_s": prefill_s,
            "prefill_runs_s": prefill_times,
            "check_s": check_s,
            "check_runs_s": check_times,
            "noise_rows_per_call": n,
            "gumbel2_runs_s": g2_times,
            "gumbel1_runs_s": g1_times,
        },
    }


if __name__ == "__main__":
    main()
