"""`swarm-node doctor`: ports, bootstrap reachability, disk, memory, accelerator, versions."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from cli.common import HomeOption, console, open_home
from node.doctor import run_checks

MARK = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}


def doctor(
    bootstrap: Annotated[
        list[str] | None, typer.Option("--bootstrap", help="Check these instead of the config's.")
    ] = None,
    home: HomeOption = None,
) -> None:
    """Check this machine and node home before joining; exit 1 when something must be fixed."""
    checks = run_checks(open_home(home), tuple(bootstrap or ()))
    table = Table(title="swarm-node doctor")
    for col in ("check", "result", "detail", "fix"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.name, MARK[c.status], c.detail, c.hint)
    console.print(table)
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
