"""Network namespaces for system tests, and `swarm-node` processes inside them (needs root).

``Namespaces`` builds a public segment (a bridge in a namespace of its own, one namespace per
host, joined by veth pairs) and, optionally, private networks: a host behind a router host that
masquerades (iptables NAT), as at home. ``Swarm`` runs one CLI process per host and reads their
status and ledgers. Everything is deleted in ``close``, whatever state it is in.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from node import admin
from node.home import NodeConfig, NodeHome
from node.run import create_genesis, write_genesis
from swarm.errors import SwarmError
from swarm.ledger import LedgerStore
from swarm.messages import RunParams, run_id_of

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.0"
PORT = 4001


def ip_cmd(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies (a CI
    timeout, Ctrl-C twice), so no node outlives it inside a namespace nobody can see."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (the `ip` command)"
    probe = f"swnprobe{os.getpid()}"
    try:
        ip_cmd("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace here: {exc}"
    with contextlib.suppress(Exception):
        ip_cmd("netns", "del", probe)
    return None


def nat_unavailable() -> str | None:
    """Why a router namespace cannot masquerade here (``None`` when it can): iptables from
    Debian is installed on demand (``apt-get install -y iptables``)."""
    if shutil.which("iptables") is None and shutil.which("apt-get") is not None:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "iptables"], capture_output=True, timeout=300
        )
    if shutil.which("iptables") is None:
        return "needs iptables for the NAT routers (apt-get install -y iptables failed)"
    return None


@dataclasses.dataclass(frozen=True)
class Private:
    """A host on a private network 192.168.<lan>.0/24 behind ``router`` (a public host)."""

    router: str
    lan: int
    n: int = 2


class Namespaces:
    """A bridge in a namespace of its own and one namespace per public host, joined by veth
    pairs; each private host hangs off its router's namespace by a veth pair of its own, and
    the router masquerades what leaves its public link. ``close`` deletes every namespace (and
    with them the veth pairs), whatever state it is in."""

    def __init__(self, hosts: dict[str, int], private: dict[str, Private] | None = None) -> None:
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"swn{tag}br"
        self.private = private or {}
        self.names = {name: f"swn{tag}h{n}" for name, n in hosts.items()}
        self.names |= {name: f"swn{tag}p{p.lan}x{p.n}" for name, p in self.private.items()}
        self.hosts = hosts
        self.tag = tag
        self.created: list[str] = []

    def ip(self, name: str) -> str:
        if name in self.private:
            return f"192.168.{self.private[name].lan}.{self.private[name].n}"
        return f"{SUBNET}.{self.hosts[name]}"

    def __enter__(self) -> Namespaces:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        ip_cmd("netns", "add", self.bridge)
        self.created.append(self.bridge)
        ip_cmd("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        ip_cmd("-n", self.bridge, "link", "set", "br0", "up")
        for name, n in self.hosts.items():
            ns, host_end, bridge_end = self.names[name], f"sw{self.tag}a{n}", f"sw{self.tag}b{n}"
            ip_cmd("netns", "add", ns)
            self.created.append(ns)
            ip_cmd("link", "add", host_end, "type", "veth", "peer", "name", bridge_end)
            ip_cmd("link", "set", host_end, "netns", ns)
            ip_cmd("link", "set", bridge_end, "netns", self.bridge)
            ip_cmd("-n", ns, "link", "set", host_end, "name", "eth0")
            ip_cmd("-n", ns, "addr", "add", f"{self.ip(name)}/24", "dev", "eth0")
            ip_cmd("-n", ns, "link", "set", "eth0", "up")
            ip_cmd("-n", ns, "link", "set", "lo", "up")
            ip_cmd("-n", self.bridge, "link", "set", bridge_end, "master", "br0")
            ip_cmd("-n", self.bridge, "link", "set", bridge_end, "up")
        for name, p in self.private.items():
            self._build_private(name, p)

    def _build_private(self, name: str, p: Private) -> None:
        ns, router = self.names[name], self.names[p.router]
        inner, outer = f"sw{self.tag}i{p.lan}", f"sw{self.tag}o{p.lan}"
        lan = f"192.168.{p.lan}"
        ip_cmd("netns", "add", ns)
        self.created.append(ns)
        ip_cmd("link", "add", inner, "type", "veth", "peer", "name", outer)
        ip_cmd("link", "set", inner, "netns", ns)
        ip_cmd("link", "set", outer, "netns", router)
        ip_cmd("-n", ns, "link", "set", inner, "name", "eth0")
        ip_cmd("-n", ns, "addr", "add", f"{lan}.{p.n}/24", "dev", "eth0")
        ip_cmd("-n", ns, "link", "set", "eth0", "up")
        ip_cmd("-n", ns, "link", "set", "lo", "up")
        ip_cmd("-n", ns, "route", "add", "default", "via", f"{lan}.1")
        ip_cmd("-n", router, "link", "set", outer, "name", "lan0")
        ip_cmd("-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        ip_cmd("-n", router, "link", "set", "lan0", "up")
        in_ns = ["ip", "netns", "exec", router]
        subprocess.run(
            [*in_ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], check=True, timeout=20
        )
        subprocess.run(
            [*in_ns, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{lan}.0/24",
             "-o", "eth0", "-j", "MASQUERADE"],
            check=True,
            timeout=20,
        )  # fmt: skip

    def link(self, name: str, up: bool) -> None:
        """Take a host's link down (a partition) or up again, at the bridge."""
        port = f"sw{self.tag}b{self.hosts[name]}"
        ip_cmd("-n", self.bridge, "link", "set", port, "up" if up else "down")

    def close(self) -> None:
        for ns in reversed(self.created):
            with contextlib.suppress(Exception):
                ip_cmd("netns", "del", ns)
        ends = [f"sw{self.tag}a{n}" for n in self.hosts.values()]
        ends += [f"sw{self.tag}i{p.lan}" for p in self.private.values()]
        for end in ends:  # a veth end left in the root namespace by a failed build
            with contextlib.suppress(Exception):
                ip_cmd("link", "del", end)
        self.created.clear()


@dataclasses.dataclass
class Host:
    name: str
    ns: str
    addr: str
    home: Path
    log: Path
    args: list[str] = dataclasses.field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0


class Swarm:
    """The processes, one per host; every process is killed (its whole group) on close."""

    def __init__(
        self, net: Namespaces, root: Path, nodes: Sequence[str], params: RunParams
    ) -> None:
        self.net = net
        self.root = root
        self.hosts: dict[str, Host] = {}
        self.status_errors: dict[str, str] = {}
        owner, _ = NodeHome(root / "owner").create()
        peer_ids = {}
        for name in nodes:
            home = NodeHome(root / name)
            key, _ = home.create()
            listen = f"/ip4/{net.ip(name)}/tcp/{PORT}"
            home.save_config(NodeConfig(listen=(listen,)))
            peer_ids[name] = key.peer_id
            self.hosts[name] = Host(
                name,
                net.names[name],
                f"{listen}/p2p/{key.peer_id}",
                home.path,
                root / f"{name}.log",
            )
        genesis = create_genesis(
            owner,
            name="netns",
            trainers=[peer_ids["trainer"]],
            validators=[peer_ids["validator"]],
            params=params,
        )
        self.genesis = root / "run.genesis"
        write_genesis(genesis, self.genesis)
        self.run_id = run_id_of(genesis)

    def net_cmd(self, name: str, *args: str) -> list[str]:
        """``swarm-node ARGS`` in ``name``'s namespace (a command line for subprocess)."""
        return ["ip", "netns", "exec", self.net.names[name], sys.executable, "-m", "cli.app", *args]

    def start(self, name: str, args: list[str] | None = None) -> None:
        host = self.hosts[name]
        host.args = args or host.args
        env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        env.pop("SWARM_NODE_HOME", None)
        with host.log.open("ab") as log:
            host.proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    host.ns,
                    sys.executable,
                    "-m",
                    "cli.app",
                    *host.args,
                    "--home",
                    str(host.home),
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        host.starts += 1

    def join_args(self, role: str, bootstraps: list[str]) -> list[str]:
        args = ["join", "--role", role, "--run", str(self.genesis), "--wait"]
        for b in bootstraps:
            args += ["--bootstrap", self.hosts[b].addr]
        return args

    def kill9(self, name: str) -> None:
        proc = self.hosts[name].proc
        assert proc is not None and proc.poll() is None, f"{name} was not running"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the node and its compute child
        proc.wait(timeout=30)

    def assert_alive(self, *except_: str) -> None:
        """No process exited on its own (a crash shows here, not as a later timeout)."""
        for name, host in self.hosts.items():
            if name not in except_ and host.proc is not None and host.proc.poll() is not None:
                raise AssertionError(f"{name} exited ({host.proc.returncode}):\n{self.tail(name)}")

    def close(self) -> None:
        for host in self.hosts.values():
            if host.proc is not None and host.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(host.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.proc.wait(timeout=30)

    # --- looking at the nodes --------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any] | None:
        sock = admin.socket_path(self.hosts[name].home)
        try:
            answer = trio.run(admin.query, sock, {"cmd": "status"}, 5.0)
        except SwarmError as exc:
            self.status_errors[name] = str(exc)  # quoted if a wait times out
            return None
        self.status_errors.pop(name, None)
        return answer["status"]  # type: ignore[no-any-return]

    def run_dir(self, name: str) -> Path:
        return self.hosts[name].home / "runs" / self.run_id

    def ledger_ids(self, name: str) -> set[bytes]:
        path = self.run_dir(name) / "ledger.db"
        if not path.exists():
            return set()
        store = LedgerStore.open_existing(path)
        try:
            return store.ids()
        finally:
            store.close()

    def credited(self, name: str) -> list[bytes]:
        """The submission id of every counted credit in ``name``'s ledger (duplicates kept): a
        credit cites its verdict, which names the submission."""
        return [submission for submission, _ in self.credited_versions(name)]

    def credited_versions(self, name: str) -> list[tuple[bytes, int]]:
        """Counted credits of ``name``'s ledger: (submission id, its policy version)."""
        store = LedgerStore.open_existing(self.run_dir(name) / "ledger.db")
        try:
            credits = [e for e in store.events() if e.message.event == "credit"]
            facts = [
                store.verdict_facts(e.message.evidence) for e in credits if store.is_counted(e.id)
            ]
            return [(f.submission, f.policy_version) for f in facts if f is not None]
        finally:
            store.close()

    def queue_versions(self) -> list[int]:
        path = self.run_dir("trainer") / "samples.db"
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            return [int(v) for (v,) in db.execute("SELECT DISTINCT version FROM accepted")]

    def credits_of(self, name: str, worker: str) -> int:
        """How many credit events for ``worker``'s peer ID ``name``'s ledger holds."""
        path = self.run_dir(name) / "ledger.db"
        if not path.exists():
            return 0
        peer = self.peer_id(worker)
        store = LedgerStore.open_existing(path)
        try:
            return sum(
                1 for e in store.events() if e.message.event == "credit" and e.message.peer == peer
            )
        finally:
            store.close()

    def peer_id(self, name: str) -> str:
        return self.hosts[name].addr.rsplit("/p2p/", 1)[1]

    def trainer_queue(self) -> dict[bytes, int | None]:
        path = self.run_dir("trainer") / "samples.db"
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            rows = db.execute("SELECT submission_id, step FROM accepted").fetchall()
        queue: dict[bytes, int | None] = {}
        for sid, step in rows:
            assert bytes(sid) not in queue, "a submission queued twice"
            queue[bytes(sid)] = step
        return queue

    def handoffs(self) -> str:
        """The validator's outbox, for failure messages."""
        path = self.run_dir("validator") / "ledger.db"
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            rows = db.execute("SELECT delivered, count(*) FROM handoffs GROUP BY delivered")
            return f"validator outbox (delivered, count): {rows.fetchall()}"

    def tail(self, name: str, chars: int = 3000) -> str:
        log = self.hosts[name].log
        return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def wait_for(condition: Callable[[], Any], timeout: float, what: str, swarm: Swarm) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    logs = "\n".join(f"--- {n}\n{swarm.tail(n)}" for n in swarm.hosts)
    unanswered = "".join(f"status of {n}: {e}\n" for n, e in swarm.status_errors.items())
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{unanswered}{logs}")


def policy_version(swarm: Swarm, name: str) -> int:
    s = swarm.status(name)
    return -1 if s is None or s.get("policy_version") is None else int(s["policy_version"])


def download_complete(swarm: Swarm, name: str, version: int) -> bool:
    s = swarm.status(name)
    if s is None:
        return False
    versions = s.get("role_status", {}).get("shardcast", {}).get("versions", [])
    return any(v["version"] >= version and v["complete"] for v in versions)
