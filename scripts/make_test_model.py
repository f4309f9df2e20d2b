"""Make a small Hugging Face model directory of a mainstream architecture, for tests and benches.

    .venv/bin/python scripts/make_test_model.py OUT_DIR [--seed 0] [--hidden 128] [--layers 2]

The directory is what a real run binds with ``run create --model DIR``: a Qwen2 causal LM with
random weights (``model.safetensors``), ``config.json``, ``generation_config.json``, and a real
byte-level BPE tokenizer trained with the ``tokenizers`` library on text of the task suite
(prompts and answers of every family and level), saved as ``tokenizer.json`` +
``tokenizer_config.json`` with a ChatML chat template (Qwen's own format). Specials:
``<|endoftext|>`` (PAD), ``<|im_start|>``, ``<|im_end|>`` (EOS, ends an assistant turn).

Deterministic given ``--seed``: the same bytes on every run (torch weights seeded; the BPE
trainer is deterministic for a fixed corpus). Takes about a second with the defaults, so tests
make it once per session. ``--hidden 896 --layers 24 --vocab 32000`` and friends give bigger
models (bench/gpu_check.py builds its ~0.5B model with :func:`make_model`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# ChatML, as Qwen2 ships it (without the tool-calling branches): a system turn only when given.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def corpus(seed: int, n: int = 4000) -> list[str]:
    """Training text for the tokenizer: prompts and answers of every task family and level."""
    from node.tasks.suite import FAMILIES, LEVELS, make_task

    lines = []
    for i in range(n):
        family = FAMILIES[i % len(FAMILIES)]
        level = LEVELS[(i // len(FAMILIES)) % len(LEVELS)]
        task = make_task(seed, i, family, level)
        lines.append(f"{task.prompt}{task.answer}")
        lines.append(f"user\n{task.prompt}\nassistant\n{task.answer}")
    lines.append("The answer is \\boxed{1/2} = 0.5, so x = 3/4 and y = -2.")
    return lines


def train_tokenizer(seed: int, vocab: int) -> Any:
    """A byte-level BPE tokenizer (``tokenizers``) with the ChatML specials first."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Qwen2's own normaliser and pre-tokenizer (digits one by one), so the file means the same
    # under every loader: transformers 5's Qwen2Tokenizer rebuilds exactly these.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok


def make_model(
    out: str | Path,
    *,
    seed: int = 0,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 512,
    model_vocab: int | None = None,
    max_positions: int = 2048,
    dtype: str = "float32",
) -> Path:
    """Write the model directory to ``out`` and return its path."""
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(seed, vocab)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=max_positions,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    eos_id = tok.token_to_id("<|im_end|>")
    pad_id = tok.token_to_id("<|endoftext|>")
    config = Qwen2Config(
        # Real models pad the embedding past the tokenizer (Qwen2: 151,643 ids, 151,936 rows).
        vocab_size=max(model_vocab or 0, tok.get_vocab_size()),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True, temperature=1.0
    )
    model.save_pretrained(str(out), safe_serialization=True)
    # tokenizer_config.json from save_pretrained carries the template; keep it readable there
    # too for tools that read only tokenizer_config.json (older transformers did).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name transformers 4 and 5 both know
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    for f in out.iterdir():
        f.chmod(0o644)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    # 128: TOPLOC proves a chunk by the top 128 of its hidden values, so a chunk of one token
    # (a completion one token past a multiple of the chunk size) needs hidden_size >= 128.
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    args = ap.parse_args()
    path = make_model(
        args.out,
        seed=args.seed,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
    )
    print(path)


if __name__ == "__main__":
    main()
