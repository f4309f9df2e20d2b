"""What every command shares: the --home option, opening a home, the consoles."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from node.home import ENV_HOME, NodeHome, resolve_home

# soft_wrap: a message is one line however narrow the terminal; let the terminal wrap it.
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

HomeOption = Annotated[
    Path | None,
    typer.Option(
        "--home",
        envvar=ENV_HOME,
        help="The node's home folder (key, config, data). Default: ~/.local/share/swarm-node.",
        show_default=False,
    ),
]


def _prompt_passphrase() -> str:
    return str(typer.prompt("Key passphrase", hide_input=True))


def open_home(home: Path | None) -> NodeHome:
    return NodeHome(resolve_home(home), _prompt_passphrase)
