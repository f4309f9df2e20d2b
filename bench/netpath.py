"""SHARDCAST between hosts in network namespaces: direct over veth, through a relay, after a hole
punch (needs root, ``ip`` and iptables).

    sudo .venv/bin/python bench/netpath.py --netns [--size-mib 256] [--nat-mib 32] [--json PATH]

Hosts (``tests/system/netns.py`` builds them): a public segment with a bootstrap peer (relay),
``seed`` and ``fetch``; ``natseed`` and ``natfetch`` each on a private network behind its own
masquerading router. Every node is its own process in its namespace.

- ``raw_mib_s``: one TCP connection seed -> fetch, ``sendfile`` on one side, ``recv_into`` +
  sha256 on the other: the ceiling of the veth path for a verified transfer, measured right
  after the direct pull with the same node processes running.
- ``direct_mib_s``: ``seed`` publishes a version (``shardcast publish``) and ``fetch`` pulls it
  from seed only (``ShardcastService.fetch(only=...)``, the real scheduler: per-shard sha256,
  writes at offset, journal); timed by the fetch itself. ``netns_ratio_vs_raw`` = direct / raw.
- ``relay_mib_s``: ``natseed`` publishes a smaller version (``--nat-mib``, below the relay's
  per-circuit cap) and ``natfetch`` pulls it from natseed only. The routers are Linux's default
  masquerade (an unsolicited SYN gets a RST), so DCUtR cannot punch: the bytes cross the relay.
- ``holepunch_mib_s``: both routers now drop unsolicited SYNs on their public side (as many
  home routers do), a fresh ``natfetch`` process waits until DCUtR has upgraded its connection
  to natseed to a direct one (``punch_s``), then pulls. ``null`` when no punch happened within
  ``--punch-wait`` seconds (recorded, not an error).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1024 * 1024
PUBLIC = {"boot": 1, "seed": 3, "fetch": 4, "routerA": 11, "routerB": 12}
PORT = 4001
RAW_PORT = 5555


# --- roles run inside a namespace -----------------------------------------------------------
def raw_serve(spec: dict[str, Any]) -> None:
    with socket.create_server((spec["host"], RAW_PORT)) as listener:
        print("ready", flush=True)
        conn, _ = listener.accept()
        with conn, open(spec["file"], "rb") as f:
            conn.sendfile(f)


def raw_recv(spec: dict[str, Any]) -> None:
    sock = socket.create_connection((spec["host"], RAW_PORT), timeout=60)
    buf = bytearray(MIB)
    view = memoryview(buf)
    h = hashlib.sha256()
    got, start = 0, time.perf_counter()
    while got < spec["total"]:
        n = sock.recv_into(view)
        if not n:
            break
        h.update(view[:n])
        got += n
    seconds = time.perf_counter() - start
    print(json.dumps({"bytes": got, "seconds": seconds}))


def fetch_role(spec: dict[str, Any]) -> None:
    import trio

    from node.home import NodeHome
    from node.run import load_genesis
    from node.runtime import Node, RuntimeConfig
    from node.shardcast import ShardcastService, open_store
    from swarm.shardcast import FetchConfig
    from swarm.shardcast.datachannel import DataChannelConfig

    home = NodeHome(Path(spec["home"]))
    genesis = load_genesis(Path(spec["genesis"]))
    store = open_store(home.path, genesis, None)
    config = RuntimeConfig(
        key=home.load_key(),
        genesis=genesis,
        role="inference",
        listen=(f"/ip4/{spec['ip']}/tcp/{spec['port']}",),
        bootstrap=(spec["boot"],),
        discover_every_s=1.0,
    )

    async def main() -> dict[str, Any]:
        src = spec["source"]
        async with (
            Node.start(config) as node,
            ShardcastService.start(
                node, genesis, store, data_channel=DataChannelConfig(spec["ip"], 0)
            ) as service,
        ):
            with trio.fail_after(90):
                while node.membership.advert_of(src) is None:
                    await trio.sleep(0.2)
                while await node.connect_peer(src) is not None:
                    await trio.sleep(1.0)
            punch_s = None
            if spec.get("punch_wait"):
                start = trio.current_time()
                with trio.move_on_after(spec["punch_wait"]):
                    while node.direct_path(src) is None:
                        await trio.sleep(0.25)
                    punch_s = trio.current_time() - start
            path = service.path_to(src)
            result = await service.fetch(1, config=FetchConfig(concurrency=4), only=[src])
            total = result.progress.total_bytes
            return {
                "mib_s": total / MIB / result.seconds,
                "seconds": result.seconds,
                "bytes": total,
                "path": path,
                "punch_s": punch_s,
                "paths": dict(service.paths),
            }

    print(json.dumps(trio.run(main)))


# --- the orchestrator -------------------------------------------------------------------------
class Bench:
    def __init__(self, work: Path, size_mib: int, nat_mib: int) -> None:
        from tests.system.netns import Namespaces, Private

        self.work = work
        self.size_mib, self.nat_mib = size_mib, nat_mib
        private = {"natseed": Private("routerB", 2), "natfetch": Private("routerA", 1)}
        self.net = Namespaces(PUBLIC, private)
        self.procs: list[subprocess.Popen[bytes]] = []

    def ns_cmd(self, host: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.net.names[host], *args]

    def py(self, host: str, *args: str) -> list[str]:
        return self.ns_cmd(host, sys.executable, *args)

    def spawn(self, host: str, args: list[str], log: str) -> subprocess.Popen[bytes]:
        from tests.system.netns import die_with_parent

        env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        with open(self.work / log, "ab") as out:
            proc = subprocess.Popen(
                self.py(host, "-m", "cli.app", *args),
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.procs.append(proc)
        return proc

    def role(self, host: str, role: str, spec: dict[str, Any], timeout: float = 300) -> Any:
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            self.py(host, __file__, "--role", role, "--spec", json.dumps(spec)),
            cwd=ROOT,
            env=env,
            capture_output=True,
            timeout=timeout,
            text=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{role} in {host} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=30)
        self.net.close()

    def run(self) -> dict[str, Any]:
        from bench.shardcast import make_checkpoint
        from node.home import NodeConfig, NodeHome
        from node.run import create_genesis, write_genesis

        self.net.__enter__()
        homes: dict[str, NodeHome] = {}
        keys = {}
        for name in ("owner", "boot", "seed", "fetch", "natseed", "natfetch", "natfetch2"):
            homes[name] = NodeHome(self.work / name)
            keys[name], _ = homes[name].create()
        ip = {h: self.net.ip(h.removesuffix("2")) for h in homes if h != "owner"}
        for name, home in homes.items():
            if name != "owner":
                port = PORT + (1 if name.endswith("2") else 0)
                home.save_config(NodeConfig(listen=(f"/ip4/{ip[name]}/tcp/{port}",)))
        boot_addr = f"/ip4/{ip['boot']}/tcp/{PORT}/p2p/{keys['boot'].peer_id}"
        runs = {}
        for seed in ("seed", "natseed"):
            genesis = create_genesis(
                homes["owner"].load_key(),
                name=f"netpath-{seed}",
                trainers=[keys[seed].peer_id],
                validators=[keys[seed].peer_id],
            )
            runs[seed] = self.work / f"{seed}.genesis"
            write_genesis(genesis, runs[seed])
        big, small = self.work / "big.safetensors", self.work / "small.safetensors"
        make_checkpoint(big, self.size_mib * MIB)
        make_checkpoint(small, self.nat_mib * MIB)

        self.spawn("boot", ["bootstrap", "--home", str(homes["boot"].path)], "boot.log")
        for seed, file, shard in (("seed", big, 32), ("natseed", small, 4)):
            args = ["shardcast", "publish", str(file), "--version", "1", "--run", str(runs[seed])]
            args += ["--shard-mib", str(shard), "--bootstrap", boot_addr, "--data-host", ip[seed]]
            self.spawn(seed, [*args, "--home", str(homes[seed].path)], f"{seed}.log")

        def fetch(host: str, seed: str, punch_wait: float = 0) -> dict[str, Any]:
            spec = {
                "home": str(homes[host].path),
                "genesis": str(runs[seed]),
                "ip": ip[host],
                "port": PORT + (1 if host.endswith("2") else 0),
                "boot": boot_addr,
                "source": keys[seed].peer_id,
                "punch_wait": punch_wait,
            }
            return dict(self.role(host.removesuffix("2"), "fetch", spec))

        direct = fetch("fetch", "seed")
        # Raw ceiling over the same veth path, right after the pull with
        # the same processes running (the publishers idle, serving).
        server = subprocess.Popen(
            self.py("seed", __file__, "--role", "raw-serve", "--spec", json.dumps(
                {"host": ip["seed"], "file": str(big)})),
            stdout=subprocess.PIPE,
        )  # fmt: skip
        assert server.stdout is not None
        server.stdout.readline()
        raw = self.role("fetch", "raw-recv", {"host": ip["seed"], "total": big.stat().st_size})
        server.wait(timeout=60)
        raw_mib_s = raw["bytes"] / MIB / raw["seconds"]

        relay = fetch("natfetch", "natseed")
        # Unsolicited SYNs to the routers are dropped instead of answered with a RST; SYNs that
        # match a NAT mapping (the punch) are translated and forwarded as before.
        for router in ("routerA", "routerB"):
            subprocess.run(
                self.ns_cmd(router, "iptables", "-A", "INPUT", "-i", "eth0", "-p", "tcp",
                            "--syn", "-j", "DROP"),
                check=True,
                timeout=20,
            )  # fmt: skip
        punched = fetch("natfetch2", "natseed", punch_wait=self.punch_wait)
        return {
            "raw_mib_s": round(raw_mib_s, 1),
            "direct_mib_s": round(direct["mib_s"], 1),
            "netns_ratio_vs_raw": round(direct["mib_s"] / raw_mib_s, 3),
            "relay_mib_s": round(relay["mib_s"], 2),
            "holepunch_mib_s": round(punched["mib_s"], 1) if punched["path"] == "direct" else None,
            "punch_s": None if punched["punch_s"] is None else round(punched["punch_s"], 1),
            "details": {"direct": direct, "relay": relay, "holepunch": punched},
        }

    punch_wait = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", action="store_true", help="required: build namespaces")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--nat-mib", type=int, default=32)
    parser.add_argument("--punch-wait", type=float, default=60.0)
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    roles = {"raw-serve": raw_serve, "raw-recv": raw_recv, "fetch": fetch_role}
    if args.role in roles:
        roles[args.role](json.loads(args.spec))
        return
    if not args.netns or os.geteuid() != 0:
        sys.exit("bench/netpath.py needs --netns and root (it builds network namespaces)")
    from tests.system.netns import nat_unavailable

    if (why := nat_unavailable()) is not None:
        sys.exit(why)
    work = Path(
        tempfile.mkdtemp(prefix="netpath-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    bench = Bench(work, args.size_mib, args.nat_mib)
    bench.punch_wait = args.punch_wait
    try:
        result = bench.run()
    finally:
        bench.close()
        shutil.rmtree(work, ignore_errors=True)
    result["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_avg": os.getloadavg(),
        "size_mib": args.size_mib,
        "nat_mib": args.nat_mib,
    }
    from rich.console import Console
    from rich.table import Table

    table = Table(title="SHARDCAST between namespaces")
    for col in ("path", "MiB/s", "note"):
        table.add_column(col)
    table.add_row("raw TCP + sha256 (veth)", str(result["raw_mib_s"]), "ceiling")
    table.add_row(
        "verified pull, direct", str(result["direct_mib_s"]),
        f"ratio {result['netns_ratio_vs_raw']} of raw",
    )  # fmt: skip
    table.add_row("through a relay", str(result["relay_mib_s"]), f"{args.nat_mib} MiB")
    table.add_row(
        "after a hole punch", str(result["holepunch_mib_s"]),
        f"punch took {result['punch_s']} s" if result["punch_s"] else "no punch",
    )  # fmt: skip
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
