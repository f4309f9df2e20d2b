"""The node processes of ``bench/scale.py``: bootstrap peers, the publisher, groups of nodes.

    python bench/scale_node.py --spec SPEC.json --role boot|pub|group [--index I] [--count K]

Every node is a real ``node.runtime.Node`` (libp2p host, Kademlia DHT, GossipSub, membership)
with a real ``node.policy_feed.PolicyFeed`` (SHARDCAST store, serving over streams and the data
channel, provider records, fetching); nothing computes: there is no compute child and no role
loop. What the bench adds lives here and nowhere in the product:

- ``pub`` is a genesis trainer that publishes a file of fixed size through
  ``PolicyFeed.publish`` (cut, sign, store, provider record, announcement): the trainer's own
  path, without training;
- a ``group`` runs ``--count`` inference nodes in one process and trio loop (``nodes_per_process``
  in the report); each follows every announcement the way a worker does (``feed.fetch``);
- commands come on stdin, events go to stdout as JSON lines; event times are
  ``time.monotonic()``, one clock for every process on the machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.policy_feed import PolicyFeed
from node.run import load_genesis
from node.runtime import Node, RuntimeConfig
from swarm.errors import SwarmError
from swarm.identity import NodeKey
from swarm.net import DialPolicy, role_provider_key
from swarm.shardcast.fetch import FetchConfig

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
DIAL = DialPolicy(attempts=5, timeout=10.0, backoff=0.5, max_backoff=2.0)


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def key_for(name: str) -> NodeKey:
    import hashlib

    return NodeKey.from_seed(hashlib.sha256(f"bench-scale/{name}".encode()).digest())


def quiet_logs() -> None:
    """Critical lines only; ``SCALE_NODE_LOG=LEVEL`` (e.g. ERROR) shows more, on stderr, for
    finding out why something failed at a large N."""
    level = getattr(logging, os.environ.get("SCALE_NODE_LOG", "CRITICAL").upper(), None)
    level = level if isinstance(level, int) else logging.CRITICAL
    logging.basicConfig(level=level)
    for name in ("libp2p", "multiaddr", "swarm", "node", "bootstrap"):
        logging.getLogger(name).setLevel(level)


async def commands() -> Any:
    """JSON commands from stdin until it closes."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buf = b""
    while True:
        data = await stdin.receive_some(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)


def feed_stats(node: Node, feed: PolicyFeed) -> dict[str, Any]:
    server = feed.service.server if feed.service is not None else None
    channel = feed.service.channel if feed.service is not None else None
    return {
        "peer": node.peer_id,
        "connections": len(node.overlay.connected_peers()),
        "mesh": len(node.overlay.mesh_peers(f"swarm-node/{node.run_id}/policy")),
        "reach": node.overlay.reach.status,
        "served_bytes": server.served_bytes if server else 0,
        "served_shards": server.served_shards if server else 0,
        "channel_connections": channel.connections if channel else 0,
        "manifests_served": server.manifests_served if server else 0,
        "busy_refusals": server.busy_refusals if server else 0,
        "elsewhere_refusals": server.elsewhere_refusals if server else 0,
        "paths": dict(feed.service.paths) if feed.service is not None else {},
    }


async def boot(spec: dict[str, Any], index: int) -> None:
    peers = spec.get("boot_addrs", [])[:1] if index > 0 else []
    config = BootstrapConfig(key=key_for(f"boot-{index}"), listen=LOOPBACK, peers=peers)
    async with BootstrapPeer.start(config) as peer:
        say({"ev": "up", "addr": peer.addrs()[0]})
        async for cmd in commands():
            if cmd["cmd"] == "stats":
                say({"ev": "stats", "nodes": [{"connections": peer.status()["connected_peers"]}]})


def node_config(spec: dict[str, Any], name: str, role: str) -> RuntimeConfig:
    return RuntimeConfig(
        key=key_for(name),
        genesis=load_genesis(Path(spec["genesis"])),
        role=role,  # type: ignore[arg-type]
        listen=LOOPBACK,
        bootstrap=tuple(spec["boot_addrs"]),
        dial=DIAL,
    )


def fetch_config(spec: dict[str, Any]) -> FetchConfig | None:
    """The product's (``PolicyFeed``'s) unless the spec says otherwise."""
    given = spec.get("fetch")
    return FetchConfig(**given) if given else None


async def pub(spec: dict[str, Any]) -> None:
    root = Path(spec["dir"]) / "pub"
    async with Node.start(node_config(spec, "pub", "trainer")) as node, trio.open_nursery() as n:
        feed = PolicyFeed(node, root / "shards", fetch=fetch_config(spec))
        await n.start(feed.run)
        announced: dict[int, float] = {}
        node.policy.on_change(lambda s: announced.setdefault(s.message.version, time.monotonic()))
        say({"ev": "up", "peer": node.peer_id, "addrs": node.overlay.addrs()})
        async for cmd in commands():
            if cmd["cmd"] == "publish":
                version, t0 = int(cmd["v"]), time.monotonic()
                await feed.publish(version, Path(cmd["path"]))
                say({"ev": "published", "v": version, "t0": t0, "t_ann": announced[version]})
            elif cmd["cmd"] == "cut":  # stored, served and advertised, not announced
                from swarm.shardcast import publish

                version = int(cmd["v"])
                cut = functools.partial(
                    publish,
                    Path(cmd["path"]),
                    key=node.key,
                    genesis=node.config.genesis,
                    version=version,
                    store=feed.store,
                )
                await trio.to_thread.run_sync(cut)
                assert feed.service is not None
                await feed.service.advertise(version)
                say({"ev": "cut", "v": version})
            elif cmd["cmd"] == "stats":
                say({"ev": "stats", "nodes": [feed_stats(node, feed)]})
        n.cancel_scope.cancel()


async def follow(node: Node, feed: PolicyFeed, i: int) -> None:
    """What a worker does with each announcement: fetch the version (``feed.fetch``)."""
    version = 1
    while True:
        announcement = await node.policy.wait_for(version)
        version = announcement.message.version
        try:
            await feed.fetch(announcement)
            peers = feed.service.progress.peers() if feed.service and feed.service.progress else []
            say(
                {
                    "ev": "fetched",
                    "i": i,
                    "v": version,
                    "t": time.monotonic(),
                    "fetch_s": feed.service.progress.elapsed
                    if feed.service and feed.service.progress
                    else None,
                    "from": {str(p["peer"]): p["bytes"] for p in peers if p["bytes"]},
                    "rates": {str(p["peer"]): p["rate_mib_s"] for p in peers if p["shards"]},
                }
            )
        except Exception as exc:  # as the worker does: back off, try the newest again
            say({"ev": "failed", "i": i, "v": version, "why": str(exc)[:300]})
            await trio.sleep(1.0)
            continue
        version += 1


def trace(feed: PolicyFeed, i: int) -> None:
    """``SCALE_TRACE=1``: time the service's provider lookups and advertisements."""

    async def wrap_later() -> None:
        while feed.service is None:
            await trio.sleep(0.01)
        service = feed.service
        for name in ("providers", "advertise"):
            inner = getattr(service, name)

            async def timed(*a: Any, _inner: Any = inner, _name: str = name) -> Any:
                t0 = time.monotonic()
                try:
                    return await _inner(*a)
                finally:
                    say({"ev": "trace", "i": i, "what": _name, "s": time.monotonic() - t0})

            setattr(service, name, timed)

    trio.lowlevel.spawn_system_task(wrap_later)


async def lookup(node: Node, role: str) -> tuple[float, int]:
    """One uncached role lookup as ``Membership.discover`` does it (providers, then their
    adverts): (milliseconds, members found with a valid advert)."""
    t0 = trio.current_time()
    peers = await node.overlay.records.find_providers(role_provider_key(node.run_id, role))  # type: ignore[arg-type]
    found = 0

    async def advert(peer: str) -> None:
        nonlocal found
        if await node.overlay.records.get_advert(node.run_id, peer) is not None:
            found += 1

    async with trio.open_nursery() as nursery:
        for peer in peers:
            if peer != node.peer_id:
                nursery.start_soon(advert, peer)
    return (trio.current_time() - t0) * 1000, found


async def profile(seconds: float, path: Path) -> None:
    """cProfile this process's trio loop (every node of the group) for ``seconds``; the stats
    go to ``path`` (``pstats`` format, read by ``bench/idle.py``)."""
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        await trio.sleep(seconds)
    finally:
        profiler.disable()
    profiler.dump_stats(str(path))


async def group(spec: dict[str, Any], first: int, count: int) -> None:
    root = Path(spec["dir"])
    nodes: list[tuple[Node, PolicyFeed]] = []

    async def one(i: int, task_status: Any) -> None:
        """Start node ``i`` and its feed, follow announcements; the nodes of a group start
        concurrently (each start waits on the network, not the CPU)."""
        async with Node.start(node_config(spec, f"node-{i}", "inference")) as node:
            feed = PolicyFeed(node, root / f"node-{i}" / "shards", fetch=fetch_config(spec))
            async with trio.open_nursery() as inner:
                await inner.start(feed.run)
                node.policy.on_change(
                    lambda s: say(
                        {"ev": "announced", "i": i, "v": s.message.version, "t": time.monotonic()}
                    )
                )
                if spec.get("follow", True):  # bench/scale.py --announce-only: no copies
                    inner.start_soon(follow, node, feed, i)
                if os.environ.get("SCALE_TRACE"):
                    trace(feed, i)
                nodes.append((node, feed))
                task_status.started()

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as starting:
            for i in range(first, first + count):
                starting.start_soon(nursery.start, one, i)
        say({"ev": "up"})
        async for cmd in commands():
            if cmd["cmd"] == "stats":
                say({"ev": "stats", "nodes": [feed_stats(n, f) for n, f in nodes]})
            elif cmd["cmd"] == "profile":  # cProfile the whole trio loop (bench/idle.py)
                await profile(float(cmd["s"]), Path(cmd["path"]))
                say({"ev": "profiled", "path": cmd["path"]})
            elif cmd["cmd"] == "lookup":  # bounded: the answer comes within 30 s
                ms: list[float] = []
                trainer_found: list[int] = []
                with trio.move_on_after(30):
                    for node, _ in nodes[: cmd.get("nodes", 2)]:
                        for role in ("trainer", "inference"):
                            took, found = await lookup(node, role)
                            ms.append(took)
                            if role == "trainer":
                                trainer_found.append(found)
                say({"ev": "lookup", "ms": ms, "trainer_found": trainer_found})
            elif cmd["cmd"] == "single":  # one node fetches one version from the publisher only
                node, feed = nodes[0]
                assert feed.service is not None
                t0 = time.monotonic()
                for attempt in range(3):  # a loaded box may miss one request's deadline
                    try:
                        await node.overlay.connect(cmd["from"], cmd["addrs"])
                        result = await feed.service.fetch(
                            int(cmd["v"]), config=feed.fetch_config, only=[cmd["from"]]
                        )
                    except SwarmError as exc:
                        why, cause = [], exc.__cause__ or exc.__context__
                        while cause is not None and len(why) < 4:
                            why.append(repr(cause)[:200])
                            cause = cause.__cause__ or cause.__context__
                        say({"ev": "single_retry", "why": str(exc)[:300], "causes": why})
                        if attempt == 2:
                            raise
                        continue
                    break
                say({"ev": "single", "s": result.seconds, "wall_s": time.monotonic() - t0})
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description="A node process of bench/scale.py.")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--role", choices=("boot", "pub", "group"), required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--count", type=int, default=1)
    args = parser.parse_args()
    quiet_logs()
    spec = json.loads(Path(args.spec).read_text())
    if args.role == "boot":
        trio.run(boot, spec, args.index)
    elif args.role == "pub":
        trio.run(pub, spec)
    else:
        trio.run(group, spec, args.index, args.count)


if __name__ == "__main__":
    main()
