"""Membership on loopback: 16 nodes and a bootstrap peer, one trio run (one process).

    .venv/bin/python bench/membership.py [--json PATH] [--nodes 16] [--rounds 5] [--procs]

``--procs`` runs one process per node instead (``bench/membership_procs.py``).

What it measures (all nodes are real py-libp2p hosts on 127.0.0.1, TCP + Noise + yamux, the
runtime's defaults: gossip heartbeat 1 s, discovery every 3 s, found peers dialled):

- ``first_dht_answer_s``: per node, from calling ``Node.start`` (listen, dial the bootstrap
  peer, publish advert and provider record) to the first DHT answer naming another member
  (provider lookup, then that member's signed advert); median over nodes 2..N (the first node
  has nobody to find). ``first_dht_answer_s_max`` is the slowest.
- ``role_lookup_ms_*``: one role lookup as ``Membership.discover`` does it, without its cache:
  the providers of a role's key (local store plus the closest peers asked), then every
  provider's advert, fetched concurrently and checked. Every node looks up every role, rounds
  times, after all nodes see each other, one lookup at a time (the nodes' own discovery loops
  keep running). ``role_lookup_concurrent_ms_*``: the same with all 16 nodes looking up at
  once, which on one event loop mostly measures the queue for the one core.
- ``gossip_ms_*``: the trainer announces ``rounds`` policy versions, 1.5 s apart; for each node
  and version, the time from ``publish`` until that node's gate accepted it.

Everything shares one process and so one core of the machine: each figure includes waiting for
the other 16 nodes' work on the same event loop.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import resource
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.run import create_genesis
from node.runtime import Node, RuntimeConfig
from swarm.identity import NodeKey
from swarm.messages import PolicyAnnouncement, RunGenesis, Signed
from swarm.net import DialPolicy, role_provider_key
from swarm.net.membership import RUN_ROLES

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
GOALS = {"role_lookup_ms_p50": 100.0, "gossip_ms_p95": 250.0}
DIAL = DialPolicy(attempts=3, timeout=5.0, backoff=0.2, max_backoff=1.0)


def key_named(name: str) -> NodeKey:
    return NodeKey.from_seed(hashlib.sha256(f"bench-membership/{name}".encode()).digest())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def roles_for(n: int) -> list[str]:
    """One trainer, one validator, the rest inference workers."""
    return ["trainer", "validator", *["inference"] * (n - 2)]


def genesis_and_keys(n: int) -> tuple[Signed[RunGenesis], list[NodeKey]]:
    """The bench's run: node 0 trains, node 1 validates (``roles_for``)."""
    keys = [key_named(f"node-{i}") for i in range(n)]
    genesis = create_genesis(
        key_named("owner"),
        name="bench-membership",
        trainers=[keys[0].peer_id],
        validators=[keys[1].peer_id],
        created_at=1,
    )
    return genesis, keys


def quiet_logs() -> None:
    logging.basicConfig(level=logging.CRITICAL)
    for name in ("libp2p", "multiaddr", "swarm", "node", "bootstrap"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


PHASES: dict[str, list[float]] = {"providers": [], "adverts": []}


async def lookup_role(node: Node, role: Any) -> int:
    """One uncached role lookup; the number of members found with a valid advert."""
    t0 = trio.current_time()
    peers = await node.overlay.records.find_providers(role_provider_key(node.run_id, role))
    t1 = trio.current_time()
    PHASES["providers"].append((t1 - t0) * 1000)
    found = 0

    async def advert(peer: str) -> None:
        nonlocal found
        if peer != node.peer_id and await node.overlay.records.get_advert(node.run_id, peer):
            found += 1

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(advert, peer)
    PHASES["adverts"].append((trio.current_time() - t1) * 1000)
    return found


async def lookup_rounds(node: Node, rounds: int, roles: list[str]) -> tuple[list[float], int]:
    """``rounds`` lookups of every role, one at a time: latencies (ms), incomplete answers."""
    ms: list[float] = []
    incomplete = 0
    for _ in range(rounds):
        for role in RUN_ROLES:
            t0 = trio.current_time()
            found = await lookup_role(node, role)
            ms.append((trio.current_time() - t0) * 1000)
            if found < roles.count(role) - (1 if role == node.role else 0):
                incomplete += 1
    return ms, incomplete


def figures(
    n: int,
    rounds: int,
    *,
    answers: list[float],
    full_view_s: float,
    sequential: list[float],
    providers: list[float],
    adverts: list[float],
    concurrent: list[float],
    incomplete: int,
    gossip_ms: list[float],
    missing: int,
    missed: dict[str, list[int]],
) -> dict[str, Any]:
    """The result of either mode, from its raw samples."""
    return {
        "nodes": n,
        "rounds": rounds,
        "first_dht_answer_s": round(statistics.median(answers), 3),
        "first_dht_answer_s_max": round(max(answers), 3),
        "full_view_s": round(full_view_s, 3),
        "role_lookup_ms_p50": round(pct(sequential, 50), 1),
        "role_lookup_ms_p95": round(pct(sequential, 95), 1),
        "role_lookup_samples": len(sequential),
        "role_lookup_providers_ms_p50": round(pct(providers, 50), 1),
        "role_lookup_adverts_ms_p50": round(pct(adverts, 50), 1),
        "role_lookup_concurrent_ms_p50": round(pct(concurrent, 50), 1),
        "role_lookup_concurrent_ms_p95": round(pct(concurrent, 95), 1),
        "role_lookup_incomplete": incomplete,
        "gossip_ms_p50": round(pct(gossip_ms, 50), 1),
        "gossip_ms_p95": round(pct(gossip_ms, 95), 1),
        "gossip_samples": len(gossip_ms),
        "gossip_missing": missing,
        "gossip_missed_nodes_by_version": missed,
    }


async def bench(n: int, rounds: int) -> dict[str, Any]:
    roles = roles_for(n)
    genesis, keys = genesis_and_keys(n)
    first_answer: dict[int, float] = {}
    nodes: list[Node] = []
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(
            BootstrapPeer.start(BootstrapConfig(key=key_named("boot"), listen=LOOPBACK))
        )
        boot_addr = boot.addrs()[:1]
        watchers = await stack.enter_async_context(trio.open_nursery())

        async def watch(i: int, node: Node, began: float) -> None:
            while not any(node.peers_by_role().values()):
                await trio.sleep(0.005)
            first_answer[i] = trio.current_time() - began

        for i in range(n):
            began = trio.current_time()
            config = RuntimeConfig(
                key=keys[i],
                genesis=genesis,
                role=roles[i],  # type: ignore[arg-type]
                listen=LOOPBACK,
                bootstrap=boot_addr,
                dial=DIAL,
            )
            node = await stack.enter_async_context(Node.start(config))
            nodes.append(node)
            if i > 0:
                watchers.start_soon(watch, i, node, began)
        with trio.fail_after(120):
            while len(first_answer) < n - 1:
                await trio.sleep(0.05)
        started_all = trio.current_time()

        def everyone_sees_everyone() -> bool:
            for node in nodes:
                found = {p for peers in node.peers_by_role().values() for p in peers}
                if len(found) < n - 1:
                    return False
            return True

        with trio.fail_after(180):
            while not everyone_sees_everyone():
                await trio.sleep(0.1)
        full_view_s = trio.current_time() - started_all

        # Role lookups: every node, every role, `rounds` times (sequential per node, nodes
        # concurrently, as their discovery loops would be).
        lookup_ms: list[float] = []
        incomplete = 0

        async def lookups(node: Node) -> None:
            nonlocal incomplete
            ms, missed_roles = await lookup_rounds(node, rounds, roles)
            lookup_ms.extend(ms)
            incomplete += missed_roles

        for node in nodes:  # one lookup at a time: the latency of a lookup itself
            await lookups(node)
        phases = {k: list(v) for k, v in PHASES.items()}
        sequential_ms, lookup_ms = lookup_ms, []
        async with trio.open_nursery() as nursery:  # all nodes at once, as under churn
            for node in nodes:
                nursery.start_soon(lookups, node)
        concurrent_ms = lookup_ms

        # Gossip: the trainer announces `rounds` versions; every node timestamps acceptance.
        trainer = nodes[0]
        arrived: dict[tuple[int, int], float] = {}
        for i, node in enumerate(nodes):

            def on_change(signed: Signed[PolicyAnnouncement], i: int = i) -> None:
                arrived[(i, signed.message.version)] = trio.current_time()

            node.policy.on_change(on_change)
        gossip_ms: list[float] = []
        missing = 0
        missed: dict[str, list[int]] = {}
        for version in range(1, rounds + 1):
            t0 = trio.current_time()
            await trainer.announce_policy(version, hashlib.sha256(bytes([version])).digest())
            with trio.move_on_after(10):
                while not all((i, version) in arrived for i in range(1, n)):
                    await trio.sleep(0.005)
            for i in range(1, n):
                if (i, version) in arrived:
                    gossip_ms.append((arrived[(i, version)] - t0) * 1000)
                else:
                    missing += 1
                    missed.setdefault(str(version), []).append(i)
            await trio.sleep(1.5)

    answers = [first_answer[i] for i in sorted(first_answer)]
    return figures(
        n,
        rounds,
        answers=answers,
        full_view_s=full_view_s,
        sequential=sequential_ms,
        providers=phases["providers"],
        adverts=phases["adverts"],
        concurrent=concurrent_ms,
        incomplete=incomplete,
        gossip_ms=gossip_ms,
        missing=missing,
        missed=missed,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--procs", action="store_true", help="one process per node (default: one trio run)"
    )
    args = parser.parse_args()
    quiet_logs()
    if args.nodes < 3:
        parser.error("--nodes must be at least 3 (trainer, validator, one worker)")

    cpu0 = time.process_time()
    wall0 = time.monotonic()
    if args.procs:
        from membership_procs import bench_procs  # imports this module: no cycle at load

        result = trio.run(bench_procs, args.nodes, args.rounds)
    else:
        result = trio.run(bench, args.nodes, args.rounds)
    children_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu_s"] = round(
        time.process_time() - cpu0 + children_cpu.ru_utime + children_cpu.ru_stime, 1
    )
    result["wall_s"] = round(time.monotonic() - wall0, 1)
    result["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    result["goals"] = GOALS
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")

    mode = "one process per node" if args.procs else "one process"
    result.setdefault("mode", mode)
    table = Table(title=f"Membership on loopback ({args.nodes} nodes + bootstrap, {mode})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    for key in (
        "first_dht_answer_s",
        "first_dht_answer_s_max",
        "full_view_s",
        "role_lookup_ms_p50",
        "role_lookup_ms_p95",
        "role_lookup_concurrent_ms_p50",
        "role_lookup_concurrent_ms_p95",
        "role_lookup_incomplete",
        "gossip_ms_p50",
        "gossip_ms_p95",
        "gossip_missing",
        "cpu_s",
        "wall_s",
    ):
        goal = GOALS.get(key)
        table.add_row(key, str(result[key]), f"<= {goal:g}" if goal else "")
    Console().print(table)


if __name__ == "__main__":
    main()
