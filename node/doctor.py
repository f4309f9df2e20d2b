"""``swarm-node doctor``: check what a node needs before it joins, each with a fix-it hint.

Reachability (``check_reachability``): a running node's own verdict when its admin socket
answers; otherwise a short-lived host with a throwaway key listens on the configured port and
asks the bootstrap peers to dial it back (``swarm.net.reach``). ``reachability_advice`` turns
the verdict into what to do: nothing; open the port in a firewall (no NAT: the bootstrap peer
saw one of our own addresses); forward the port and set an announce address (behind a NAT); fix
an announce address at another IP; or nothing after all, since the node works through a relay,
at a cost the advice states.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import socket
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import trio

from node.compute.devices import Accelerators, choose, probe
from node.home import NodeHome
from swarm.errors import SwarmError

MIN_FREE_DISK = 1 << 30
MIN_AVAILABLE_MEMORY = 2 << 30


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok", "warn" or "fail"
    detail: str
    hint: str = ""


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "missing"


def check_versions() -> Check:
    versions = {p: _version(p) for p in ("swarm-node", "libp2p", "torch", "transformers")}
    detail = f"python {platform.python_version()}, " + ", ".join(
        f"{k} {v}" for k, v in versions.items()
    )
    missing = [p for p, v in versions.items() if v == "missing"]
    if sys.version_info < (3, 11) or missing:
        return Check("software", "fail", detail, "reinstall with scripts/setup (Python 3.11+)")
    return Check("software", "ok", detail)


def check_key(home: NodeHome) -> Check:
    if not home.has_key():
        return Check("key", "fail", f"no key in {home.path}", "run `swarm-node init`")
    try:
        key = home.load_key()
    except SwarmError as exc:
        return Check("key", "fail", str(exc), "see the message; docs/contributors.md")
    return Check("key", "ok", f"{key.peer_id} ({home.key_path})")


def _tcp_port(addr: str) -> tuple[str, int] | None:
    parts = addr.split("/")
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
        return parts[2], int(parts[4])
    return None


def check_ports(listen: tuple[str, ...]) -> list[Check]:
    out = []
    for addr in listen:
        target = _tcp_port(addr)
        if target is None or target[1] == 0:
            out.append(Check(f"port {addr}", "ok", "chosen by the system at start"))
            continue
        host, port = target
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                out.append(
                    Check(
                        f"port {addr}",
                        "fail",
                        exc.strerror or str(exc),
                        "another program holds it: stop it, or set another port with"
                        " --listen / config.toml [node] listen",
                    )
                )
                continue
        out.append(Check(f"port {addr}", "ok", "free"))
    return out


def check_bootstrap(addrs: tuple[str, ...], timeout: float = 3.0) -> list[Check]:
    if not addrs:
        return [
            Check(
                "bootstrap list",
                "warn",
                "empty",
                "pass --bootstrap ADDR to join, or fill config.toml [node] bootstrap",
            )
        ]
    out = []
    for addr in addrs:
        target = _tcp_port(addr)
        if target is None:
            out.append(Check(f"bootstrap {addr[:40]}", "warn", "not a TCP address; not checked"))
            continue
        try:
            with socket.create_connection(target, timeout=timeout):
                pass
        except OSError as exc:
            out.append(
                Check(
                    f"bootstrap {addr[:40]}",
                    "fail",
                    exc.strerror or str(exc) or "timeout",
                    "check the address, your firewall, or ask the core team for the list",
                )
            )
            continue
        out.append(Check(f"bootstrap {addr[:40]}", "ok", "TCP reachable"))
    return out


def check_disk(path: Path) -> Check:
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    detail = f"{free / (1 << 30):.1f} GiB free at {path}"
    if free < MIN_FREE_DISK:
        return Check(
            "disk",
            "fail",
            detail,
            "free space or use --home on a larger disk;"
            " `shardcast fetch --max-disk` bounds what policy versions take",
        )
    return Check("disk", "ok", detail)


def check_memory() -> Check:
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return Check("memory", "warn", "unknown (no /proc/meminfo)")
    detail = f"{available / (1 << 30):.1f} GiB available"
    if available < MIN_AVAILABLE_MEMORY:
        return Check(
            "memory",
            "warn",
            detail,
            "the embedded model needs little; real models need"
            " their weights in memory twice (engine and fetch)",
        )
    return Check("memory", "ok", detail)


def check_accelerator(acc: Accelerators | None = None) -> list[Check]:
    """The accelerators found, and the engine, device and dtype ``join`` would pick, with why."""
    acc = acc or probe()
    if acc.cuda:
        found = Check("accelerator", "ok", f"{acc.cuda} x {acc.cuda_names[0]} ({acc.note})")
    else:
        found = Check(
            "accelerator",
            "warn",
            f"none ({os.cpu_count()} CPU cores; {acc.note})",
            "fine for the embedded model; for real models use a CUDA machine",
        )
    choice = choose(acc=acc)
    picked = Check(
        "engine",
        "ok",
        f"{choice.kind} on {choice.device} in {choice.dtype}",
        "; ".join(choice.reasons) + " (override with join --engine/--device/--dtype)",
    )
    if acc.cuda:
        where = f"up to {acc.cuda} here, one CUDA GPU per rank (nccl)"
    else:
        where = f"gloo ranks on the CPU ({os.cpu_count()} cores)"
    ranks = Check(
        "trainer ranks",
        "ok",
        f"join --role trainer --nproc N shards the model over N devices (FSDP2): {where}",
        "for a model that does not fit one device; see docs/core-team.md",
    )
    return [found, picked, ranks]


def _local_ips() -> set[str]:
    ips = {"127.0.0.1", "::1"}
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None):
            ips.add(str(info[4][0]))
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this picks the outgoing address
        ips.add(s.getsockname()[0])
    return ips


RELAY_COST = (
    "the node works anyway through a relay on the bootstrap peers: it joins, submits and"
    " earns, but peers reach it only through a relay (about 5 MiB/s, bulk shard transfers"
    " capped per relay circuit) and it serves no DHT queries"
)


def reachability_advice(
    status: str,
    reason: str,
    observed_ips: list[str],
    listen: tuple[str, ...],
    announce: tuple[str, ...] = (),
    local_ips: set[str] | None = None,
) -> Check:
    """What to do about a reachability verdict (see the module docstring)."""
    ports = [p for a in (*announce, *listen) if (t := _tcp_port(a)) and (p := t[1])]
    port = ports[0] if ports else 4001
    local = local_ips if local_ips is not None else _local_ips()
    stray = [a for a in announce if (t := _tcp_port(a)) and t[0] not in observed_ips]
    if stray and observed_ips:
        return Check(
            "reachability",
            "warn",
            f"{status}: {reason}",
            f"announce address {stray[0]} is not the address you connect from"
            f" ({', '.join(observed_ips)}), so peers dial it in vain: fix or remove [node]"
            " announce in config.toml",
        )
    if status == "public":
        return Check("reachability", "ok", f"public: {reason}")
    if status == "unknown":
        return Check(
            "reachability",
            "warn",
            f"unknown: {reason}",
            "no bootstrap peer answered a dial-back; check the bootstrap list (above)",
        )
    if observed_ips and all(ip in local for ip in observed_ips):
        hint = (
            f"no NAT, but TCP port {port} is closed to others: open it in your firewall;"
            f" or do nothing: {RELAY_COST}"
        )
    else:
        public = observed_ips[0] if observed_ips else "<your public IP>"
        hint = (
            f"you are behind a NAT (peers see you as {public}): forward TCP port {port} on"
            f' your router to this machine and set announce = ["/ip4/{public}/tcp/{port}"]'
            f" under [node] in config.toml; or do nothing: {RELAY_COST}"
        )
    return Check("reachability", "warn", f"private: {reason}", hint)


async def probe_reachability(
    listen: tuple[str, ...], bootstrap: tuple[str, ...], announce: tuple[str, ...]
) -> Any:
    from swarm.identity import NodeKey
    from swarm.net import DialPolicy, Overlay, OverlayConfig, peer_ids
    from swarm.net.reach import Reachability

    config = OverlayConfig(listen=listen, announce=announce, dht_server=False)
    async with Overlay.start(NodeKey.generate(), config) as overlay:
        try:
            report = await overlay.dial(bootstrap, DialPolicy(attempts=1, timeout=5.0))
        except SwarmError as exc:
            return Reachability("unknown", str(exc))
        servers = peer_ids(report.connected)
        return await overlay.check_reachability(servers)


def _running_status(home: NodeHome) -> dict[str, Any] | None:
    from node import admin

    sock = admin.socket_path(home.path)
    if not sock.exists():
        return None
    try:
        answer = trio.run(admin.query, sock, {"cmd": "status"}, 5.0)
    except SwarmError:
        return None
    status = answer.get("status")
    return status if isinstance(status, dict) else None


def check_reachability(
    home: NodeHome, bootstrap: tuple[str, ...], listen: tuple[str, ...], announce: tuple[str, ...]
) -> Check:
    running = _running_status(home)
    if running is not None and running.get("reachability_detail"):
        detail = running["reachability_detail"]
        return reachability_advice(
            str(detail["status"]),
            f"{detail['reason']} (the running node's verdict)",
            list(detail.get("observed_ips", [])),
            listen,
            announce,
        )
    if not bootstrap:
        return Check("reachability", "warn", "not tested: no bootstrap peer to ask")
    try:
        reach = trio.run(probe_reachability, listen, bootstrap, announce)
    except SwarmError as exc:
        return Check("reachability", "warn", f"not tested: {exc}")
    return reachability_advice(
        reach.status, reach.reason, sorted({r.observed_ip for r in reach.results}), listen, announce
    )


def check_internals() -> Check:
    """The private py-libp2p names the project relies on (``swarm.internals``; hivemind's
    are checked by the training child, which alone imports it)."""
    from swarm.internals import missing

    found = missing()
    if found:
        return Check(
            "library internals",
            "warn",
            "; ".join(found),
            "install the tested versions: scripts/setup, or pip install -c constraints.txt",
        )
    return Check("library internals", "ok", "every py-libp2p internal this node relies on")


def run_checks(home: NodeHome, bootstrap: tuple[str, ...]) -> list[Check]:
    config = home.load_config()
    checks = [check_versions(), check_internals(), check_key(home)]
    checks += check_ports(config.listen)
    checks += check_bootstrap(bootstrap or config.bootstrap)
    checks.append(
        check_reachability(home, bootstrap or config.bootstrap, config.listen, config.announce)
    )
    checks += [check_disk(home.path), check_memory(), *check_accelerator()]
    return checks
