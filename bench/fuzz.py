"""Fuzz every decoder and every stream handler of a running node, many cases per target.

    .venv/bin/python bench/fuzz.py [--json PATH] [--cases N] [--only SUBSTRING] [--no-live]

The targets are the test suite's (``tests/fuzz/``): decoders in this process, stream handlers
through real libp2p streams to a trainer and a validator on 127.0.0.1, and the admin socket.
Each target gets ``--cases`` (default 10,000) hypothesis examples: random bytes, mutations of
valid encodings and random msgpack structures. A case is an untyped error when anything but a
``SwarmError`` escapes (for handlers: escapes the handler on the node), a hang when it takes
over 2 s. After the live targets every protocol must still serve an honest request.

Writes ``{target: {"cases": n, "untyped_errors": n, "hangs": n}}`` (plus ``seconds``) and
prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fuzz.targets import Tally, Target, check, decoder_targets


def run_target(target: Target, cases: int) -> tuple[Tally, float]:
    tally = Tally()

    @settings(
        max_examples=cases,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=target.inputs())
    def case(data: bytes) -> None:
        check(target, data, tally)

    start = time.perf_counter()
    case()
    return tally, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--cases", type=int, default=10_000, help="cases per target")
    parser.add_argument("--only", default="", help="run only targets whose name contains this")
    parser.add_argument("--no-live", action="store_true", help="decoders only (no nodes)")
    args = parser.parse_args()
    console = Console(stderr=True)

    results: dict[str, dict[str, float]] = {}
    examples: dict[str, list[str]] = {}

    def run_all(targets: list[Target]) -> None:
        for target in targets:
            if args.only not in target.name:
                continue
            tally, seconds = run_target(target, args.cases)
            results[target.name] = {**tally.as_dict(), "seconds": round(seconds, 1)}
            examples[target.name] = tally.examples
            console.print(f"{target.name}: {tally.as_dict()} in {seconds:.0f} s")

    run_all(decoder_targets())
    honest_ok = None
    if not args.no_live:
        from tests.fuzz.live import LiveSwarm

        with (
            tempfile.TemporaryDirectory(prefix="swarm-fuzz-live-") as root,
            LiveSwarm(Path(root)) as swarm,
        ):
            run_all(swarm.targets())
            try:
                swarm.call(swarm.honest_round)
                honest_ok = True
            except AssertionError as exc:
                console.print(f"[red]honest requests failed after the fuzzing: {exc}")
                honest_ok = False

    for name, found in examples.items():
        for text in found[:2]:
            console.print(f"[red]{name}[/red] untyped: {text}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {"targets": results, "honest_requests_after_fuzzing": honest_ok}
        args.json.write_text(json.dumps(out, indent=2) + "\n")

    table = Table(title=f"fuzzing: {args.cases} cases per target")
    for col in ("target", "cases", "untyped errors", "hangs", "seconds"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for name, r in results.items():
        table.add_row(
            name, str(r["cases"]), str(r["untyped_errors"]), str(r["hangs"]), str(r["seconds"])
        )
    if honest_ok is not None:
        table.caption = f"honest requests served after the fuzzing: {honest_ok}"
    Console().print(table)


if __name__ == "__main__":
    main()
