"""``swarm-node status``: the running node's state, asked over its admin socket and rendered
(the role's counters, its ledger's quotas, warnings, policy conflicts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import HomeOption, console, open_home
from cli.net import run_async
from node import admin
from swarm.errors import SwarmError
from swarm.ledger import LedgerStore
from swarm.ledger.views import read_quota_use


def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    home: HomeOption = None,
) -> None:
    """Show the running node's run, role, peers by role, policy version and gossip counts."""
    sock = admin.socket_path(open_home(home).path)
    info = run_async(lambda: admin.query(sock, {"cmd": "status"}))["status"]
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    table = Table(show_header=False, box=None)
    for key in (
        "run_id",
        "run_name",
        "role",
        "peer_id",
        "reachability",
        "dht_mode",
        "policy_version",
        "uptime_s",
        "connected_peers",
    ):
        if key in info:
            table.add_row(key, str(info[key]))
    reach = info.get("reachability_detail") or {}
    if reach.get("reason"):
        table.add_row("reachability why", str(reach["reason"]))
    relay = info.get("relay") or {}
    for held in relay.get("reservations", []):
        table.add_row("relay slot", f"{held['relay']} (renewed, {held['expires_in_s']} s left)")
    for addr, why in (relay.get("refused") or {}).items():
        table.add_row("relay refused", f"{addr}: {why}")
    for addr in info.get("listen_addrs", []):
        table.add_row("listen", addr)
    for role, peers in info.get("peers_by_role", {}).items():
        table.add_row(f"peers ({role})", f"{len(peers)}  " + " ".join(p[-8:] for p in peers))
    gossip = info.get("gossip", {})
    for topic, n in gossip.get("accepted", {}).items():
        table.add_row(f"accepted ({topic})", str(n))
    for topic, reasons in gossip.get("rejected", {}).items():
        for reason, n in reasons.items():
            table.add_row(f"rejected ({topic}, {reason})", str(n))
    _role_rows(table, info.get("role_status", {}))
    if "worker" not in info.get("role_status", {}):
        _quota_rows(table, open_home(home).run_dir(str(info.get("run_id"))) / "ledger.db")
    for warning in info.get("warnings", []):
        table.add_row("WARNING", warning)
    for c in info.get("policy_conflicts", []):
        kept, refused = c["accepted"], c["refused"]
        table.add_row(
            "POLICY CONFLICT",
            f"v{c['version']}: kept {kept['manifest'][:16]} ({kept['signer'][-8:]}),"
            f" refused {refused['manifest'][:16]} ({refused['signer'][-8:]})",
        )
    console.print(table)


QUOTA_ROWS = 3
"""Workers with the fewest requests of the newest version that ``status`` lists."""


def _quota_rows(table: Table, ledger: Path) -> None:
    """From the node's ledger (a validator's, a bootstrap peer's replica): how many workers
    have verdicts of the newest version, and the few that submitted the least of their quota
    (``ledger show`` lists them all)."""
    if not ledger.exists():
        return
    try:
        store = LedgerStore.open_existing(ledger)
        params = store.genesis.message.params
        store.close()
        tally = read_quota_use(ledger, params.quota, params.async_level + 1)
    except SwarmError as exc:
        table.add_row("requests", f"ledger not readable: {exc}")
        return
    rows = tally.rows()
    if not rows:
        return
    table.add_row(f"requests v{rows[0].version}", f"{len(rows)} worker(s) with verdicts")
    for use in rows[:QUOTA_ROWS]:
        table.add_row(f"requests v{use.version}", f"{use.worker[-12:]} {use.describe()}")


def _evaluation_line(e: dict[str, Any]) -> str:
    """The held-out curve in one line: first and latest point, gain, records held."""
    line = f"v{e['latest_version']} {e['latest_mean']:.3f}"
    if e.get("gain") is not None:
        line = f"v{e['first_version']} {e['first_mean']:.3f} -> {line} ({e['gain']:+.3f})"
    extra = f", {e['conflicts']} conflicting" if e.get("conflicts") else ""
    return f"{line}; {e['count']} signed evaluations held{extra}"


def _role_rows(table: Table, role_status: dict[str, Any]) -> None:
    """The role's own figures: ledger standing, work done, downloads."""
    model = role_status.get("model")
    if model:
        where = model.get("dir") or "being fetched from peers"
        table.add_row("model", f"{model.get('name')} (card {model.get('card')}): {where}")
    ledger = role_status.get("ledger", {})
    if ledger:
        table.add_row("ledger balance", str(ledger.get("balance")))
        table.add_row("ledger events", str(ledger.get("events")))
        if ledger.get("banned"):
            table.add_row("banned peers", " ".join(p[-8:] for p in ledger["banned"]))
        for key, label in (("disputes", "open disputes"), ("pending", "events awaiting")):
            if ledger.get(key):
                table.add_row(f"ledger {label}", str(ledger[key]))
        if ledger.get("refused"):
            table.add_row(
                "ledger refused", f"{ledger['refused']} (last: {ledger.get('last_refusal', '')})"
            )
    for section in ("worker", "validator", "trainer"):
        for key, value in role_status.get(section, {}).items():
            if key == "group" and isinstance(value, dict):  # several trainers: every figure
                for k, v in value.items():
                    shown = " ".join(p[-8:] for p in v) if isinstance(v, list) else v
                    table.add_row(f"trainer group {k}", str(shown))
                continue
            if key == "quota_used" and isinstance(value, dict):  # a worker's own requests
                for version, used in value.items():
                    table.add_row(f"{section} requests {version}", f"made {used}")
                continue
            if isinstance(value, dict):
                value = ", ".join(
                    f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}"
                    for k, v in list(value.items())[-8:]
                )
            elif isinstance(value, list):  # dead letters: how many, and the first one's answer
                first = value[0] if value else None
                value = f"{len(value)}" + (f" (first: {first})"[:120] if first else "")
            table.add_row(f"{section} {key}", str(value))
    evaluation = role_status.get("evaluation") or {}
    if evaluation.get("count"):
        table.add_row("held-out evaluation", _evaluation_line(evaluation))
    training = role_status.get("training") or {}
    if training.get("records"):
        disputes = training.get("disputes") or []
        line = f"{training['records']} records (latest v{training.get('latest_record')})"
        if "audited" in training:
            line += f", {training.get('agreed', 0)} of {training['audited']} audits agreed"
        count = training.get("dispute_count", len(disputes))
        line += f", {count} training dispute(s)" if count else ", no disputes"
        table.add_row("trainer audit", line)
        for d in disputes[-3:]:
            table.add_row(
                f"training dispute v{d['version']}", f"{d['reason']}: {d['detail']}"[:120]
            )
    disk = role_status.get("disk") or {}
    if disk:
        table.add_row("disk used", f"{disk.get('total', 0) / 2**20:.1f} MiB under the run folder")
    shardcast = role_status.get("shardcast") or {}
    fetch = shardcast.get("fetch")
    if fetch:
        table.add_row("download", json.dumps(fetch)[:120])
    transfers = shardcast.get("transfers") or {}
    for version, t in list((transfers.get("versions") or {}).items())[-3:]:
        kind = "patch" if t.get("patch") else "whole"
        table.add_row(f"policy v{version}", f"{kind}: {_mib(t['bytes'])} of {_mib(t['full'])} MiB")
    if transfers.get("versions"):
        table.add_row(
            "policy bytes",
            f"{_mib(transfers['bytes'])} MiB moved, {_mib(transfers['saved_bytes'])} MiB saved"
            f" against whole versions ({transfers.get('refused_versions', 0)} versions refused)",
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def register(app: typer.Typer) -> None:
    app.command("status")(status)
