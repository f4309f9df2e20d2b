"""Make the embedded default model: a tiny byte-level Llama warmed up on the default task suite.

Deterministic (fixed seeds, CPU, 2 threads) and a few minutes on two cores::

    .venv/bin/python scripts/make_default_model.py [--out node/model/default] [--target 0.3]

Supervised warm-up on (prompt, answer + EOS) pairs of the default suite, loss on the answer only.
Every ``--eval-every`` steps the bf16-rounded weights are evaluated on held-out tasks with the
default sampling (T = 1, seeded Gumbel-max) and greedily; the warm-up stops at the first
evaluation whose sampled mean reward reaches ``--target``, so RL starts from a policy that solves
some tasks and has room to learn (the design asks for a start reward of about 0.2-0.5 with
greedy accuracy close to the sampled one). Weights are stored as bf16 safetensors (< 2 MB).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.compute.torch_engine import TorchEngine
from node.model import DEFAULT_MODEL_DIR, default_config
from node.model import tokenizer as tok
from node.tasks import default_suite

EVAL_IDS = range(90_000, 90_400)  # held out from the warm-up draws
MAX_TOKENS = 16


def build_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = {k: v for k, v in default_config().items() if k not in ("architectures", "torch_dtype")}
    return LlamaForCausalLM(LlamaConfig(**cfg))


def batch(suite, rng: random.Random, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seqs, masks = [], []
    for _ in range(size):
        task = suite.task(rng.randrange(0, 80_000))
        prompt = tok.encode(task.prompt)
        answer = [*tok.encode(task.answer, bos=False), tok.EOS_ID]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [tok.PAD_ID] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    return ids, attn, loss_mask


def evaluate(model: torch.nn.Module, suite, temperature: float) -> dict[str, float]:
    engine = TorchEngine(model, eos_id=tok.EOS_ID, pad_id=tok.PAD_ID)
    tasks = [suite.task(i) for i in EVAL_IDS]
    gens = engine.generate(
        [tok.encode(t.prompt) for t in tasks],
        [7_000 + i for i in EVAL_IDS],
        temperature,
        MAX_TOKENS,
    )
    per: dict[str, list[float]] = {}
    for t, g in zip(tasks, gens, strict=True):
        per.setdefault(t.family, []).append(t.reward(tok.decode(g.tokens)))
    out = {f: sum(v) / len(v) for f, v in per.items()}
    out["mean"] = sum(sum(v) for v in per.values()) / len(tasks)
    return out


def rounded_copy(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    copy = build_model(seed)
    copy.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    return copy.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.3)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    suite = default_suite()
    model = build_model(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    start = time.time()
    step = 0
    result: dict[str, float] = {}
    while step < args.max_steps:
        model.train()
        ids, attn, loss_mask = batch(suite, rng, args.batch)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        target = ids[:, 1:]
        m = loss_mask[:, 1:].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
        ).view_as(m)
        loss = (nll * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0:
            evm = rounded_copy(model, args.seed)
            sampled = evaluate(evm, suite, 1.0)
            greedy = evaluate(evm, suite, 0.0)
            print(
                f"step {step} loss {loss.item():.3f} sampled {sampled} greedy {greedy['mean']:.3f}"
                f" ({time.time() - start:.0f}s)",
                flush=True,
            )
            result = {"step": step, "sampled": sampled["mean"], "greedy": greedy["mean"]}
            if sampled["mean"] >= args.target:
                break

    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "model.safetensors").chmod(0o644)  # package data, readable by everyone
    (args.out / "config.json").write_text(json.dumps(default_config(), indent=2) + "\n")
    print(json.dumps({**result, "seconds": round(time.time() - start, 1)}))


if __name__ == "__main__":
    main()
