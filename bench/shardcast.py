"""SHARDCAST throughput on loopback: raw ceiling, pulls from 1/2/4 seeders, rate-limited
seeders, re-serving vs origin-only, receiver memory.

    .venv/bin/python bench/shardcast.py [--json PATH] [--size-mib 256] [--dir DIR]
        [--files N] [--no-reserve]

``--files N`` publishes the checkpoint as a sharded model of N safetensors files (one version
of N files, as ``model-0000k-of-0000N.safetensors`` ship) and also times the split of the
received version into its files (``split_s``, ``split_mib_s``: what a holder does once before
loading).

What runs where: seeders are ``DataChannelServer``s (zero-copy ``sendfile``) in this process;
the measured receiver of the pull runs is a child process (``--role receiver``) running the real
scheduler (``fetch_version``: per-shard sha256, write at offset, fsync, journal, complete
marker) over data channel sockets, so its peak RSS is its own. The control questions
(manifest, holdings, tokens) are answered in-process (``DirectControl``) instead of over libp2p
streams; they are a few hundred bytes per shard. The re-serving run puts all 7 nodes in this
process, each with its own store, data channel and upload cap.

JSON keys: ``raw_limit_mib_s``, ``pull_mib_s`` {"1","2","4"}, ``ratio_vs_raw``,
``rate_limited_efficiency``, ``reserve_speedup``, ``receiver_peak_rss_mib``, ``files``,
``split_s`` and the details.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio
from rich.console import Console
from rich.table import Table
from safetensors.numpy import save_file

from swarm.identity import NodeKey
from swarm.messages import ModelSpec, RunGenesis, RunParams, ShardManifest, Signed, decode, sign
from swarm.shardcast import FetchConfig, ShardStore, fetch_version, publish
from swarm.shardcast.datachannel import DataChannelConfig, DataChannelServer, DataChannelSource
from swarm.shardcast.local import DirectControl
from swarm.shardcast.serve import ShardServer
from swarm.shardcast.split import split_files

MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[1]


# --- set-up ---------------------------------------------------------------------------------
def make_checkpoint(path: Path, size: int, files: int = 1) -> list[Path]:
    """A checkpoint of about ``size`` bytes: one file at ``path``, or ``files`` shard files
    beside it (tensors of at most 32 MiB, dealt out in order)."""
    rng = np.random.default_rng(0)
    per = 32 * MIB // 4
    tensors, left, i = {}, size, 0
    while left > 0:
        n = min(per, left // 4)
        tensors[f"layer{i}.weight"] = rng.standard_normal(n, dtype=np.float32)
        left -= n * 4
        i += 1
        if n == 0:
            break
    if files == 1:
        save_file(tensors, str(path))
        return [path]
    names = list(tensors)
    paths = []
    for k in range(files):
        part = names[k * len(names) // files : (k + 1) * len(names) // files]
        shard = path.with_name(f"model-{k + 1:05d}-of-{files:05d}.safetensors")
        save_file({name: tensors.pop(name) for name in part}, str(shard))
        paths.append(shard)
    return paths


def genesis_for(trainer: NodeKey) -> Signed[RunGenesis]:
    g = RunGenesis(
        name="bench",
        created_at=0,
        model=ModelSpec(name="bench"),
        task_suite="default",
        task_seed=0,
        trainers=(trainer.peer_id,),
        validators=(trainer.peer_id,),
        params=RunParams(),
    )
    return sign(g, NodeKey.generate())


# --- raw ceiling ----------------------------------------------------------------------------
def raw_receiver(port: int, total: int) -> dict[str, float]:
    sock = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(MIB)
    view = memoryview(buf)
    h = hashlib.sha256()
    got = 0
    start = time.perf_counter()
    while got < total:
        n = sock.recv_into(view)
        if not n:
            break
        h.update(view[:n])
        got += n
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": got}


def measure_raw(data_path: Path, total: int) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send() -> None:
        conn, _ = listener.accept()
        with open(data_path, "rb") as f:
            conn.sendfile(f)
        conn.close()

    sender = threading.Thread(target=send)
    sender.start()
    out = subprocess.run(
        [sys.executable, __file__, "--role", "raw", "--spec", json.dumps([port, total])],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=300,
    )
    sender.join()
    listener.close()
    r = json.loads(out.stdout)
    return float(r["bytes"]) / MIB / float(r["seconds"])


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM). Not ``ru_maxrss``: Linux carries that over
    from the parent across fork and exec, so a child would report the bench's own peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- receiver child -------------------------------------------------------------------------
class FixedControl:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def manifest(self, peer: str, version: int | None) -> bytes:
        return self.raw

    async def have(
        self, peer: str, version: int, known: int = -1, wait: float = 0.0
    ) -> bytes | None:
        return None


async def receiver(spec: dict[str, Any]) -> dict[str, float]:
    raw = Path(spec["manifest"]).read_bytes()
    signed = decode(raw, ShardManifest)
    peers = {p["name"]: p for p in spec["peers"]}
    tokens = {name: [bytes.fromhex(t) for t in p["tokens"]] for name, p in peers.items()}

    async def negotiate(peer: str) -> tuple[str, int, bytes]:
        return "127.0.0.1", int(peers[peer]["port"]), tokens[peer].pop()

    source = DataChannelSource(negotiate, FixedControl(raw))
    rss_before = peak_rss_mib()
    start = time.perf_counter()
    result = await fetch_version(
        ShardStore(Path(spec["store"])),
        signed,
        source,
        list(peers),
        config=FetchConfig(concurrency=int(spec["concurrency"]), stall_timeout=30.0),
        rng=random.Random(1),
    )
    seconds = time.perf_counter() - start
    source.close()
    return {
        "seconds": seconds,
        "bytes": signed.message.total_size,
        "fetched_shards": result.fetched_shards,
        "peak_rss_mib": peak_rss_mib(),
        "rss_before_fetch_mib": rss_before,
    }


async def pull_run(
    workdir: Path,
    trainer: ShardStore,
    signed: Signed[ShardManifest],
    seeders: int,
    cap: float | None,
) -> dict[str, float]:
    (workdir / "manifest").write_bytes(signed.raw)
    rx = workdir / f"rx-{seeders}-{cap}"
    async with trio.open_nursery() as nursery:
        peers = []
        for i in range(seeders):
            server = ShardServer(trainer)
            channel = DataChannelServer(server, DataChannelConfig(rate_limit=cap))
            port = await nursery.start(channel.run)
            tokens = [server.issue_token("rx").hex() for _ in range(256)]
            peers.append({"name": f"seeder{i}", "port": port, "tokens": tokens})
        spec = {
            "manifest": str(workdir / "manifest"),
            "store": str(rx),
            "peers": peers,
            "concurrency": max(4, 2 * seeders),
        }
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        out = await trio.run_process(
            [sys.executable, __file__, "--role", "receiver", "--spec", str(spec_path)],
            cwd=ROOT,
            capture_stdout=True,
            capture_stderr=True,
        )
        nursery.cancel_scope.cancel()
    got = ShardStore(rx).directory(signed.message.version) / "data"
    assert (
        hashlib.sha256(got.read_bytes()).digest()
        == hashlib.sha256(
            (trainer.directory(signed.message.version) / "data").read_bytes()
        ).digest()
    )
    shutil.rmtree(rx)
    r: dict[str, float] = json.loads(out.stdout)
    r["mib_s"] = r["bytes"] / MIB / r["seconds"]
    return r


# --- re-serving -----------------------------------------------------------------------------
async def reserve_run(
    workdir: Path,
    trainer: ShardStore,
    signed: Signed[ShardManifest],
    n: int,
    cap: float,
    serve: bool,
) -> float:
    servers: dict[str, ShardServer] = {"origin": ShardServer(trainer)}
    stores = {f"rx{i}": ShardStore(workdir / f"reserve-{serve}-{i}") for i in range(n)}
    if serve:
        servers.update({name: ShardServer(store) for name, store in stores.items()})
    ports: dict[str, int] = {}
    done: list[float] = []
    async with trio.open_nursery() as nursery:
        for name, server in servers.items():
            ports[name] = await nursery.start(
                DataChannelServer(server, DataChannelConfig(rate_limit=cap)).run
            )
        control = DirectControl(servers, ports)
        start = trio.current_time()

        async def one(name: str, store: ShardStore) -> None:
            source = DataChannelSource(control.negotiate, control)
            peers = [p for p in servers if p != name]
            await fetch_version(
                store,
                signed,
                source,
                peers,
                config=FetchConfig(concurrency=4, stall_timeout=60.0, have_refresh=0.1),
                rng=random.Random(name),
            )
            source.close()
            done.append(trio.current_time() - start)

        async with trio.open_nursery() as receivers:
            for name, store in stores.items():
                receivers.start_soon(one, name, store)
        nursery.cancel_scope.cancel()
    for store in stores.values():
        shutil.rmtree(store.root)
    return max(done)


# --- libp2p ---------------------------------------------------------------------------------
async def libp2p_run(
    workdir: Path,
    trainer: ShardStore,
    signed: Signed[ShardManifest],
    key: NodeKey,
    genesis: Signed[RunGenesis],
) -> dict[str, float]:
    """Two real nodes in this process: the trainer serves, the other fetches over the shard
    stream (Noise + yamux, 4 MiB pieces), then over a data channel negotiated on the stream."""
    from node.runtime import Node, RuntimeConfig
    from swarm.shardcast.streams import StreamShardSource, serve_shardcast

    loopback = ("/ip4/127.0.0.1/tcp/0",)
    out: dict[str, float] = {}
    config = RuntimeConfig(key=key, genesis=genesis, role="trainer", listen=loopback)
    async with Node.start(config) as seeder, trio.open_nursery() as nursery:
        server = ShardServer(trainer)
        channel = DataChannelServer(server)
        await nursery.start(channel.run)
        serve_shardcast(seeder, server, channel)
        rx_config = RuntimeConfig(
            key=NodeKey.generate(),
            genesis=genesis,
            role="inference",
            listen=loopback,
            bootstrap=seeder.overlay.addrs()[:1],
        )
        async with Node.start(rx_config) as rx:
            for name, use_channel in (("stream", False), ("channel", True)):
                source = StreamShardSource(rx, data_channel=use_channel)
                store = ShardStore(workdir / f"libp2p-{name}")
                start = time.perf_counter()
                await fetch_version(
                    store,
                    signed,
                    source,
                    [seeder.peer_id],
                    config=FetchConfig(stall_timeout=60.0),
                    rng=random.Random(0),
                )
                out[name] = signed.message.total_size / MIB / (time.perf_counter() - start)
                source.close()
                shutil.rmtree(store.root)
        nursery.cancel_scope.cancel()
    return out


# --- main -----------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--shard-mib", type=int, default=32)
    parser.add_argument("--cap-mib", type=float, default=32.0, help="per-seeder cap C")
    parser.add_argument("--reserve-cap-mib", type=float, default=64.0, help="upload cap per node")
    parser.add_argument("--receivers", type=int, default=6)
    parser.add_argument("--files", type=int, default=1, help="a sharded model of N files")
    parser.add_argument("--no-reserve", action="store_true", help="skip the re-serving runs")
    default_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    parser.add_argument("--dir", default=default_dir, help="where stores go (default: tmpfs)")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "raw":
        port, total = json.loads(args.spec)
        print(json.dumps(raw_receiver(port, total)))
        return
    if args.role == "receiver":
        print(json.dumps(trio.run(receiver, json.loads(Path(args.spec).read_text()))))
        return

    console = Console()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # peers' DHT chatter, not ours
    with tempfile.TemporaryDirectory(prefix="bench-shardcast-", dir=args.dir) as tmp:
        workdir = Path(tmp)
        ckpt = workdir / "policy.safetensors"
        files = make_checkpoint(ckpt, args.size_mib * MIB, args.files)
        trainer_key = NodeKey.generate()
        g = genesis_for(trainer_key)
        trainer = ShardStore(workdir / "trainer")
        signed = publish(
            files,
            key=trainer_key,
            genesis=g,
            version=1,
            store=trainer,
            shard_size=args.shard_mib * MIB,
        )
        for f in files:
            f.unlink()
        total = signed.message.total_size
        data_path = trainer.directory(1) / "data"
        console.print(
            f"checkpoint {total / MIB:.0f} MiB, {len(signed.message.shard_hashes)} shards"
        )

        raw = measure_raw(data_path, total)
        console.print(f"raw socket copy + sha256: {raw:.0f} MiB/s")
        pulls = {}
        rss = 0.0
        for n in (1, 2, 4):
            r = trio.run(pull_run, workdir, trainer, signed, n, None)
            pulls[str(n)] = round(r["mib_s"], 1)
            rss = max(rss, r["peak_rss_mib"])
            console.print(
                f"pull from {n}: {r['mib_s']:.0f} MiB/s, peak RSS {r['peak_rss_mib']:.0f} MiB"
            )
        cap = args.cap_mib * MIB
        limited = trio.run(pull_run, workdir, trainer, signed, 4, cap)
        efficiency = limited["mib_s"] / (4 * args.cap_mib)
        console.print(f"4 seeders capped at {args.cap_mib:g} MiB/s: {limited['mib_s']:.1f} MiB/s")
        libp2p = trio.run(libp2p_run, workdir, trainer, signed, trainer_key, g)
        console.print(
            f"libp2p shard stream: {libp2p['stream']:.0f} MiB/s; data channel negotiated on"
            f" libp2p: {libp2p['channel']:.0f} MiB/s"
        )
        split_s = 0.0
        if args.files > 1:
            # What a holder does once a sharded version is complete: split it into its files.
            began = time.perf_counter()
            split_files(trainer.directory(1), signed.message)
            split_s = time.perf_counter() - began
            console.print(f"split into {args.files} files: {split_s:.2f} s")
        origin_only = reserving = float("nan")
        if not args.no_reserve:
            rcap = args.reserve_cap_mib * MIB
            n = args.receivers
            origin_only = trio.run(reserve_run, workdir, trainer, signed, n, rcap, False)
            console.print(f"origin-only, {args.receivers} receivers: {origin_only:.1f} s")
            reserving = trio.run(reserve_run, workdir, trainer, signed, n, rcap, True)
            console.print(f"every holder serves: {reserving:.1f} s")

    best = max(pulls.values())
    shard_mib = args.shard_mib
    result = {
        "raw_limit_mib_s": round(raw, 1),
        "pull_mib_s": pulls,
        "ratio_vs_raw": round(best / raw, 3),
        "rate_limited_efficiency": round(efficiency, 3),
        "rate_limited_cap_mib_s": args.cap_mib,
        "rate_limited_aggregate_mib_s": round(limited["mib_s"], 1),
        "reserve_speedup": None if args.no_reserve else round(origin_only / reserving, 3),
        "reserve_origin_only_s": None if args.no_reserve else round(origin_only, 2),
        "reserve_every_holder_s": None if args.no_reserve else round(reserving, 2),
        "reserve_receivers": args.receivers,
        "reserve_cap_mib_s": args.reserve_cap_mib,
        "receiver_peak_rss_mib": round(rss, 1),
        "libp2p_stream_pull_mib_s": round(libp2p["stream"], 1),
        "libp2p_negotiated_channel_pull_mib_s": round(libp2p["channel"], 1),
        "receiver_rss_goal_mib": 2 * shard_mib + 200,
        "size_mib": args.size_mib,
        "files": args.files,
        "split_s": round(split_s, 3),
        "split_mib_s": round(total / MIB / split_s, 1) if split_s else None,
        "shard_mib": shard_mib,
        "store_dir": args.dir or tempfile.gettempdir(),
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        ),
    }
    table = Table(title="SHARDCAST on loopback")
    table.add_column("measure")
    table.add_column("figure", justify="right")
    table.add_column("goal", justify="right")
    goals = {
        "ratio_vs_raw": ">= 0.5",
        "rate_limited_efficiency": ">= 0.8",
        "reserve_speedup": ">= 1.7",
        "receiver_peak_rss_mib": f"<= {2 * shard_mib + 200}",
    }
    for key, value in result.items():
        table.add_row(key, json.dumps(value), goals.get(key, ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    console.print(table)


if __name__ == "__main__":
    main()
