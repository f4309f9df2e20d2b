"""Make the embedded default model: a tiny byte-level Llama warmed up on the default task suite.

Deterministic (fixed seeds, CPU, 1 torch thread) and under two minutes on two shared cores::

    .venv/bin/python scripts/make_default_model.py [--out node/model/default] [--target 0.25]

Supervised warm-up on (prompt, answer + EOS) pairs of the default suite (rev and sort, levels 2
and 3), loss on the answer only, AdamW 2e-3, batch 64. Every ``--eval-every`` (25) steps the
bf16-rounded weights are evaluated on 400 held-out tasks with the default sampling (T = 1,
seeded Gumbel-max) and greedily, per family. A family whose sampled reward reaches
``--family-cap`` (0.5) is then drawn at ``--replay`` (0.25) weight so lagging families catch up
(dropping it outright was tried: it is forgotten within 100 steps). The warm-up stops at the
first evaluation whose sampled mean reaches ``--target``, so RL starts from a policy that has
learnt the format and part of each task, with lots of within-group reward variance.

The shipped model (seed 0) stopped at step 275; reruns give the same bytes (checked with 1 and
2 threads). 101 s with 1 thread on two cores at load average ~7; 2 threads took 200-600 s,
contending with other work. Held-out reward per family (400 tasks, 100 per family):

    family        rev2  rev3  sort2  sort3  mean
    sampled T=1   0.41  0.06  0.45   0.17   0.27
    greedy        0.73  0.23  0.62   0.29   0.47

Greedy is above sampled (an early stop leaves the policy uncertain); bench/rl_inprocess.py shows
that GRPO lifts the sampled reward above the starting greedy one, i.e. it learns, not only
sharpens. Weights are stored as bf16 safetensors (1.45 MB). ``--mix add2,rev3,...`` warms up on
another mix (for experiments; the shipped suite is the default one).
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
from node.tasks.suite import TaskSuite

EVAL_IDS = range(90_000, 90_400)  # held out from the warm-up draws
MAX_TOKENS = 16


def build_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = {k: v for k, v in default_config().items() if k not in ("architectures", "torch_dtype")}
    return LlamaForCausalLM(LlamaConfig(**cfg))


def batch(
    suite: TaskSuite, rng: random.Random, size: int, weights: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``size`` warm-up pairs of ids below 80,000; mix entry ``k`` drawn with ``weights[k]``."""
    seqs, masks = [], []
    n = len(suite.mix)
    for _ in range(size):
        k = rng.choices(range(n), weights)[0]
        task = suite.task(rng.randrange(0, 80_000 // n) * n + k)
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
        per.setdefault(f"{t.family}{t.level}", []).append(t.reward(tok.decode(g.tokens)))
    out = {f: sum(v) / len(v) for f, v in per.items()}
    out["mean"] = sum(sum(v) for v in per.values()) / len(tasks)
    return out


def fmt(scores: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in scores.items())


def rounded_copy(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    copy = build_model(seed)
    copy.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    return copy.eval()


def write_tokenizer(out: Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` of the byte vocabulary, by ``tokenizers``.

    Ids stay those of :mod:`node.model.tokenizer`: byte ``b`` is id ``b`` (a BPE without merges
    over the byte-level alphabet), then ``<s>`` 256 (prepended to every text), ``</s>`` 257 and
    ``<pad>`` 258. No normaliser, so every byte passes unchanged.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    # bytes_to_unicode of GPT-2: the printable char that ByteLevel writes for each byte.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {chars[b]: b for b in range(256)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(["<s>", "</s>", "<pad>"])
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.BOS_ID)]
    )
    assert [bpe.token_to_id(t) for t in ("<s>", "</s>", "<pad>")] == [
        tok.BOS_ID,
        tok.EOS_ID,
        tok.PAD_ID,
    ]
    out.mkdir(parents=True, exist_ok=True)
    bpe.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).chmod(0o644)


def save(model: torch.nn.Module, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # package data, readable by everyone
    (out / "config.json").write_text(json.dumps(default_config(), indent=2) + "\n")
    write_tokenizer(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.25)
    ap.add_argument("--family-cap", type=float, default=0.5)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--replay", type=float, default=0.25)
    ap.add_argument("--snapshots", type=Path, default=None)
    ap.add_argument("--mix", default="", help="family+level list, e.g. add2,rev3 (default suite)")
    ap.add_argument(
        "--tokenizer-only", action="store_true", help="write only the tokenizer files to --out"
    )
    args = ap.parse_args()
    if args.tokenizer_only:
        write_tokenizer(args.out)
        return

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    suite = default_suite()
    if args.mix:
        mix = tuple((m[:-1], int(m[-1])) for m in args.mix.split(","))
        suite = TaskSuite(seed=suite.seed, mix=mix)
    names = [f"{f}{lv}" for f, lv in suite.mix]
    ahead: dict[str, int] = {}  # family -> first step at which it reached --family-cap
    model = build_model(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    start = time.time()
    step = 0
    result: dict[str, object] = {}
    while step < args.max_steps:
        model.train()
        weights = [args.replay if n in ahead else 1.0 for n in names]
        ids, attn, loss_mask = batch(suite, rng, args.batch, weights)
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
            for name in names:
                if sampled[name] >= args.family_cap:
                    ahead.setdefault(name, step)
            print(
                f"step {step} loss {loss.item():.3f} sampled {fmt(sampled)} greedy {fmt(greedy)}"
                f" ahead {sorted(ahead)} ({time.time() - start:.0f}s)",
                flush=True,
            )
            result = {"step": step, "sampled": sampled, "greedy": greedy, "ahead": ahead}
            if args.snapshots:
                save(model, args.snapshots / f"step{step}")
            if sampled["mean"] >= args.target:
                break

    save(model, args.out)
    print(json.dumps({**result, "seconds": round(time.time() - start, 1)}))


if __name__ == "__main__":
    main()
