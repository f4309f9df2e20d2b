"""``swarm-node doctor``: check what a node needs before it joins, each with a fix-it hint."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

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
    return [found, picked]


def run_checks(home: NodeHome, bootstrap: tuple[str, ...]) -> list[Check]:
    config = home.load_config()
    checks = [check_versions(), check_key(home)]
    checks += check_ports(config.listen)
    checks += check_bootstrap(bootstrap or config.bootstrap)
    checks += [check_disk(home.path), check_memory(), *check_accelerator()]
    return checks
