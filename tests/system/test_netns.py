"""Five hosts in network namespaces, each running one `swarm-node` process through the CLI:
two bootstrap peers, a trainer, a validator and an inference worker, on a bridge of their own
(10.77.0.0/24 exists only inside the namespaces this test creates and deletes).

Faults, each followed by checks: kill -9 of the worker, the validator and the trainer, each
restarted on its home (the policy keeps advancing, the worker's download completes, crediting
goes on); the worker's and then the validator's link down and up again (the worker's ledger
replica converges with the validator's); kill -9 of the first bootstrap peer, after which a
restarted worker joins through the second; the first bootstrap peer restarted. Throughout: no
submission is credited twice, and every credited (accepted) submission reaches the trainer's
sample queue, where each is reserved by at most one training step.

Needs root (`ip netns`); ``pytest -m netns`` runs exactly this module.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from node import admin
from node.home import NodeConfig, NodeHome
from node.run import create_genesis, write_genesis
from node.up import DEMO_PARAMS
from swarm.errors import SwarmError
from swarm.ledger import LedgerStore
from swarm.messages import run_id_of

pytestmark = [pytest.mark.netns, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.0"
PORT = 4001
PARAMS = dataclasses.replace(DEMO_PARAMS, group_size=4, batch_prompts=2, max_tokens=8)
HOSTS = {"boot1": 1, "boot2": 2, "trainer": 3, "validator": 4, "worker": 5}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies (a CI
    timeout, Ctrl-C twice), so no node outlives it inside a namespace nobody can see."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (the `ip` command)"
    probe = f"swnprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace here: {exc}"
    with contextlib.suppress(Exception):
        _ip("netns", "del", probe)
    return None


class Namespaces:
    """A bridge in a namespace of its own and one namespace per host, joined by veth pairs.
    ``close`` deletes every namespace (and with them the veth pairs), whatever state it is in."""

    def __init__(self, hosts: dict[str, int]) -> None:
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"swn{tag}br"
        self.names = {name: f"swn{tag}h{n}" for name, n in hosts.items()}
        self.hosts = hosts
        self.tag = tag
        self.created: list[str] = []

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
        _ip("netns", "add", self.bridge)
        self.created.append(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for name, n in self.hosts.items():
            ns, host_end, bridge_end = self.names[name], f"sw{self.tag}a{n}", f"sw{self.tag}b{n}"
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", bridge_end)
            _ip("link", "set", host_end, "netns", ns)
            _ip("link", "set", bridge_end, "netns", self.bridge)
            _ip("-n", ns, "link", "set", host_end, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{n}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.bridge, "link", "set", bridge_end, "master", "br0")
            _ip("-n", self.bridge, "link", "set", bridge_end, "up")

    def link(self, name: str, up: bool) -> None:
        """Take a host's link down (a partition) or up again, at the bridge."""
        port = f"sw{self.tag}b{self.hosts[name]}"
        _ip("-n", self.bridge, "link", "set", port, "up" if up else "down")

    def close(self) -> None:
        for ns in reversed(self.created):
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)
        for n in self.hosts.values():  # a veth end left in the root namespace by a failed build
            with contextlib.suppress(Exception):
                _ip("link", "del", f"sw{self.tag}a{n}")
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

    def __init__(self, net: Namespaces, root: Path) -> None:
        self.net = net
        self.root = root
        self.hosts: dict[str, Host] = {}
        self.status_errors: dict[str, str] = {}
        owner, _ = NodeHome(root / "owner").create()
        peer_ids = {}
        for name, n in HOSTS.items():
            home = NodeHome(root / name)
            key, _ = home.create()
            listen = f"/ip4/{SUBNET}.{n}/tcp/{PORT}"
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
            params=PARAMS,
        )
        self.genesis = root / "run.genesis"
        write_genesis(genesis, self.genesis)
        self.run_id = run_id_of(genesis)

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
                preexec_fn=_die_with_parent,
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
        store = LedgerStore.open_existing(self.run_dir(name) / "ledger.db")
        try:
            return [submission for submission, _ in self.credited_versions(name, store)]
        finally:
            store.close()

    def credited_versions(
        self, name: str, store: LedgerStore | None = None
    ) -> list[tuple[bytes, int]]:
        """Counted credits of ``name``'s ledger: (submission id, its policy version)."""
        own = store is None
        if store is None:
            store = LedgerStore.open_existing(self.run_dir(name) / "ledger.db")
        try:
            credits = [e for e in store.events() if e.message.event == "credit"]
            facts = [
                store.verdict_facts(e.message.evidence) for e in credits if store.is_counted(e.id)
            ]
            return [(f.submission, f.policy_version) for f in facts if f is not None]
        finally:
            if own:
                store.close()

    def queue_versions(self) -> list[int]:
        path = self.run_dir("trainer") / "samples.db"
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            return [int(v) for (v,) in db.execute("SELECT DISTINCT version FROM accepted")]

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


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with Namespaces(HOSTS) as net:
        s = Swarm(net, tmp_path)
        try:
            yield s
        finally:
            s.close()


def test_five_hosts_survive_kill9_partition_and_a_dead_bootstrap(swarm: Swarm) -> None:
    faults: dict[str, int] = {}
    swarm.start("boot1", ["bootstrap"])
    swarm.start("boot2", ["bootstrap", "--peer", swarm.hosts["boot1"].addr])
    both = ["boot1", "boot2"]
    swarm.start("trainer", swarm.join_args("trainer", both))
    swarm.start("validator", swarm.join_args("validator", both))
    swarm.start("worker", swarm.join_args("inference", both))

    # The swarm trains across hosts: the worker downloads versions and the policy advances.
    wait_for(lambda: policy_version(swarm, "worker") >= 1, 240, "policy v1 at the worker", swarm)
    wait_for(lambda: download_complete(swarm, "worker", 1), 60, "the worker's download", swarm)

    # 1. kill -9 the worker and restart it on its home.
    before = policy_version(swarm, "trainer")
    swarm.kill9("worker")
    swarm.start("worker")
    faults["kill -9 worker"] = 1
    wait_for(
        lambda: policy_version(swarm, "trainer") > before,
        120,
        "the policy to advance after the worker's restart",
        swarm,
    )
    now = policy_version(swarm, "worker")
    wait_for(lambda: download_complete(swarm, "worker", now), 60, "the re-download", swarm)

    swarm.assert_alive()

    # 2. kill -9 the validator and restart it: judging (and crediting) goes on.
    credits_before = len(swarm.credited("validator"))
    swarm.kill9("validator")
    swarm.start("validator")
    faults["kill -9 validator"] = 1
    wait_for(
        lambda: len(swarm.credited("validator")) > credits_before,
        120,
        "a new credit after the validator's restart",
        swarm,
    )

    swarm.assert_alive()

    # 3. Partitions: the worker's link, then the validator's, goes down and up again; the
    # worker's ledger replica then converges with the validator's (sync repairs the gap).
    for name in ("worker", "validator"):
        swarm.net.link(name, up=False)
        time.sleep(6)
        swarm.net.link(name, up=True)
        faults[f"link down/up ({name})"] = 1
        held = swarm.ledger_ids("validator")
        wait_for(
            lambda held=held: held <= swarm.ledger_ids("worker"),  # type: ignore[misc]
            60,
            f"the worker's ledger to converge with the validator's after the {name} partition",
            swarm,
        )

    swarm.assert_alive()

    # 4. kill -9 the trainer and restart it: it resumes from its checkpoint and keeps going.
    before = policy_version(swarm, "trainer")
    swarm.kill9("trainer")
    swarm.start("trainer")
    faults["kill -9 trainer"] = 1
    wait_for(
        lambda: policy_version(swarm, "trainer") > before,
        180,
        "the policy to advance after the trainer's restart",
        swarm,
    )

    swarm.assert_alive()

    # 5. The first bootstrap peer dies; a restarted worker joins through the second.
    swarm.kill9("boot1")
    swarm.kill9("worker")
    swarm.start("worker")
    faults["kill -9 first bootstrap + rejoin"] = 1

    def sees_the_run() -> bool:
        s = swarm.status("worker")
        if s is None:
            return False
        by_role = s.get("peers_by_role", {})
        return bool(by_role.get("trainer")) and bool(by_role.get("validator"))

    wait_for(sees_the_run, 90, "the worker to find trainer and validator via boot2", swarm)
    before = policy_version(swarm, "trainer")
    wait_for(
        lambda: policy_version(swarm, "trainer") > before,
        180,
        "the policy to advance with the first bootstrap peer gone",
        swarm,
    )

    # 6. The first bootstrap peer comes back (kill -9 was its fault; restart is the repair).
    swarm.start("boot1")
    faults["restart first bootstrap"] = 1
    wait_for(lambda: swarm.status("boot1") is not None, 60, "boot1 to answer again", swarm)

    swarm.assert_alive()

    # Nothing credited twice, nothing accepted lost, nothing trained twice.
    credited = swarm.credited("validator")
    assert credited, "no submission was ever credited"
    assert len(credited) == len(set(credited)), "a submission was credited twice"
    # The trainer's queue keeps only the versions in its async window (older accepted work is
    # dropped after each checkpoint): every credited submission of those must be there.
    credit_versions = swarm.credited_versions("validator")

    def kept_credits_queued() -> bool:
        queue = swarm.trainer_queue()
        kept_from = min(swarm.queue_versions() or [0])
        return {s for s, v in credit_versions if v >= kept_from} <= set(queue)

    wait_for(
        kept_credits_queued,
        90,
        f"every credited submission in the trainer's sample queue ({swarm.handoffs()})",
        swarm,
    )
    queue = swarm.trainer_queue()
    trained = [sid for sid, step in queue.items() if step is not None]
    assert len(trained) == len(set(trained))  # one row, one reserving step per submission
    assert swarm.hosts["worker"].starts == 3 and swarm.hosts["trainer"].starts == 2
    assert swarm.hosts["validator"].starts == 2 and swarm.hosts["boot1"].starts == 2
    versions = policy_version(swarm, "trainer")
    print(
        f"faults survived: {faults}; credited submissions: {len(credited)} (none twice),"
        f" queued at the trainer: {len(queue)}, trained: {len(trained)}; policy v{versions}"
    )
