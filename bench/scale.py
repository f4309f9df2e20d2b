"""Scale on one machine: N inference nodes, 2 bootstrap peers and a publisher on 127.0.0.1.

    .venv/bin/python bench/scale.py [--nodes 25,50,100] [--size-mib 64] [--shard-mib 32]
        [--per-process 10] [--json PATH] [--dir DIR] [--quick] [--announce-only]

For each N: real node processes (``bench/scale_node.py``: ``Node`` + ``PolicyFeed``, no compute),
``--per-process`` nodes sharing one process and trio loop (``nodes_per_process`` in the JSON).
Once every node has found the publisher and the swarm has settled, it measures:

- ``single_transfer_s``: one node fetches a version of the same size from the publisher alone
  (``FetchResult.seconds``: manifest to last verified shard), nothing else moving;
- a new version is published (cut, sign, store, provider record, announcement: the trainer's
  path) and every node fetches it as a worker does; per node the time from the publisher's
  announcement to the node's gate accepting it (``announce_*``) and to its copy being complete
  (``shards_*``), at 50/95/100% of nodes;
- ``origin_share``: bytes the publisher served over bytes every holder served;
- ``lookup_p50_s``: uncached role lookups (providers, then adverts) by a sample of nodes;
- ``rss_mib_per_node``, ``cpu_s_per_node`` (whole run), ``idle_cpu_pct_per_node`` (5 s before the
  publish), ``connections_per_node`` (libp2p connections, mean; ``_max`` too), ``reach`` (how
  many nodes took themselves for public, private or unknown: a node that thinks it is private
  reserves relay slots and leaves the DHT's server mode);
- SHARDCAST's own counts: ``origin_manifests`` (manifests the publisher served),
  ``origin_busy_refusals`` / ``origin_elsewhere_refusals`` (upload slots full / super-seeding),
  ``stream_shards`` / ``channel_shards`` (the path the receivers' shards took), ``fetch_retries``;
- ``calibration`` for ``bench/scale_sim.py`` (when importable, its ``project`` runs on N = 100).

``--announce-only``: the nodes follow no announcement (no copy moves), so the announcement's
spread is measured without the copies' load (on 2 cores a 100-node copy saturates the machine
while the announcement is still spreading).

Every process is in a process group of its own, killed at the end; the temp dir is removed. The
stores go to /dev/shm when it has room (``--dir`` otherwise): this measures the network and the
CPU, not the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from scale_figures import (  # noqa: E402  (bench/ is not a package)
    MIB,
    calibration,
    figures,
    origin_share,
    pct,
    project,
    reach,
    render,
)

__all__ = ["calibration", "figures", "origin_share", "pct", "project", "reach", "render"]


# --- processes ---------------------------------------------------------------------------------
class Proc:
    """One child: commands on stdin, JSON events from stdout."""

    def __init__(self, proc: trio.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.events: dict[str, list[dict[str, Any]]] = {}
        self.changed = trio.Event()

    async def read(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        while True:
            data = await self.proc.stdout.receive_some(65536)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    self.events.setdefault(event["ev"], []).append(event)
                    self.changed.set()
                    self.changed = trio.Event()

    async def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(json.dumps(cmd).encode() + b"\n")

    async def wait(self, ev: str, count: int = 1) -> list[dict[str, Any]]:
        while len(self.events.get(ev, ())) < count:
            if self.proc.returncode is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before {ev}")
            with trio.move_on_after(1):
                await self.changed.wait()
        return self.events[ev]

    def usage(self) -> tuple[float, float]:
        """(resident MiB, CPU seconds) of the process, from /proc."""
        pid = self.proc.pid
        try:
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGESIZE")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return 0.0, 0.0
        return rss / MIB, cpu


def make_version(path: Path, size: int) -> None:
    """A safetensors file of ``size`` bytes (one u8 tensor of random bytes)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}})
    body = size - 8 - len(header) - 64
    header = json.dumps({"w": {"dtype": "U8", "shape": [body], "data_offsets": [0, body]}})
    header += " " * ((8 - (8 + len(header)) % 8) % 8)
    with path.open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header.encode())
        left = body
        while left > 0:
            block = min(left, 4 * MIB)
            f.write(os.urandom(block))
            left -= block


def work_dir(base: str | None, need: int) -> Path:
    if base is None:
        shm = Path("/dev/shm")
        if shm.is_dir() and shutil.disk_usage(shm).free > 2 * need:
            base = str(shm)
    return Path(tempfile.mkdtemp(prefix="swarm-scale-", dir=base))


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def spawn(
    nursery: trio.Nursery, spec: Path, name: str, *args: str, root: Path = ROOT
) -> Proc:
    """A ``scale_node.py`` process of the code at ``root`` (another checkout, for
    ``bench/idle.py --baseline``: its ``swarm``, ``node`` and ``bench`` are imported first)."""
    cmd = [sys.executable, str(root / "bench" / "scale_node.py"), "--spec", str(spec), *args]
    env = os.environ | {"PYTHONPATH": str(root)} if root != ROOT else None
    proc = await trio.lowlevel.open_process(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=root,
        env=env,
        start_new_session=True,  # its own process group: killed whole at the end
    )
    child = Proc(proc, name)
    nursery.start_soon(child.read)
    return child


async def start_publisher(
    nursery: trio.Nursery,
    spec: dict[str, Any],
    spec_path: Path,
    procs: list[Proc],
    root: Path = ROOT,
) -> tuple[Proc, dict[str, Any]]:
    """Two bootstrap peers (the second dials the first; their addresses go into the spec),
    then the publisher; returns it and its ``up`` event."""
    spec["boot_addrs"] = []
    for i in range(2):
        boot = await spawn(
            nursery, spec_path, f"boot-{i}", "--role", "boot", "--index", str(i), root=root
        )
        procs.append(boot)
        with trio.fail_after(60):
            spec["boot_addrs"].append((await boot.wait("up"))[0]["addr"])
        spec_path.write_text(json.dumps(spec))
    pub = await spawn(nursery, spec_path, "pub", "--role", "pub", root=root)
    procs.append(pub)
    with trio.fail_after(60):
        return pub, (await pub.wait("up"))[0]


async def start_groups(
    nursery: trio.Nursery,
    spec_path: Path,
    n: int,
    per_process: int,
    procs: list[Proc],
    stagger_s: float = 0.0,
    timeout_s: float = 180.0,
    root: Path = ROOT,
) -> list[Proc]:
    """``n`` nodes, ``per_process`` to a process, ``stagger_s`` apart (contributors do not all
    join in one second); returns once every process says it is up."""
    groups: list[Proc] = []
    per = max(1, per_process)
    for first in range(0, n, per):
        count = min(per, n - first)
        g = await spawn(
            nursery, spec_path, f"group-{first}", "--role", "group",
            "--index", str(first), "--count", str(count), root=root,
        )  # fmt: skip
        groups.append(g)
        procs.append(g)
        await trio.sleep(stagger_s)
    with trio.fail_after(timeout_s):
        for g in groups:
            await g.wait("up")
    return groups


def kill_all(procs: list[Proc]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.proc.pid, signal.SIGKILL)


def write_spec(base: Path, params: Any = None) -> tuple[dict[str, Any], Path]:
    """The bench run's genesis (the publisher its trainer; ``params``: ``RunParams`` or the
    defaults) and the spec every node process reads, written under ``base``."""
    from scale_node import key_for

    from node.run import create_genesis, write_genesis

    extra = {} if params is None else {"params": params}
    genesis = create_genesis(
        key_for("owner"),
        name="bench-scale",
        trainers=[key_for("pub").peer_id],
        validators=[key_for("validator").peer_id],
        created_at=1,
        **extra,
    )
    write_genesis(genesis, base / "run.genesis")
    spec_path = base / "spec.json"
    spec: dict[str, Any] = {"genesis": str(base / "run.genesis"), "dir": str(base)}
    spec_path.write_text(json.dumps(spec))
    return spec, spec_path


async def run_n(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One swarm of ``n`` nodes, measured and torn down."""
    from swarm.messages import RunParams

    size, shard = args.size_mib * MIB, args.shard_mib * MIB
    base = work_dir(args.dir, n * size * 2)
    procs: list[Proc] = []
    began = time.monotonic()
    try:
        spec, spec_path = write_spec(base, RunParams(shard_size=shard))
        if args.announce_only:  # the nodes hear versions and copy none (scale_node.py)
            spec["follow"] = False
            spec_path.write_text(json.dumps(spec))
        for v in (1, 2):
            make_version(base / f"v{v}.safetensors", size)
        version_bytes = (base / "v2.safetensors").stat().st_size
        async with trio.open_nursery() as nursery:
            pub, pub_up = await start_publisher(nursery, spec, spec_path, procs)
            pub_peer = pub_up["peer"]
            # One transfer between two nodes, nothing else running: the publisher and a
            # probe node of its own process (stopped before the N nodes start).
            probe = await spawn(nursery, spec_path, "probe", "--role", "group", "--index", "999")
            procs.append(probe)
            with trio.fail_after(60):
                await probe.wait("up")
            await pub.send(cmd="cut", v=1, path=str(base / "v1.safetensors"))
            with trio.fail_after(120):
                await pub.wait("cut")
            await probe.send(cmd="single", v=1, addrs=pub_up["addrs"], **{"from": pub_peer})
            try:
                with trio.fail_after(120):
                    single = (await probe.wait("single"))[0]
            finally:
                for e in probe.events.get("single_retry", ()):
                    log(f"N={n}: single transfer retried: {e['why'][:150]} {e['causes']}")
                kill_all([probe])
            log(f"N={n}: single transfer {single['s']:.2f} s; starting {n} nodes")
            groups = await start_groups(
                nursery, spec_path, n, args.per_process, procs, args.stagger, args.start_timeout
            )
            log(f"N={n}: {n} nodes up in {time.monotonic() - began:.1f} s; settling")
            await trio.sleep(args.settle)
            before = [p.usage()[1] for p in groups]
            await trio.sleep(5)
            idle_cpu = sum(p.usage()[1] - b for p, b in zip(groups, before, strict=True)) / 5
            log(f"N={n}: publishing v2")

            await pub.send(cmd="publish", v=2, path=str(base / "v2.safetensors"))
            with trio.fail_after(120):
                published = (await pub.wait("published"))[0]
            t_ann = published["t_ann"]
            deadline = trio.current_time() + args.fetch_timeout
            wanted = "announced" if args.announce_only else "fetched"
            while trio.current_time() < deadline:
                done = sum(1 for g in groups for e in g.events.get(wanted, ()) if e["v"] == 2)
                if done >= n:
                    break
                await trio.sleep(0.2)
            announced = [
                e["t"] - t_ann for g in groups for e in g.events.get("announced", ()) if e["v"] == 2
            ]
            fetched_ev = [e for g in groups for e in g.events.get("fetched", ()) if e["v"] == 2]
            failures = [e["why"] for g in groups for e in g.events.get("failed", ()) if e["v"] == 2]
            if fetched_ev:
                fs = sorted(e["fetch_s"] or 0 for e in fetched_ev)
                log(f"N={n}: fetch_version itself took {fs[0]:.2f}..{fs[-1]:.2f} s")
            traces = [e for g in groups for e in g.events.get("trace", ())]
            for what in ("providers", "advertise"):
                ts = sorted(e["s"] for e in traces if e["what"] == what)
                if ts:
                    log(
                        f"N={n}: {what} {len(ts)} calls, median"
                        f" {statistics.median(ts):.2f} s, max {ts[-1]:.2f} s"
                    )
            log(f"N={n}: {len(fetched_ev)}/{n} fetched, {len(failures)} failed; lookups")

            for g in groups:
                await g.send(cmd="lookup", nodes=args.lookup_nodes, rounds=2)
            lookups: list[float] = []
            trainer_found: list[int] = []
            with trio.move_on_after(60):
                for g in groups:
                    answer = (await g.wait("lookup"))[0]
                    lookups += answer["ms"]
                    trainer_found += answer["trainer_found"]
            stats: dict[str, list[dict[str, Any]]] = {}
            for p in [pub, *groups]:
                await p.send(cmd="stats")
            with trio.fail_after(60):
                for p in [pub, *groups]:
                    stats[p.name] = (await p.wait("stats"))[-1]["nodes"]
            usage = [p.usage() for p in groups]
            pub_usage = pub.usage()
            nursery.cancel_scope.cancel()
    finally:
        kill_all(procs)
        shutil.rmtree(base, ignore_errors=True)
    node_stats = [s for g in groups for s in stats[g.name]]
    rates: dict[str, list[float]] = {"origin": [], "peers": []}
    for e in fetched_ev:
        for peer, rate in e["rates"].items():
            rates["origin" if peer == pub_peer else "peers"].append(rate)
    from_origin = sum(e["from"].get(pub_peer, 0) for e in fetched_ev)
    run = figures(
        n,
        announced=announced,
        fetched=[e["t"] - t_ann for e in fetched_ev],
        single_s=single["s"],
        origin_served=stats["pub"][0]["served_bytes"],
        served=[stats["pub"][0]["served_bytes"], *(s["served_bytes"] for s in node_stats)],
        lookups_ms=lookups,
        connections=[s["connections"] for s in node_stats],
        version_bytes=version_bytes,
    )
    run.update(
        nodes_per_process=max(1, args.per_process),
        processes=len(groups),
        rss_mib_per_node=sum(u[0] for u in usage) / n,
        rss_mib_per_process_max=max(u[0] for u in usage),
        cpu_s_per_node=sum(u[1] for u in usage) / n,
        idle_cpu_pct_per_node=100 * idle_cpu / n,
        publisher_rss_mib=pub_usage[0],
        publisher_connections=stats["pub"][0]["connections"],
        publisher_cpu_s=pub_usage[1],
        origin_share_received=from_origin
        / max(1, sum(sum(e["from"].values()) for e in fetched_ev)),
        mesh_per_node=statistics.fmean(s["mesh"] for s in node_stats) if node_stats else 0,
        reach=dict(Counter(s.get("reach", "?") for s in node_stats)),
        fetch_failures=failures[:5],
        fetch_retries=len(failures),
        origin_manifests=stats["pub"][0]["manifests_served"],
        origin_busy_refusals=stats["pub"][0]["busy_refusals"],
        origin_elsewhere_refusals=stats["pub"][0]["elsewhere_refusals"],
        stream_shards=sum(s["paths"].get("stream", 0) for s in node_stats),
        channel_shards=sum(s["paths"].get("data_channel", 0) for s in node_stats),
        trainer_lookups_found=f"{sum(1 for f in trainer_found if f)}/{len(trainer_found)}",
        publish_s=published["t_ann"] - published["t0"],
        wall_s=time.monotonic() - began,
        load_average=os.getloadavg(),
        machine={"cpus": os.cpu_count(), "platform": platform.platform()},
    )
    run["calibration"] = calibration(run, rates, shard)
    return run


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    for n in args.nodes:
        log(f"N={n}: starting ({args.size_mib} MiB versions, {args.shard_mib} MiB shards)")
        runs[str(n)] = await run_n(n, args)
        r = runs[str(n)]
        log(
            f"N={n}: announce p95 {r['announce_p95_s']:.2f} s, shards p95 {r['shards_p95_s']:.1f} s"
            f" ({r['shards_p95_over_single']:.1f}x single), origin {r['origin_share']:.1%}"
        )
        if args.json:
            partial = {"runs": runs, "sim_error_at_100": None, "projection": {}}
            Path(args.json).write_text(json.dumps(partial, indent=1, default=str))
    return {"runs": runs, **project(runs)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="25,50,100", help="comma-separated N values")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--shard-mib", type=int, default=4)
    parser.add_argument("--per-process", type=int, default=10)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--stagger", type=float, default=3.0, help="s between node processes")
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--fetch-timeout", type=float, default=90.0)
    parser.add_argument("--lookup-nodes", type=int, default=2)
    parser.add_argument(
        "--announce-only",
        action="store_true",
        help="the nodes hear the announcement and copy nothing (announce figures alone)",
    )
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.nodes = [int(x) for x in str(args.nodes).split(",")]
    sys.path.insert(0, str(BENCH))
    result = trio.run(main_async, args)
    render(result["runs"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
