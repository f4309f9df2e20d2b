"""Range fingerprints for set reconciliation of ledger replicas (range-based set reconciliation,
as in Negentropy: compare a fingerprint per key range, split only the ranges that differ).

Decisions this module owns:
- A range is a hex prefix of the event id (``""`` is everything; ``"3f"`` every id starting
  0x3f); a range splits into its 16 children by appending one hex digit. Ids are sha256, so
  ranges of one depth hold about equal shares and the depth needed grows as log16(events).
- A range's summary is (count, sum of its ids as 256-bit integers mod 2**256); its fingerprint is
  the first ``FP_BYTES`` of sha256(count || sum). A sum is incremental (adding an id adds its
  value), which lets ``RangeIndex`` keep every range of depth <= ``INDEX_DIGITS`` up to date on
  insert in O(depth): the top of the tree never needs a scan, however large the ledger. (XOR
  would be incremental too, but two equal halves cancel; Negentropy also uses a sum.) Deeper
  ranges hold few ids and are summarised from the database by the caller.
- A forged collision hides nothing from an honest pair: ids are hashes of signed envelopes, and
  only a peer that lies about its own set can make two different sets look alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

INDEX_DIGITS = 4  # ranges of up to 4 hex digits (65,536 leaves) are kept in memory
FP_BYTES = 12
_MOD = 1 << 256


def fingerprint(count: int, total: int) -> bytes:
    return hashlib.sha256(count.to_bytes(8, "big") + total.to_bytes(32, "big")).digest()[:FP_BYTES]


def summarise(ids: Iterable[bytes]) -> tuple[int, int]:
    """(count, sum mod 2**256) of ``ids``."""
    count = total = 0
    for i in ids:
        count += 1
        total += int.from_bytes(i, "big")
    return count, total % _MOD


def bounds(prefix: str) -> tuple[bytes, bytes | None]:
    """The id range [lo, hi) that a hex ``prefix`` covers (hi None: up to the end)."""
    digits = len(prefix)
    if digits == 0:
        return b"", None
    value = int(prefix, 16)
    pad = (-digits) % 2  # an odd prefix fills its last byte's low nibble
    lo = (value << (4 * pad)).to_bytes((digits + pad) // 2, "big")
    top = value + 1
    if top >> (4 * digits):
        return lo, None
    return lo, (top << (4 * pad)).to_bytes((digits + pad) // 2, "big")


def children(prefix: str) -> list[str]:
    return [prefix + d for d in "0123456789abcdef"]


def valid_prefix(prefix: object) -> bool:
    return (
        isinstance(prefix, str)
        and len(prefix) <= 64
        and all(c in "0123456789abcdef" for c in prefix)
    )


class RangeIndex:
    """(count, sum) of every range of depth <= ``INDEX_DIGITS``, kept as ids are added."""

    def __init__(self, ids: Iterable[bytes] = ()) -> None:
        leaves = 16**INDEX_DIGITS
        count, total = [0] * leaves, [0] * leaves
        for i in ids:  # the leaves in one pass, then each level from the one below
            leaf = (i[0] << 8) | i[1]  # INDEX_DIGITS hex digits = the first 2 bytes
            count[leaf] += 1
            total[leaf] += int.from_bytes(i, "big")
        self._count = [count]
        self._sum = [[t % _MOD for t in total]]
        for _ in range(INDEX_DIGITS):
            below_c, below_s = self._count[0], self._sum[0]
            self._count.insert(0, [sum(below_c[j : j + 16]) for j in range(0, len(below_c), 16)])
            self._sum.insert(
                0, [sum(below_s[j : j + 16]) % _MOD for j in range(0, len(below_s), 16)]
            )

    def add(self, event_id: bytes) -> None:
        value = int.from_bytes(event_id, "big")
        leaf = int.from_bytes(event_id[:2], "big")  # INDEX_DIGITS hex digits = 2 bytes
        for depth in range(INDEX_DIGITS + 1):
            slot = leaf >> (4 * (INDEX_DIGITS - depth))
            self._count[depth][slot] += 1
            self._sum[depth][slot] = (self._sum[depth][slot] + value) % _MOD

    def summary(self, prefix: str) -> tuple[int, int]:
        """(count, sum) of a range of depth <= ``INDEX_DIGITS``."""
        depth = len(prefix)
        slot = int(prefix, 16) if prefix else 0
        return self._count[depth][slot], self._sum[depth][slot]
