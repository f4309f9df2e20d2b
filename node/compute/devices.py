"""Which engine, device and precision a node computes with: ``--engine --device --dtype``.

Decisions this module owns:

- Defaults, each with the reason ``doctor`` prints: device ``cuda:0`` when torch sees a CUDA
  GPU, else ``cpu``; dtype ``bfloat16`` on CUDA (what GPUs run fast and TOPLOC commits to),
  ``float32`` on the CPU (bf16 matmuls are slow there); engine ``torch`` (the reference; ``vllm``
  only when asked, and only where it can run).
- Bad input is a :class:`ConfigError` of one line with the fix, raised before the node starts
  work: an unknown engine or dtype, ``--engine vllm`` without vllm installed or without a CUDA
  GPU, a ``--device`` that is not ``cpu``/``cuda``/``cuda:N`` or names a GPU this machine does
  not have.
- ``--nproc N`` (trainers only, ``node.compute.fsdp``): N processes train one model sharded
  over N devices, ``cuda:k..cuda:k+N-1`` from the chosen ``cuda:k`` (one per rank, nccl), or N
  gloo ranks on the CPU. Fewer GPUs than that, N < 1, or ``--nproc`` for another role: a
  one-line :class:`ConfigError` (:func:`check_nproc`, :func:`choose`).
- The main process never imports torch (contract 1): :func:`probe` asks a short-lived
  ``python -m node.compute.devices`` child what torch sees, and skips even that when the
  machine has no NVIDIA device node or ``nvidia-smi`` (then there is no CUDA to find). vllm is
  looked up with ``importlib.util.find_spec`` (not imported).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from swarm.errors import ConfigError

ENGINES = ("torch", "vllm")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Accelerators:
    """What this machine offers: CUDA devices torch can use, and whether vllm is installed."""

    cuda_names: tuple[str, ...] = ()
    vllm: bool = False
    note: str = ""

    @property
    def cuda(self) -> int:
        return len(self.cuda_names)


@dataclass(frozen=True)
class EngineChoice:
    """The engine, device and dtype a node uses, and why (for ``doctor`` and the logs)."""

    kind: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    reasons: tuple[str, ...] = field(default=(), compare=False)
    nproc: int = 1
    """Trainer processes (one per device) sharing the model (FSDP2)."""


def _maybe_cuda() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def probe(timeout: float = 120.0) -> Accelerators:
    """What torch sees, asked in a child process (the caller never imports torch)."""
    vllm = importlib.util.find_spec("vllm") is not None
    if not _maybe_cuda():
        return Accelerators((), vllm, "no NVIDIA device on this machine")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "node.compute.devices"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        ).stdout
        found = json.loads(out.strip().splitlines()[-1])
        return Accelerators(tuple(found["cuda"]), vllm, f"torch {found['torch']}")
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError) as exc:
        return Accelerators((), vllm, f"could not ask torch about CUDA ({exc})")


def _parse_device(device: str, acc: Accelerators) -> str:
    if device == "cpu":
        return device
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"--device {device!r} is not cpu, cuda or cuda:N; pick one of those")
    n = int(index or 0)
    if acc.cuda == 0:
        raise ConfigError(
            f"--device {device}: this machine has no CUDA GPU that torch can use"
            f" ({acc.note or 'none found'}); use --device cpu or install the CUDA build of torch"
        )
    if n >= acc.cuda:
        have = ", ".join(f"cuda:{i}" for i in range(acc.cuda))
        raise ConfigError(f"--device {device} does not exist: this machine has {have}; pick one")
    return f"cuda:{n}"


def check_nproc(nproc: int | None, role: str) -> int:
    """``--nproc`` without the machine: at least 1, and for trainers only (None: 1)."""
    if nproc is None:
        return 1
    if nproc < 1:
        raise ConfigError(
            f"--nproc {nproc} is not a number of processes; give 1 or more (one per device)"
        )
    if role != "trainer" and nproc != 1:
        raise ConfigError(
            f"--nproc shards a trainer over devices; {'an' if role[0] in 'aeiou' else 'a'}"
            f" {role} node uses one device: drop --nproc"
        )
    return nproc


def _check_ranks(nproc: int, device: str, acc: Accelerators) -> str:
    if not device.startswith("cuda"):
        return f"nproc {nproc}: FSDP2 over {nproc} gloo ranks on the CPU"
    first = int(device.partition(":")[2] or 0)
    if first + nproc > acc.cuda:
        raise ConfigError(
            f"--nproc {nproc} on {device} needs {nproc} CUDA GPUs from {device} on (one per"
            f" rank) and this machine has {acc.cuda}; lower --nproc or pick another --device"
        )
    return f"nproc {nproc}: FSDP2 over cuda:{first}..cuda:{first + nproc - 1} (nccl)"


def choose(
    engine: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    acc: Accelerators | None = None,
    nproc: int = 1,
) -> EngineChoice:
    """Check and complete ``--engine --device --dtype --nproc`` (None: the default, with its
    reason; ``nproc`` was checked by :func:`check_nproc`)."""
    if engine is not None and engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r} is unknown; use torch or vllm")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is unknown; use float32 or bfloat16")
    needs_probe = device != "cpu" or engine == "vllm"
    acc = acc or (probe() if needs_probe else Accelerators(note="not probed: --device cpu"))
    reasons = []
    if device is None:
        device = "cuda:0" if acc.cuda else "cpu"
        reasons.append(
            f"device {device}: "
            + (f"torch sees {acc.cuda} CUDA GPU(s): {acc.cuda_names[0]}" if acc.cuda else acc.note)
        )
    else:
        device = _parse_device(device, acc)
        reasons.append(f"device {device}: as asked")
    kind = engine or "torch"
    if kind == "vllm":
        if not acc.vllm:
            raise ConfigError(
                "--engine vllm needs vllm: pip install 'swarm-node[gpu]' on a CUDA machine,"
                " or use --engine torch"
            )
        if not device.startswith("cuda"):
            raise ConfigError(
                "--engine vllm runs only on a CUDA GPU"
                + ("" if acc.cuda else f" and this machine has none ({acc.note})")
                + "; use --engine torch"
            )
    reasons.append(
        f"engine {kind}: "
        + (
            "as asked"
            if engine
            else "the reference engine"
            + (" (vllm is installed: --engine vllm to use it)" if acc.vllm else "")
        )
    )
    if dtype is None:
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
        why = "GPUs run bf16 fast" if dtype == "bfloat16" else "bf16 is slow on CPUs"
        reasons.append(f"dtype {dtype}: {why}")
    else:
        reasons.append(f"dtype {dtype}: as asked")
    if nproc > 1:
        reasons.append(_check_ranks(nproc, device, acc))
    return EngineChoice(kind, device, dtype, tuple(reasons), nproc)


def _main() -> None:
    import torch

    names = []
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(json.dumps({"torch": torch.__version__, "cuda": names}))


if __name__ == "__main__":
    _main()
