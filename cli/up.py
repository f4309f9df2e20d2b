"""`swarm-node up`: the whole local swarm, with a live view, then the audit and a summary."""

from __future__ import annotations

import webbrowser
from pathlib import Path
from typing import Annotated, Any

import trio
import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table

from cli.common import console, err_console
from node.up import LocalSwarm, UpConfig


def _short(peer: str) -> str:
    return f"…{peer[-8:]}" if peer else "-"


def _role_cells(status: dict[str, Any]) -> tuple[str, str]:
    rs = status.get("role_status", {})
    ledger = rs.get("ledger", {})
    balance = str(ledger.get("balance", "-"))
    if "worker" in rs:
        w = rs["worker"]
        ok, bad = w.get("accepted", 0), w.get("rejected", 0)
        work = f"v{w.get('loaded_version')}: {ok} ok, {bad} rejected"
    elif "validator" in rs:
        v = rs["validator"]
        work = (
            f"judged {v.get('judged', 0)}: {v.get('accepted', 0)} ok,"
            f" {v.get('rejected_hard', 0)} slashed, {v.get('rejected_soft', 0)} soft,"
            f" {v.get('refused', 0)} refused (banned)"
        )
    elif "trainer" in rs:
        t = rs["trainer"]
        work = f"v{t.get('version', 0)}, {t.get('queued', 0)} submissions queued"
    else:
        work = ""
    fetch = (rs.get("shardcast") or {}).get("fetch")
    if fetch and fetch.get("done_bytes", 0) < fetch.get("total_bytes", 0):
        percent = fetch["done_bytes"] * 100 // max(1, fetch["total_bytes"])
        work += f" (fetching v{fetch.get('version')}: {percent}%)"
    return work, balance


def render(swarm: LocalSwarm) -> Group:
    table = Table(title=f"swarm-node up: run {swarm.run_id[:12]}…, {swarm.elapsed():.0f} s")
    for col in ("process", "peer", "peers", "policy", "work", "balance"):
        table.add_column(col)
    for proc in swarm.procs:
        status = proc.status
        work, balance = _role_cells(status)
        alive = "" if proc.alive else " [red](exited)[/]"
        table.add_row(
            f"{proc.name}{alive}",
            _short(proc.peer_id),
            str(status.get("connected_peers", "-")),
            str(status.get("policy_version", "-")),
            work,
            balance,
        )
    rewards = swarm.reward_by_version()
    curve = "  ".join(f"v{v}:{r:.2f}" for v, r in rewards[-10:]) or "waiting for accepted samples"
    lines = [f"mean reward by version: {curve}"]
    if swarm.dashboard_url is not None:
        lines.append(f"dashboard: {swarm.dashboard_url}")
    return Group(table, *lines)


async def _run(swarm: LocalSwarm, open_browser: bool) -> str:
    await swarm.start()
    if swarm.dashboard_url is not None:
        console.print(f"dashboard: {swarm.dashboard_url}", highlight=False)
        if open_browser:
            _open(swarm.dashboard_url)
    if not console.is_terminal:
        return await _run_logged(swarm)
    with Live(render(swarm), console=console, refresh_per_second=2, transient=False) as live:
        while True:
            await swarm.poll()
            live.update(render(swarm))
            reason = swarm.finished()
            if reason is not None:
                return reason
            await trio.sleep(1.0)


PROGRESS_EVERY_S = 10.0
"""Not on a terminal (a log file, CI): one progress line per new version, or this often."""


async def _run_logged(swarm: LocalSwarm) -> str:
    """``up``'s progress as lines (the live table redraws in place, which a log cannot):
    one per new policy version, or every ``PROGRESS_EVERY_S`` when none came."""
    last_version = -1
    last_line = -PROGRESS_EVERY_S
    started = trio.current_time()
    while True:
        await swarm.poll()
        reason = swarm.finished()
        version = swarm.version()
        now = trio.current_time()
        if version != last_version or now - last_line >= PROGRESS_EVERY_S or reason:
            rewards = swarm.reward_by_version()
            reward = f"{rewards[-1][1]:.2f} (v{rewards[-1][0]})" if rewards else "-"
            console.print(
                f"[{now - started:6.0f} s] policy v{version}, mean reward {reward},"
                f" {sum(p.alive for p in swarm.procs)} of {len(swarm.procs)} processes up",
                highlight=False,
            )
            last_version, last_line = version, now
        if reason is not None:
            return reason
        await trio.sleep(1.0)


def _open(url: str) -> None:
    """Open ``url`` in a browser where there is one; say so where there is none."""
    try:
        webbrowser.get()
    except webbrowser.Error:
        err_console.print(f"no browser found here; open {url} yourself", highlight=False)
        return
    webbrowser.open(url)


def up(
    workers: Annotated[int, typer.Option("--workers", min=1, help="Honest inference workers.")] = 2,
    versions: Annotated[
        int, typer.Option("--versions", min=1, help="Stop after K versions.")
    ] = 200,
    minutes: Annotated[
        float, typer.Option("--minutes", min=0.1, help="Stop after M minutes.")
    ] = 10.0,
    with_cheater: Annotated[
        bool, typer.Option("--with-cheater/--no-cheater", help="Add a cheating worker.")
    ] = True,
    out: Annotated[Path, typer.Option("--out", help="Where results, ledger and logs go.")] = Path(
        "out/up"
    ),
    http: Annotated[
        str,
        typer.Option(
            "--http",
            help="Where the bootstrap peer serves the dashboard ([ADDR:]PORT; 0: a free port;"
            " 'off': none).",
        ),
    ] = "127.0.0.1:0",
    open_browser: Annotated[
        bool, typer.Option("--open", help="Open the dashboard in a browser.")
    ] = False,
) -> None:
    """Start a whole local swarm (bootstrap, trainer, validator, workers, a cheater) as processes
    on 127.0.0.1, train the embedded model, stop, audit, and write OUT/summary.json."""
    swarm = LocalSwarm(
        UpConfig(
            out=out,
            workers=workers,
            versions=versions,
            minutes=minutes,
            with_cheater=with_cheater,
            http=None if http == "off" else http,
        )
    )
    if swarm.config.http is not None:
        from node.web.serve import parse_http

        parse_http(swarm.config.http)
    swarm.prepare()
    reason = "interrupted (Ctrl-C)"
    try:
        reason = trio.run(_run, swarm, open_browser)
    except KeyboardInterrupt:
        err_console.print("stopping every process (Ctrl-C)…")
    finally:
        swarm.stop()
    console.print(f"\nstopped: {reason}; auditing the ledger…")
    summary = swarm.summarise(reason)
    rewards = summary.get("reward_by_version") or []
    gain = rewards[-1] - rewards[0] if len(rewards) > 1 else 0.0
    table = Table(title=f"summary ({out / 'summary.json'})", show_header=False)
    table.add_row("versions", str(len(rewards)))
    table.add_row(
        "reward v0 -> last",
        f"{rewards[0]:.3f} -> {rewards[-1]:.3f} ({gain:+.3f})" if rewards else "-",
    )
    curve = summary.get("evaluation") or []
    eval_gain = summary.get("eval_gain")
    table.add_row(
        "held-out evaluation",
        f"v{curve[0]['version']} {curve[0]['mean']:.3f} -> v{curve[-1]['version']}"
        f" {curve[-1]['mean']:.3f} ({eval_gain:+.3f})"
        if len(curve) > 1 and eval_gain is not None
        else (f"v{curve[0]['version']} {curve[0]['mean']:.3f}" if curve else "-"),
    )
    table.add_row(
        "accepted / rejected", f"{summary.get('accepted', 0)} / {summary.get('rejected', 0)}"
    )
    table.add_row("slashed", ", ".join(_short(p) for p in summary.get("slashed", [])) or "none")
    table.add_row("banned", ", ".join(_short(p) for p in summary.get("banned", [])) or "none")
    table.add_row(
        "audit", "[green]agrees[/]" if summary.get("audit_ok") else "[red]DISAGREES or missing[/]"
    )
    table.add_row("wall time", f"{summary['wall_s']:.0f} s")
    console.print(table)
    if not summary.get("audit_ok"):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("up")(up)
