"""A validator under a Sybil flood, against the same swarm without it (issue 15).

    .venv/bin/python bench/flood.py [--json PATH] [--seconds S] [--identities N] [--workers W]
        [--flood-nice N]

Two runs of a local swarm of processes on 127.0.0.1 (``node.up.LocalSwarm``: bootstrap,
trainer, validator with its compute child, W honest workers, no cheater; the demo parameters).
Each run waits until every honest worker has been credited once (a history), then measures for
S seconds; in the second run a process of its own (``python -m tests.flood``) floods the
validator for those S seconds from N fresh identities, each a libp2p host of its own: well-formed
garbage for its real assignment (of the validator's newest version, passed through a file),
unassigned work, replays, 8 MiB submissions, in rounds until the time is up. The window starts
once the flood's hosts are up.

``--flood-nice N`` runs the flood process at that niceness (default 0: none). On one machine
the flood's own CPU comes out of the same cores as the honest workers'; a real attacker runs on
machines of its own, which a niced flood models (the kernel gives its CPU to the swarm first).
It is reported in the JSON (``flood_nice``); figures with and without it are different
experiments and are recorded as such.

Reports ``honest_ratio`` (honest accepted samples per second with the flood over without; goal
>= 0.8), ``validator_peak_rss_mib`` (the validator's process and its compute child, from /proc,
sampled every 0.5 s, over both runs), ``disk_growth_mib`` (the validator's run folder over the
flooded window, new policy versions' shards included) and ``disk_growth_over_quiet_mib`` (less
the quiet run's: what the flood added), ``flood_judge_share`` (of the validator's judge time in
the flooded window, the share spent on newcomers' work), ``validator_cpu_extra_share`` (1 - the
validator's CPU rate without the flood over with it: the part of its CPU the flood took), the
CPU seconds of every swarm process (with its children) over the window (``cpu_s``), of the
flood process (``flood_process_cpu_s``: the flood's own cost) and the flood's outcomes.
Bounded in time: at most about 2 x (startup + S) + a minute; S defaults to 60.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.roles.launch import disk_usage
from node.up import DEMO_PARAMS, LocalSwarm, UpConfig

REPO = Path(__file__).resolve().parent.parent

SAMPLES = DEMO_PARAMS.group_size * DEMO_PARAMS.batch_prompts
CLK = os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the validator and its compute child), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def rss_and_cpu(pid: int) -> tuple[float, float]:
    """RSS (MiB) and CPU seconds (user + system) of ``pid`` and its descendants."""
    rss, cpu = 0.0, 0.0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) / 1024
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / CLK
        except (OSError, IndexError, ValueError):
            continue
    return rss, cpu


def validator_status(swarm: LocalSwarm) -> dict[str, Any]:
    return dict(swarm.proc("validator").status.get("role_status", {}).get("validator", {}))


def _write_version(path: Path, version: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(version))
    tmp.replace(path)  # whole or not at all: the flood reads it at every submission


def _children_cpu() -> float:
    """CPU seconds of this process's waited-for children (the flood process, once it ended)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def _start_flood(
    swarm: LocalSwarm, version_file: Path, seconds: float, identities: int, nice: int
) -> trio.Process:
    """The flood process, once its hosts are up (it says ``flooding`` on stderr)."""
    validator = swarm.proc("validator")
    addr = next(a for a in validator.status.get("listen_addrs", []) if "/127.0.0.1/" in a)
    cmd = [sys.executable, "-m", "tests.flood", "--genesis", str(swarm.genesis_path)]
    cmd += ["--addr", addr, "--identities", str(identities), "--rounds", str(10**6)]
    cmd += ["--seconds", str(seconds), "--version-file", str(version_file)]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    proc = await trio.lowlevel.open_process(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    seen = b""
    with trio.fail_after(120):
        while b"flooding" not in seen:
            chunk = await proc.stderr.receive_some(4096)
            if not chunk:
                raise RuntimeError(f"the flood process ended before flooding: {seen[-2000:]!r}")
            seen += chunk
    return proc


async def _finish_flood(proc: trio.Process) -> dict[str, Any]:
    """The flood's JSON line (sent, outcomes, seconds), once it has ended."""
    assert proc.stdout is not None and proc.stderr is not None
    out = b""
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:

            async def drain_stderr() -> None:
                assert proc.stderr is not None
                while await proc.stderr.receive_some(65536):
                    pass

            nursery.start_soon(drain_stderr)
            while chunk := await proc.stdout.receive_some(65536):
                out += chunk
        await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the flood process failed (exit {proc.returncode})")
    result: dict[str, Any] = json.loads(out.decode().splitlines()[-1])
    return result


async def one_run(
    out: Path, seconds: float, identities: int, workers: int, flood: bool, nice: int = 0
) -> dict[str, Any]:
    swarm = LocalSwarm(
        UpConfig(
            out=out, workers=workers, versions=10**6, minutes=60, with_cheater=False, http=None
        )
    )
    swarm.prepare()
    peak = 0.0
    version_file = out / "flood.version"
    flood_proc: trio.Process | None = None
    try:
        await swarm.start()
        validator = swarm.proc("validator")
        assert validator.popen is not None
        pid = validator.popen.pid
        with trio.fail_after(600):  # startup and a first credit for every worker
            while True:
                await swarm.poll()
                peak = max(peak, rss_and_cpu(pid)[0])
                v = validator_status(swarm)
                if v.get("accepted", 0) >= workers:
                    break
                if swarm.finished() is not None and "exited" in str(swarm.finished()):
                    raise RuntimeError(swarm.finished())
                await trio.sleep(0.5)
        run_dir = swarm.validator_ledger().parent
        children0 = _children_cpu()
        if flood:
            # The validator's own newest version (its status): inside its window.
            _write_version(version_file, int(validator.status.get("policy_version") or 0))
            # A little longer than the window: the flood covers all of it.
            flood_proc = await _start_flood(swarm, version_file, seconds + 2, identities, nice)
        start_v, start_t = validator_status(swarm), time.monotonic()
        disk0 = disk_usage(run_dir)["total"]
        procs = [p for p in swarm.procs if p.popen is not None]
        cpu0 = {p.name: rss_and_cpu(p.popen.pid)[1] for p in procs if p.popen is not None}
        own0 = time.process_time()
        deadline = start_t + seconds
        while time.monotonic() < deadline:
            await swarm.poll()
            peak = max(peak, rss_and_cpu(pid)[0])
            if flood:
                _write_version(version_file, int(validator.status.get("policy_version") or 0))
            await trio.sleep(0.5)
        await swarm.poll()
        end_v, wall = validator_status(swarm), time.monotonic() - start_t
        cpu = {
            p.name: round(rss_and_cpu(p.popen.pid)[1] - cpu0[p.name], 1)
            for p in procs
            if p.popen is not None
        }
        own = time.process_time() - own0
        stats = None if flood_proc is None else await _finish_flood(flood_proc)
        flood_cpu = _children_cpu() - children0
        judge = end_v.get("judge_seconds", 0.0) - start_v.get("judge_seconds", 0.0)
        newcomer = end_v.get("newcomer_judge_seconds", 0.0) - start_v.get(
            "newcomer_judge_seconds", 0.0
        )
        accepted = end_v.get("accepted", 0) - start_v.get("accepted", 0)
        return {
            "flood": flood,
            "flood_nice": nice if flood else None,
            "seconds": round(wall, 1),
            "honest_accepted_samples": accepted * SAMPLES,
            "honest_samples_per_s": accepted * SAMPLES / wall,
            "validator_peak_rss_mib": round(peak, 1),
            "disk_growth_mib": round((disk_usage(run_dir)["total"] - disk0) / 2**20, 3),
            "validator_cpu_s": cpu["validator"],
            "cpu_s": cpu,
            "bench_process_cpu_s": round(own, 1),
            "flood_process_cpu_s": round(flood_cpu, 1) if flood else 0.0,
            "judge_s": round(judge, 1),
            "flood_judge_share": newcomer / judge if judge else 0.0,
            "refusals": end_v.get("refusals", {}),
            "rate_limited": end_v.get("rate_limited", 0),
            "rejected_hard": end_v.get("rejected_hard", 0) - start_v.get("rejected_hard", 0),
            "flood_sent": stats["sent"] if stats else {},
            "flood_outcomes": stats["outcomes"] if stats else {},
        }
    finally:
        if flood_proc is not None and flood_proc.returncode is None:
            flood_proc.kill()  # the run failed midway: no flood left behind
        swarm.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window per run")
    parser.add_argument("--identities", type=int, default=50, help="fresh keys in the flood")
    parser.add_argument("--workers", type=int, default=2, help="honest inference workers")
    parser.add_argument(
        "--flood-nice",
        type=int,
        default=0,
        help="niceness of the flood process (models an attacker on machines of its own)",
    )
    args = parser.parse_args()
    console = Console(stderr=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flood-bench-") as tmp:
        runs = []
        for flood in (False, True):
            console.print(f"run {'with' if flood else 'without'} the flood ...")
            runs.append(
                trio.run(
                    one_run,
                    Path(tmp) / ("flood" if flood else "quiet"),
                    args.seconds,
                    args.identities,
                    args.workers,
                    flood,
                    args.flood_nice,
                )
            )
    quiet, flooded = runs
    base = quiet["honest_samples_per_s"]
    result = {
        "honest_ratio": flooded["honest_samples_per_s"] / base if base else None,
        "validator_peak_rss_mib": max(
            quiet["validator_peak_rss_mib"], flooded["validator_peak_rss_mib"]
        ),
        "disk_growth_mib": flooded["disk_growth_mib"],
        "disk_growth_over_quiet_mib": round(
            flooded["disk_growth_mib"] - quiet["disk_growth_mib"], 3
        ),
        "flood_judge_share": flooded["flood_judge_share"],
        "validator_cpu_extra_share": 1
        - (quiet["validator_cpu_s"] / quiet["seconds"])
        / max(flooded["validator_cpu_s"] / flooded["seconds"], 1e-9),
        "flood_nice": args.flood_nice,
        "flood_process_cpu_s": flooded["flood_process_cpu_s"],
        "identities": args.identities,
        "workers": args.workers,
        "window_s": args.seconds,
        "wall_s": round(time.monotonic() - started, 1),
        "load_average": os.getloadavg(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}",
        "runs": runs,
    }
    table = Table(title=f"validator under a flood of {args.identities} fresh identities")
    table.add_column("run")
    for name in (
        "honest samples/s",
        "peak RSS MiB",
        "disk growth MiB",
        "CPU s",
        "judge s",
        "flood judge share",
        "flood process CPU s",
    ):
        table.add_column(name, justify="right")
    for run in runs:
        table.add_row(
            "flood" if run["flood"] else "quiet",
            f"{run['honest_samples_per_s']:.2f}",
            f"{run['validator_peak_rss_mib']:.0f}",
            f"{run['disk_growth_mib']:.2f}",
            f"{run['validator_cpu_s']:.0f}",
            f"{run['judge_s']:.0f}",
            f"{run['flood_judge_share']:.2f}",
            f"{run['flood_process_cpu_s']:.0f}",
        )
    console.print(table)
    ratio = result["honest_ratio"]
    console.print(
        f"honest_ratio {ratio:.2f} (goal >= 0.8)"
        if ratio is not None
        else "no honest work in the quiet run",
        highlight=False,
    )
    console.print(f"CPU s by process: quiet {quiet['cpu_s']}", highlight=False)
    console.print(f"CPU s by process: flood {flooded['cpu_s']}", highlight=False)
    console.print(f"flood outcomes: {flooded['flood_outcomes']}", highlight=False)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
