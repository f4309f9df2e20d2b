"""run-files throughput on loopback: how fast a joining node fetches a model card's small files
(config, tokenizer.json of a few MiB, a data set of tens of MiB) from one peer over libp2p.

    .venv/bin/python bench/run_files.py [--json PATH] [--sizes-mib 1 8 64]

Two real nodes (and a bootstrap peer) in this process on 127.0.0.1, TCP + Noise + yamux: one
serves files of each size (``RunFileServer``), the other fetches each with ``fetch_file`` (4 MiB
requests, one stream each, written to ``.part`` and checked by sha256 before it is kept).
The v0 weights do not travel here but by SHARDCAST (bench/shardcast.py).

JSON keys: ``mib_s`` {size in MiB: MiB/s}, ``seconds`` {size: s}, ``chunk_mib``, ``machine``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.run import create_genesis
from node.run_files import CHUNK, RUN_FILES_LIMITS, RunFileServer, fetch_file
from node.runtime import Node, RuntimeConfig
from swarm.identity import NodeKey
from swarm.messages import FileRef
from swarm.net.names import RUN_FILES

MIB = 1024 * 1024
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


def key(name: str) -> NodeKey:
    return NodeKey.from_seed(hashlib.sha256(name.encode()).digest())


async def measure(root: Path, sizes_mib: list[float]) -> dict[str, Any]:
    owner, trainer, validator = key("owner"), key("trainer"), key("validator")
    genesis = create_genesis(
        owner, name="bench", trainers=[trainer.peer_id], validators=[validator.peer_id]
    )
    files: list[tuple[FileRef, Path]] = []
    for size in sizes_mib:
        path = root / f"file-{size:g}mib.bin"
        path.write_bytes(os.urandom(int(size * MIB)))
        data = path.read_bytes()
        files.append((FileRef(path.name, hashlib.sha256(data).digest(), len(data)), path))
    out: dict[str, Any] = {"mib_s": {}, "seconds": {}}
    async with BootstrapPeer.start(
        BootstrapConfig(key=key("boot"), listen=LOOPBACK, genesis=(genesis,))
    ) as boot:

        def config(k: NodeKey, role: str) -> RuntimeConfig:
            return RuntimeConfig(
                key=k,
                genesis=genesis,
                role=role,  # type: ignore[arg-type]
                listen=LOOPBACK,
                bootstrap=boot.addrs()[:1],
                heartbeat=0.2,
                discover_every_s=0.5,
            )

        async with (
            Node.start(config(trainer, "trainer")) as server_node,
            Node.start(config(key("joiner"), "inference")) as joiner,
        ):
            server = RunFileServer()
            for ref, path in files:
                server.add(ref, path)
            server_node.handle(RUN_FILES, server.handle, RUN_FILES_LIMITS)
            with trio.fail_after(30):
                while not joiner.peers_by_role().get("trainer"):
                    await trio.sleep(0.1)
            for (ref, _), size in zip(files, sizes_mib, strict=True):
                dest = root / "fetched" / ref.name
                start = time.perf_counter()
                await fetch_file(joiner, ref, dest, give_up_after=60)
                seconds = time.perf_counter() - start
                out["seconds"][f"{size:g}"] = round(seconds, 3)
                out["mib_s"][f"{size:g}"] = round(size / seconds, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as tmp:
        result = trio.run(measure, Path(tmp), args.sizes_mib)
    result["chunk_mib"] = CHUNK / MIB
    result["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    table = Table(title=f"run-files on loopback (one peer, {CHUNK // MIB} MiB answers)")
    for col in ("file MiB", "seconds", "MiB/s"):
        table.add_column(col, justify="right")
    for size, seconds in result["seconds"].items():
        table.add_row(size, f"{seconds:.3f}", f"{result['mib_s'][size]:.1f}")
    Console().print(table)
    print(f"load average (1 min): {result['machine']['load_avg_1m']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
