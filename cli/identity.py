"""Commands for the node's identity: init, id, key export."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import HomeOption, console, err_console, open_home
from node.home import passphrase_from_env

key_app = typer.Typer(help="The node key.", no_args_is_help=True)


def init(
    home: HomeOption = None,
    passphrase: Annotated[
        bool,
        typer.Option(
            "--passphrase",
            help="Encrypt the key with a passphrase (asked for, or $SWARM_NODE_PASSPHRASE).",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Move an existing key aside and make a new one.")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before --force.")] = False,
) -> None:
    """Create this node's key and config (once). Never overwrites an existing key."""
    node_home = open_home(home)
    if force and node_home.has_key() and not yes:
        typer.confirm(
            f"Replace the key at {node_home.key_path}? The old key is kept beside it, but this"
            " node's peer ID and ledger standing change",
            abort=True,
        )
    secret = passphrase_from_env()
    if passphrase and secret is None:
        secret = typer.prompt(
            "New key passphrase", hide_input=True, confirmation_prompt=True
        ).encode()
    key, moved = node_home.create(secret, force=force)
    if moved is not None:
        console.print(f"old key moved to {moved}")
    console.print(f"peer id:  {key.peer_id}")
    console.print(f"key file: {node_home.key_path}")
    console.print(f"config:   {node_home.config_path}")
    err_console.print(
        "[bold yellow]keep the key file safe: losing it loses this node's identity and ledger"
        " standing (back it up with `swarm-node key export`)[/]"
    )


def node_id(home: HomeOption = None) -> None:
    """Print this node's peer ID."""
    console.print(open_home(home).load_key().peer_id, highlight=False)


@key_app.command("export")
def key_export(
    home: HomeOption = None,
    public: Annotated[
        bool, typer.Option("--public", help="Print the public key (hex) instead of the key file.")
    ] = False,
) -> None:
    """Print the public key, or the private key file (PEM, as stored) for a backup."""
    node_home = open_home(home)
    key = node_home.load_key()
    if public:
        console.print(key.public.hex(), highlight=False)
    else:
        typer.echo(node_home.key_path.read_text(), nl=False)


def register(app: typer.Typer) -> None:
    app.command("init")(init)
    app.command("id")(node_id)
    app.add_typer(key_app, name="key")
