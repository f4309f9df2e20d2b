"""What this process costs and carries: resident memory, CPU time, and which heavy packages it
has loaded.

The light-node contract (``docs/core-team.md``, issue 17): a node's main process (a bootstrap
peer, and every role's main process) never imports torch, transformers, sympy/math-verify or
hivemind; the model and everything that needs those lives in the compute child. ``usage()`` is
what ``swarm-node status`` shows under ``process``, so an operator (and the tests) can see that
the contract holds on a running node, and what the node costs the machine.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path
from typing import Any

HEAVY_PACKAGES = ("torch", "transformers", "sympy", "math_verify", "hivemind")
"""Packages a node's main process must not load (each costs 50-300 MiB or a CUDA context)."""


def heavy_modules() -> list[str]:
    """The ``HEAVY_PACKAGES`` this process has imported (empty on a light process)."""
    return [name for name in HEAVY_PACKAGES if name in sys.modules]


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (``VmRSS``); 0 when it cannot be read (gone, not Linux)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def usage() -> dict[str, Any]:
    """This process: pid, resident MiB, CPU seconds (user + system) and heavy modules."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "pid": os.getpid(),
        "rss_mib": round(rss_bytes() / (1024 * 1024), 1),
        "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
        "heavy_modules": heavy_modules(),
    }


def child_pids(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them (Linux)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(p) for p in (task / "children").read_text().split()]
    return out
