"""Membership on loopback, one process per node: ``bench/membership.py --procs`` runs it.

The parent runs the bootstrap peer and starts one child per node (this file, run with
``--nodes N --index I --boot ADDR``); commands go to each child on stdin and events come back on
stdout as JSON lines. The figures and their meaning are those of ``bench/membership.py``; here
each node has an event loop (and, up to the machine's cores, a core) of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import trio
from membership import (
    DIAL,
    LOOPBACK,
    PHASES,
    figures,
    genesis_and_keys,
    key_named,
    lookup_rounds,
    quiet_logs,
    roles_for,
)

from bootstrap.service import BootstrapConfig, BootstrapPeer
from node.runtime import Node, RuntimeConfig


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def child(n: int, index: int, boot_addr: str) -> None:
    """One node in its own process; commands on stdin, events on stdout (JSON lines).
    Event times are ``time.monotonic()``, one clock for all processes (``trio.current_time``
    has a random offset per run)."""
    genesis, keys = genesis_and_keys(n)
    roles = roles_for(n)
    config = RuntimeConfig(
        key=keys[index],
        genesis=genesis,
        role=roles[index],  # type: ignore[arg-type]
        listen=LOOPBACK,
        bootstrap=(boot_addr,),
        dial=DIAL,
    )
    began = trio.current_time()
    async with Node.start(config) as node, trio.open_nursery() as nursery:
        node.policy.on_change(
            lambda s: _say({"ev": "policy", "v": s.message.version, "t": time.monotonic()})
        )
        _say({"ev": "up"})

        async def first() -> None:
            while not any(node.peers_by_role().values()):
                await trio.sleep(0.005)
            _say({"ev": "first", "s": trio.current_time() - began})

        nursery.start_soon(first)
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        buf = b""
        while True:
            data = await stdin.receive_some(4096)
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                if cmd["cmd"] == "view":
                    found = {p for peers in node.peers_by_role().values() for p in peers}
                    _say({"ev": "view", "n": len(found)})
                elif cmd["cmd"] == "lookup":
                    PHASES["providers"].clear()
                    PHASES["adverts"].clear()
                    ms, incomplete = await lookup_rounds(node, cmd["rounds"], roles)
                    _say({"ev": "lookup", "ms": ms, "incomplete": incomplete, **PHASES})
                elif cmd["cmd"] == "announce":
                    t0 = time.monotonic()
                    version = int(cmd["v"])
                    await node.announce_policy(version, hashlib.sha256(bytes([version])).digest())
                    _say({"ev": "announced", "v": version, "t": t0})
        nursery.cancel_scope.cancel()


class Child:
    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
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
                event = json.loads(line)
                self.events.setdefault(event["ev"], []).append(event)
                self.changed.set()
                self.changed = trio.Event()

    async def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(json.dumps(cmd).encode() + b"\n")

    async def wait(self, ev: str, count: int = 1) -> list[dict[str, Any]]:
        while len(self.events.get(ev, ())) < count:
            await self.changed.wait()
        return self.events[ev]


async def bench_procs(n: int, rounds: int) -> dict[str, Any]:
    children: list[Child] = []
    async with (
        BootstrapPeer.start(BootstrapConfig(key=key_named("boot"), listen=LOOPBACK)) as boot,
        trio.open_nursery() as nursery,
    ):
        boot_addr = boot.addrs()[0]
        argv = [sys.executable, __file__, "--nodes", str(n), "--boot", boot_addr]
        try:
            for i in range(n):
                proc = await trio.lowlevel.open_process(
                    [*argv, "--index", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
                )
                child_ = Child(proc)
                children.append(child_)
                nursery.start_soon(child_.read)
                with trio.fail_after(60):
                    await child_.wait("up")
            with trio.fail_after(120):
                for c in children[1:]:
                    await c.wait("first")
            started_all = trio.current_time()
            with trio.fail_after(180):
                while True:
                    asked = [len(c.events.get("view", ())) + 1 for c in children]
                    for c in children:
                        await c.send(cmd="view")
                    pairs = zip(children, asked, strict=True)
                    views = [(await c.wait("view", k))[-1] for c, k in pairs]
                    if all(v["n"] >= n - 1 for v in views):
                        break
                    await trio.sleep(0.2)
            full_view_s = trio.current_time() - started_all

            sequential: list[float] = []
            providers: list[float] = []
            adverts: list[float] = []
            incomplete = 0
            for c in children:
                await c.send(cmd="lookup", rounds=rounds)
                answer = (await c.wait("lookup", 1))[-1]
                sequential += answer["ms"]
                providers += answer["providers"]
                adverts += answer["adverts"]
                incomplete += answer["incomplete"]
            for c in children:
                await c.send(cmd="lookup", rounds=rounds)
            concurrent: list[float] = []
            for c in children:
                answer = (await c.wait("lookup", 2))[-1]
                concurrent += answer["ms"]
                incomplete += answer["incomplete"]

            gossip_ms: list[float] = []
            missing = 0
            missed: dict[str, list[int]] = {}
            trainer = children[0]
            for version in range(1, rounds + 1):
                await trainer.send(cmd="announce", v=version)
                t0 = (await trainer.wait("announced", version))[-1]["t"]
                with trio.move_on_after(10):
                    for c in children[1:]:
                        while not any(e["v"] == version for e in c.events.get("policy", ())):
                            await c.changed.wait()
                for i, c in enumerate(children[1:], start=1):
                    times = [e["t"] for e in c.events.get("policy", ()) if e["v"] == version]
                    if times:
                        gossip_ms.append((times[0] - t0) * 1000)
                    else:
                        missing += 1
                        missed.setdefault(str(version), []).append(i)
                await trio.sleep(1.5)
            answers = [c.events["first"][0]["s"] for c in children[1:]]
        finally:
            for c in children:
                if c.proc.stdin is not None:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await c.proc.stdin.aclose()
            with trio.move_on_after(20):
                for c in children:
                    await c.proc.wait()
            for c in children:
                if c.proc.returncode is None:
                    c.proc.kill()
            nursery.cancel_scope.cancel()
    return {
        "mode": "one process per node",
        **figures(
            n,
            rounds,
            answers=answers,
            full_view_s=full_view_s,
            sequential=sequential,
            providers=providers,
            adverts=adverts,
            concurrent=concurrent,
            incomplete=incomplete,
            gossip_ms=gossip_ms,
            missing=missing,
            missed=missed,
        ),
    }


def child_main() -> None:
    parser = argparse.ArgumentParser(description="One node of bench/membership.py --procs.")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--boot", required=True)
    args = parser.parse_args()
    quiet_logs()
    trio.run(child, args.nodes, args.index, args.boot)


if __name__ == "__main__":
    child_main()
