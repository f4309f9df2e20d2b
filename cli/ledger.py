"""Commands for the ledger and its audit: ledger show, audit, audit export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import HomeOption, console, open_home
from node.run import load_genesis
from swarm.errors import ConfigError
from swarm.ledger import LedgerStore
from swarm.messages import PolicyAnnouncement, decode, run_id_of
from swarm.net.gossip import POLICY_CONFLICT

ledger_app = typer.Typer(
    help="The run's ledger of grants, credits and slashes.", no_args_is_help=True
)

DbOption = Annotated[
    Path | None, typer.Option("--db", help="A ledger database (default: the node's, with --run).")
]
RunOption = Annotated[
    Path | None, typer.Option("--run", help="The run genesis, to find the node's own ledger.")
]


def _ledger_path(db: Path | None, run: Path | None, home: Path | None) -> Path:
    if db is not None:
        return db
    if run is None:
        raise ConfigError("name a ledger: --db LEDGER_DB, or --run GENESIS for this node's own")
    return open_home(home).run_dir(run_id_of(load_genesis(run))) / "ledger.db"


@ledger_app.command("show")
def ledger_show(
    db: DbOption = None,
    run: RunOption = None,
    peer: Annotated[str | None, typer.Option("--peer", help="Only this peer's events.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    home: HomeOption = None,
) -> None:
    """Print balances (who is banned) and events."""
    store = LedgerStore.open_existing(_ledger_path(db, run, home))
    balances = store.balances()
    events = [e for e in store.events() if peer is None or e.message.peer == peer]
    peers = sorted(balances.by_peer) if peer is None else [peer]
    conflicts = _policy_conflicts(store)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "run_id": store.run_id,
                    "balances": {
                        p: {"balance": balances.of(p), "banned": balances.banned(p)} for p in peers
                    },
                    "events": [
                        {
                            "id": e.id.hex(),
                            "event": e.message.event,
                            "peer": e.message.peer,
                            "amount": e.message.amount,
                            "evidence": e.message.evidence.hex(),
                            "signer": e.signer,
                            "counted": e.id in balances.counted,
                        }
                        for e in events
                    ],
                    "policy_conflicts": conflicts,
                },
                indent=2,
            )
        )
        return
    table = Table(title=f"run {store.run_id}: balances (newcomers start at {balances.initial})")
    for col in ("peer", "balance", "status"):
        table.add_column(col)
    for p in peers:
        table.add_row(p, str(balances.of(p)), "[red]banned[/]" if balances.banned(p) else "ok")
    console.print(table)
    events_table = Table(title=f"{len(events)} events")
    for col in ("event", "peer", "amount", "evidence", "signer"):
        events_table.add_column(col)
    for e in events[-50:]:
        m = e.message
        events_table.add_row(
            m.event, m.peer[-12:], str(m.amount), m.evidence.hex()[:16], e.signer[-12:]
        )
    console.print(events_table)
    if conflicts:
        conflict_table = Table(
            title=f"[red]{len(conflicts)} policy version(s) with two manifests[/]"
        )
        for col in ("version", "manifest", "signer"):
            conflict_table.add_column(col)
        for c in conflicts:
            for m in c["manifests"]:
                conflict_table.add_row(str(c["version"]), m["manifest"][:16], m["signer"][-12:])
        console.print(conflict_table)


def _policy_conflicts(store: LedgerStore) -> list[dict[str, Any]]:
    """Policy versions announced with two manifests (kept by the node that saw them)."""
    by_version: dict[int, list[dict[str, str]]] = {}
    for raw in store.evidence_of_kind(POLICY_CONFLICT):
        a = decode(raw, PolicyAnnouncement)
        by_version.setdefault(a.message.version, []).append(
            {"manifest": a.message.manifest_id.hex(), "signer": a.signer}
        )
    return [{"version": v, "manifests": ms} for v, ms in sorted(by_version.items())]


def audit(
    target: Annotated[
        list[str],
        typer.Argument(
            help="LEDGER_DB or BUNDLE to verify; or `export SUBMISSION_ID` with --db, -o."
        ),
    ],
    policy_dir: Annotated[
        Path | None,
        typer.Option("--policy-dir", help="Folder with v{N}.safetensors weights to replay on."),
    ] = None,
    db: DbOption = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Bundle to write.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    credits: Annotated[
        int | None,
        typer.Option("--credits", min=0, help="Replay a random sample of N credits (default all)."),
    ] = None,
) -> None:
    """Re-verify every signature and balance of a ledger and replay the evidence of every slash
    (exit 1 on any disagreement); or export/replay one self-contained proof bundle."""
    # The audit re-runs the model: torch loads only for this command.
    from node.audit import (
        audit_bundle,
        audit_ledger,
        export_bundle,
        is_ledger_file,
        policy_dir_source,
    )

    if target[0] == "export":
        if len(target) != 2 or db is None or output is None:
            raise ConfigError(
                "usage: swarm-node audit export SUBMISSION_ID --db LEDGER_DB -o BUNDLE"
            )
        try:
            submission_id = bytes.fromhex(target[1])
        except ValueError as exc:
            raise ConfigError(f"{target[1]!r} is not a hex submission id") from exc
        export_bundle(db, submission_id, output)
        console.print(f"proof bundle written to {output}")
        return
    if len(target) != 1:
        raise ConfigError("audit takes one LEDGER_DB or BUNDLE")
    path = Path(target[0])
    source = policy_dir_source(policy_dir)
    if is_ledger_file(path):
        rows = audit_ledger(path, source, credits=credits)
    else:
        rows = audit_bundle(path, source)
    bad = [r for r in rows if r.ok is False]
    unchecked = [r for r in rows if r.ok is None]
    if as_json:
        typer.echo(
            json.dumps(
                {"ok": not bad, "unchecked": len(unchecked), "rows": [r.__dict__ for r in rows]},
                indent=2,
            )
        )
    else:
        table = Table(title=f"audit of {path}")
        for col in ("subject", "check", "result", "detail"):
            table.add_column(col)
        for r in rows:
            result = {True: "[green]agree[/]", False: "[red]DISAGREE[/]", None: "unchecked"}[r.ok]
            table.add_row(r.subject, r.check, result, r.detail)
        console.print(table)
        console.print(
            "[green]audit agrees[/]" if not bad else f"[red]{len(bad)} disagreement(s)[/]"
        )
    if bad:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(ledger_app, name="ledger")
    app.command("audit")(audit)
