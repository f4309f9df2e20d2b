"""A validator under a Sybil flood, against the same swarm without it (issue 15).

    .venv/bin/python bench/flood.py [--json PATH] [--seconds S] [--identities N] [--workers W]
        [--flood-nice N] [--interleave K] [--repeat R]

Two runs of a local swarm of processes on 127.0.0.1 (``node.up.LocalSwarm``: bootstrap,
trainer, validator with its compute child, W honest workers, no cheater; the demo parameters).
Each run waits until every honest worker has been credited once (a history), then measures for
S seconds; in the second run a process of its own (``python -m tests.flood``) floods the
validator for those S seconds from N fresh identities, each a libp2p host of its own: well-formed
garbage for its real assignment (of the validator's newest version, passed through a file),
unassigned work, replays, 8 MiB submissions, in rounds until the time is up. The window starts
once the flood's hosts are up.

``--interleave K`` measures in one swarm instead: K pairs of a quiet and a flooded window of
S/K seconds each, alternating, every flooded window from fresh identities of its own (a seed
each), and compares the summed windows of each kind. On a machine whose load moves (this one
is shared), both kinds then see the same load; with two swarms minutes apart the quiet rate
alone moved by a factor of 2-3 between runs. ``interleave`` in the JSON says which was run.

``--repeat R`` makes the whole comparison R times (two swarms each, the order of the quiet and
the flooded swarm alternating, so a drift in the machine's speed favours neither) and reports
the median of the R ratios as ``honest_ratio``, every ratio in ``honest_ratios``: on a quiet
machine one code gave 0.77 and 1.06 in two single comparisons half an hour apart.

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
flood process (``flood_process_cpu_s``: the flood's own cost), the honest workers' time spent
generating (``worker_generate_s``: CPU-bound, longer when the cores are shared) and waiting for
verdicts (``worker_submit_s``: the validator's latency, whatever the flood adds to it), and the
flood's outcomes.
Bounded in time: at most about 2 x (startup + S) + a minute; S defaults to 60.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
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


WORKER_COUNTS = ("samples", "dropped_stale", "submitted", "accepted", "rejected")
WORKER_KEYS = ("generate_seconds", "submit_seconds", *WORKER_COUNTS)
"""The honest workers' ``role_status.worker`` counters a window reports (as differences)."""


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


def _write_version(path: Path, status: dict[str, Any]) -> None:
    """The validator's newest version and its manifest id (the assignment of a run with a
    quota mixes it), as ``tests.flood`` reads them."""
    version = int(status.get("policy_version") or 0)
    manifest = status.get("policy_manifest") or ""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{version} {manifest}".strip())
    tmp.replace(path)  # whole or not at all: the flood reads it at every submission


def _children_cpu() -> float:
    """CPU seconds of this process's waited-for children (the flood process, once it ended)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def _start_flood(
    swarm: LocalSwarm,
    version_file: Path,
    seconds: float,
    identities: int,
    nice: int,
    seed: int = 0,
) -> trio.Process:
    """The flood process, once its hosts are up (it says ``flooding`` on stderr)."""
    validator = swarm.proc("validator")
    addr = next(a for a in validator.status.get("listen_addrs", []) if "/127.0.0.1/" in a)
    cmd = [sys.executable, "-m", "tests.flood", "--genesis", str(swarm.genesis_path)]
    cmd += ["--addr", addr, "--identities", str(identities), "--rounds", str(10**6)]
    cmd += ["--seconds", str(seconds), "--version-file", str(version_file), "--seed", str(seed)]
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


async def _window(
    swarm: LocalSwarm,
    seconds: float,
    identities: int,
    flood: bool,
    nice: int,
    seed: int,
    peak: list[float],
) -> dict[str, Any]:
    """Measure one window of ``seconds`` (flooded from fresh identities of ``seed`` if asked)."""
    validator = swarm.proc("validator")
    assert validator.popen is not None
    pid = validator.popen.pid
    run_dir = swarm.validator_ledger().parent
    version_file = swarm.out / "flood.version"
    flood_proc: trio.Process | None = None
    try:
        children0 = _children_cpu()
        if flood:
            # The validator's own newest version (its status): inside its window.
            _write_version(version_file, validator.status)
            # A little longer than the window: the flood covers all of it.
            flood_proc = await _start_flood(
                swarm, version_file, seconds + 2, identities, nice, seed
            )
        await swarm.poll()
        start_v, start_t = validator_status(swarm), time.monotonic()
        worker0 = {
            p.name: dict(p.status.get("role_status", {}).get("worker", {}))
            for p in swarm.procs
            if p.name.startswith("worker-")
        }
        disk0 = disk_usage(run_dir)["total"]
        procs = [p for p in swarm.procs if p.popen is not None]
        cpu0 = {p.name: rss_and_cpu(p.popen.pid)[1] for p in procs if p.popen is not None}
        own0 = time.process_time()
        deadline = start_t + seconds
        while time.monotonic() < deadline:
            await swarm.poll()
            peak[0] = max(peak[0], rss_and_cpu(pid)[0])
            if flood:
                _write_version(version_file, validator.status)
            await trio.sleep(0.5)
        await swarm.poll()
        end_v, wall = validator_status(swarm), time.monotonic() - start_t
        cpu = {
            p.name: rss_and_cpu(p.popen.pid)[1] - cpu0[p.name] for p in procs if p.popen is not None
        }
        own = time.process_time() - own0
        stats = None if flood_proc is None else await _finish_flood(flood_proc)
    finally:
        if flood_proc is not None and flood_proc.returncode is None:
            flood_proc.kill()  # the run failed midway: no flood left behind
    flood_cpu = _children_cpu() - children0

    def delta(key: str) -> float:
        return float(end_v.get(key, 0) - start_v.get(key, 0))

    workers = [p for p in swarm.procs if p.name.startswith("worker-")]
    split = Counter(
        {
            f"worker_{key}": sum(
                w.status.get("role_status", {}).get("worker", {}).get(key, 0.0)
                - worker0[w.name].get(key, 0.0)
                for w in workers
            )
            for key in WORKER_KEYS
        }
    )
    refusals = Counter(end_v.get("refusals", {}))
    refusals.subtract(start_v.get("refusals", {}))
    return {
        "seconds": wall,
        "accepted": delta("accepted"),
        "disk_growth": disk_usage(run_dir)["total"] - disk0,
        "cpu_s": Counter(cpu),
        "bench_process_cpu_s": own,
        "flood_process_cpu_s": flood_cpu if flood else 0.0,
        "judge_s": delta("judge_seconds"),
        "newcomer_judge_s": delta("newcomer_judge_seconds"),
        "rejected_hard": delta("rejected_hard"),
        "refusals": refusals,
        "worker_wait": split,
        "flood_sent": Counter(stats["sent"] if stats else {}),
        "flood_outcomes": Counter(stats["outcomes"] if stats else {}),
    }


def _merge(windows: list[dict[str, Any]], flood: bool, nice: int, peak: float) -> dict[str, Any]:
    """The windows of one condition as one run (sums; rates over their summed time)."""
    total: dict[str, Any] = {}
    for w in windows:
        for key, value in w.items():
            total[key] = total[key] + value if key in total else value
    wall = total["seconds"]
    judge = total["judge_s"]
    return {
        "flood": flood,
        "flood_nice": nice if flood else None,
        "windows": len(windows),
        "seconds": round(wall, 1),
        "honest_accepted_samples": int(total["accepted"]) * SAMPLES,
        "honest_samples_per_s": total["accepted"] * SAMPLES / wall,
        "validator_peak_rss_mib": round(peak, 1),
        "disk_growth_mib": round(total["disk_growth"] / 2**20, 3),
        "validator_cpu_s": round(total["cpu_s"]["validator"], 1),
        "cpu_s": {k: round(v, 1) for k, v in total["cpu_s"].items()},
        "bench_process_cpu_s": round(total["bench_process_cpu_s"], 1),
        "flood_process_cpu_s": round(total["flood_process_cpu_s"], 1),
        "judge_s": round(judge, 1),
        "flood_judge_share": total["newcomer_judge_s"] / judge if judge else 0.0,
        "refusals": {k: v for k, v in total["refusals"].items() if v},
        # Summed over the honest workers: generating (CPU-bound: slower when the cores are
        # shared) and waiting for verdicts (the validator's latency, the flood's in it).
        "worker_generate_s": round(total["worker_wait"]["worker_generate_seconds"], 1),
        "worker_submit_s": round(total["worker_wait"]["worker_submit_seconds"], 1),
        # Where the honest workers' samples went: generated, dropped before submission as
        # outside the async window, and the submissions judged (accepted or rejected).
        "worker_work": {key: int(total["worker_wait"][f"worker_{key}"]) for key in WORKER_COUNTS},
        "rejected_hard": int(total["rejected_hard"]),
        "flood_sent": dict(total["flood_sent"]),
        "flood_outcomes": dict(total["flood_outcomes"]),
    }


async def one_run(
    out: Path,
    seconds: float,
    identities: int,
    workers: int,
    floods: list[bool],
    nice: int = 0,
) -> list[dict[str, Any]]:
    """One swarm: once every worker has a credit, one window per entry of ``floods`` (flooded
    or not), each ``seconds`` long; the windows of each condition merged into one run."""
    swarm = LocalSwarm(
        UpConfig(
            out=out, workers=workers, versions=10**6, minutes=60, with_cheater=False, http=None
        )
    )
    swarm.prepare()
    peak = [0.0]
    try:
        await swarm.start()
        validator = swarm.proc("validator")
        assert validator.popen is not None
        pid = validator.popen.pid
        with trio.fail_after(600):  # startup and a first credit for every worker
            while True:
                await swarm.poll()
                peak[0] = max(peak[0], rss_and_cpu(pid)[0])
                v = validator_status(swarm)
                if v.get("accepted", 0) >= workers:
                    break
                if swarm.finished() is not None and "exited" in str(swarm.finished()):
                    raise RuntimeError(swarm.finished())
                await trio.sleep(0.5)
        windows: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for i, flood in enumerate(floods):
            # Each flood window from identities of its own (a seed each): fresh keys every time.
            windows[flood].append(await _window(swarm, seconds, identities, flood, nice, i, peak))
        return [_merge(w, flood, nice, peak[0]) for flood, w in windows.items() if w]
    finally:
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
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="make the (two-swarm) comparison R times; honest_ratio is the median",
    )
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="one swarm, K pairs of (quiet, flooded) windows of S/K s each (0: two swarms)",
    )
    args = parser.parse_args()
    console = Console(stderr=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flood-bench-") as tmp:
        runs: list[dict[str, Any]] = []
        if args.interleave:
            k = args.interleave
            console.print(
                f"one swarm, {k} x (a quiet window, a flooded one) of {args.seconds / k:g} s"
            )
            runs = trio.run(
                one_run,
                Path(tmp) / "interleaved",
                args.seconds / k,
                args.identities,
                args.workers,
                [False, True] * k,
                args.flood_nice,
            )
        ratios: list[float] = []
        for r in range(0 if args.interleave else args.repeat):
            order = (False, True) if r % 2 == 0 else (True, False)
            pair: dict[bool, dict[str, Any]] = {}
            for flood in order:
                console.print(
                    f"comparison {r + 1}/{args.repeat}: run"
                    f" {'with' if flood else 'without'} the flood ..."
                )
                (pair[flood],) = trio.run(
                    one_run,
                    Path(tmp) / f"{'flood' if flood else 'quiet'}-{r}",
                    args.seconds,
                    args.identities,
                    args.workers,
                    [flood],
                    args.flood_nice,
                )
            runs += [pair[False], pair[True]]
            if pair[False]["honest_samples_per_s"]:
                ratios.append(
                    pair[True]["honest_samples_per_s"] / pair[False]["honest_samples_per_s"]
                )
    quiet, flooded = runs[-2:]
    if args.interleave and quiet["honest_samples_per_s"]:
        ratios = [flooded["honest_samples_per_s"] / quiet["honest_samples_per_s"]]
    result = {
        "honest_ratio": statistics.median(ratios) if ratios else None,
        "honest_ratios": [round(x, 3) for x in ratios],
        "repeat": 1 if args.interleave else args.repeat,
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
        "interleave": args.interleave,
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
        f"honest_ratio {ratio:.2f} (goal >= 0.8; the median of"
        f" {', '.join(f'{x:.2f}' for x in ratios)})"
        if ratio is not None
        else "no honest work in the quiet run",
        highlight=False,
    )
    for run in runs:
        console.print(
            f"{'flood' if run['flood'] else 'quiet'}: honest workers generated"
            f" {run['worker_generate_s']} s and waited for verdicts {run['worker_submit_s']} s",
            highlight=False,
        )
    console.print(f"CPU s by process: quiet {quiet['cpu_s']}", highlight=False)
    console.print(f"CPU s by process: flood {flooded['cpu_s']}", highlight=False)
    console.print(f"flood outcomes: {flooded['flood_outcomes']}", highlight=False)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
