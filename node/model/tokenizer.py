"""Byte-level tokenizer of the embedded default model.

Ids 0..255 are the bytes themselves; three special tokens follow. Text is UTF-8; decoding stops at
the first EOS and drops other specials, and bytes that are not valid UTF-8 decode with
replacement characters (a model may emit any byte).
"""

from __future__ import annotations

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259


def encode(text: str | bytes, *, bos: bool = True) -> list[int]:
    """Token ids of ``text``: optional BOS, then one id per UTF-8 byte."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return ([BOS_ID] if bos else []) + list(data)


def decode(ids: list[int]) -> str:
    """Text of ``ids`` up to the first EOS; other special ids are skipped."""
    out = bytearray()
    for i in ids:
        if i == EOS_ID:
            break
        if 0 <= i < 256:
            out.append(i)
    return out.decode("utf-8", errors="replace")
