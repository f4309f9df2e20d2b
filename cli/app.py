"""The `swarm-node` command: parse, call node/ or swarm/, render. No logic of its own.

Every ``SwarmError`` becomes one line on stderr and exit code 2; so do usage errors.
"""

from __future__ import annotations

import sys

import typer

from cli import doctor, identity, ledger, net, run, shardcast, status, up
from cli.common import err_console
from swarm.errors import SwarmError

app = typer.Typer(
    name="swarm-node",
    help="Train language models by RL on a permissionless swarm.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
identity.register(app)
run.register(app)
net.register(app)
status.register(app)
ledger.register(app)
shardcast.register(app)
up.register(app)
doctor.register(app)


def main(argv: list[str] | None = None) -> None:
    # Standalone mode: typer turns usage errors into exit 2 and an aborted prompt into exit 1.
    try:
        app(args=argv)
    except SwarmError as exc:
        err_console.print(f"error: {exc}", highlight=False, markup=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
