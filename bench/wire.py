"""Envelope throughput: signatures per second and encode/decode MB/s for a ~1 MiB submission.

    .venv/bin/python bench/wire.py [--json PATH] [--seconds S]

Runs on one core (this process, one thread). Prints a table last and writes JSON with
``sign_per_s``, ``verify_per_s``, ``encode_mb_s``, ``decode_mb_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from swarm.identity import NodeKey
from swarm.messages import PolicyAnnouncement, RolloutSubmission, Sample, decode, sign


def rate(fn: Callable[[], object], seconds: float) -> tuple[float, int]:
    """Calls per second of ``fn`` over about ``seconds`` (after one warm-up call)."""
    fn()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        n += 1
    return n / elapsed, n


def big_submission(target_bytes: int = 1 << 20) -> RolloutSubmission:
    """A realistic submission: per 32 tokens one 258-byte TOPLOC proof; tokens up to 2**17."""
    rng = random.Random(0)
    samples, size = [], 0
    while size < target_bytes:
        tokens = tuple(rng.randrange(1 << 17) for _ in range(1024))
        proofs = tuple(rng.randbytes(258) for _ in range(32))
        samples.append(
            Sample(
                prompt_id=f"p{len(samples)}",
                tokens=tokens,
                seed=rng.randrange(1 << 62),
                proofs=proofs,
                finish_reason="length",
            )
        )
        size += 3 * len(tokens) + 260 * len(proofs)
    return RolloutSubmission(
        run_id="0" * 32,
        policy_version=1,
        counter=0,
        prompt_ids=tuple(s.prompt_id for s in samples),
        samples=tuple(samples),
        created_at=0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core

    key = NodeKey.generate()
    small = PolicyAnnouncement(run_id="0" * 32, version=7, manifest_id=b"\x01" * 32, issued_at=1)
    small_raw = sign(small, key).raw
    sign_per_s, _ = rate(lambda: sign(small, key), args.seconds)
    verify_per_s, _ = rate(lambda: decode(small_raw, PolicyAnnouncement), args.seconds)

    big = big_submission()
    big_raw = sign(big, key).raw
    mb = len(big_raw) / 1e6
    encode_per_s, _ = rate(lambda: sign(big, key), args.seconds)
    decode_per_s, _ = rate(lambda: decode(big_raw, RolloutSubmission), args.seconds)

    result = {
        "sign_per_s": round(sign_per_s),
        "verify_per_s": round(verify_per_s),
        "encode_mb_s": round(encode_per_s * mb, 1),
        "decode_mb_s": round(decode_per_s * mb, 1),
        "small_envelope_bytes": len(small_raw),
        "big_envelope_bytes": len(big_raw),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "goal_verify_per_s": 10_000,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title="wire format, one core")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row(f"sign, {len(small_raw)} B announcement", f"{sign_per_s:,.0f} /s")
    table.add_row(f"verify+decode, {len(small_raw)} B announcement", f"{verify_per_s:,.0f} /s")
    table.add_row(f"encode+sign, {mb:.2f} MB submission", f"{encode_per_s * mb:,.1f} MB/s")
    table.add_row(f"verify+decode, {mb:.2f} MB submission", f"{decode_per_s * mb:,.1f} MB/s")
    Console().print(table)


if __name__ == "__main__":
    main()
