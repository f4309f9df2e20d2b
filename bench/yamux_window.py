"""Yamux window updates: py-libp2p's rule (one after every read) against go-yamux's (one per
half window read, ``swarm/net/yamux.py``), side by side in one run.

    .venv/bin/python bench/yamux_window.py [--asks 400] [--bulk-mib 128] [--rounds 2]
        [--json PATH]

Each round runs each rule in a child process of its own (the rule is patched per process): a
bootstrap peer and two nodes on 127.0.0.1 in one trio loop, so one core does both ends. The
asker reads the other node's advert ``--asks`` times (a DHT request each, on the connection
they hold), then pulls ``--bulk-mib`` MiB over one yamux stream, twice. Printed per rule: the
window updates per request, the CPU per request, the bulk rate; ``ask_cpu_ratio`` and
``bulk_ratio`` are go-yamux's rule over py-libp2p's (means over the rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RULES = ("py-libp2p", "go-yamux")


async def measure(rule: str, asks: int, bulk_mib: int) -> dict[str, Any]:
    import trio
    from libp2p.peer.id import ID
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    import swarm.net.host
    from tests.netfactory import NetFactory, wait_until

    if rule == "py-libp2p":  # build_host installs go-yamux's rule: keep py-libp2p's here
        swarm.net.host.install_go_yamux_window_updates = lambda: False
    updates = [0]
    send = YamuxStream.send_window_update

    async def counted(self: Any, increment: int, skip_lock: bool = False) -> None:
        updates[0] += increment > 0
        await send(self, increment, skip_lock)

    YamuxStream.send_window_update = counted  # type: ignore[method-assign]
    chunk = bytes(2**20)
    out: dict[str, Any] = {"rule": rule}
    async with NetFactory() as net:
        await net.bootstrap()
        a = await net.node("trainer")
        b = await net.node("inference")

        async def serve(stream: Any) -> None:
            for _ in range(bulk_mib):
                await stream.write(chunk)
            await stream.close()

        b.overlay.host.set_stream_handler("/bench/bulk/1", serve)
        await wait_until(lambda: a.overlay.connected(b.key.peer_id), 30)
        await trio.sleep(2)  # the join's own traffic settles
        updates[0] = 0
        cpu = time.process_time()
        for _ in range(asks):
            if await a.overlay.records.get_advert(a.run_id, b.key.peer_id) is None:
                raise SystemExit("an advert ask came back empty")
        out["ask_cpu_ms"] = 1000 * (time.process_time() - cpu) / asks
        out["window_updates_per_ask"] = updates[0] / asks
        rates = []
        for _ in range(2):
            updates[0] = 0
            started = time.monotonic()
            stream = await a.overlay.host.new_stream(
                ID.from_base58(b.key.peer_id), ["/bench/bulk/1"]
            )
            got = 0
            while got < bulk_mib * 2**20:
                data = await stream.read(2**20)
                if not data:
                    break
                got += len(data)
            if got != bulk_mib * 2**20:
                raise SystemExit(f"the bulk stream ended after {got} bytes")
            rates.append(got / 2**20 / (time.monotonic() - started))
        out["bulk_mib_s"] = statistics.mean(rates)
        out["bulk_window_updates"] = updates[0]
    return out


def child(rule: str, asks: int, bulk_mib: int) -> None:
    import logging

    import trio

    logging.disable(logging.CRITICAL)  # py-libp2p's chatter; the figures go to stdout
    sys.path.insert(0, str(ROOT))
    print(json.dumps(trio.run(measure, rule, asks, bulk_mib)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--asks", type=int, default=400)
    parser.add_argument("--bulk-mib", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=RULES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.asks, args.bulk_mib)
        return
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for rule in RULES:
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    rule,
                    "--asks",
                    str(args.asks),
                    "--bulk-mib",
                    str(args.bulk_mib),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                raise SystemExit(f"{rule} run failed:\n{done.stderr[-3000:]}")
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run["round"] = round_ + 1
            runs.append(run)
            print(
                f"round {round_ + 1} {rule:9}: {run['window_updates_per_ask']:5.1f} updates/ask"
                f"  {run['ask_cpu_ms']:5.2f} ms CPU/ask  {run['bulk_mib_s']:6.1f} MiB/s bulk"
                f" ({run['bulk_window_updates']} updates)",
                flush=True,
            )

    def mean(rule: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs if r["rule"] == rule)

    result: dict[str, Any] = {
        "runs": runs,
        "ask_cpu_ms": {rule: mean(rule, "ask_cpu_ms") for rule in RULES},
        "window_updates_per_ask": {rule: mean(rule, "window_updates_per_ask") for rule in RULES},
        "bulk_mib_s": {rule: mean(rule, "bulk_mib_s") for rule in RULES},
    }
    result["ask_cpu_ratio"] = result["ask_cpu_ms"]["go-yamux"] / result["ask_cpu_ms"]["py-libp2p"]
    result["bulk_ratio"] = result["bulk_mib_s"]["go-yamux"] / result["bulk_mib_s"]["py-libp2p"]
    print()
    print(f"{'rule':10} {'updates/ask':>12} {'ms CPU/ask':>11} {'bulk MiB/s':>11}")
    for rule in RULES:
        print(
            f"{rule:10} {result['window_updates_per_ask'][rule]:12.1f}"
            f" {result['ask_cpu_ms'][rule]:11.2f} {result['bulk_mib_s'][rule]:11.1f}"
        )
    print(f"ask_cpu_ratio {result['ask_cpu_ratio']:.3f}  bulk_ratio {result['bulk_ratio']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
