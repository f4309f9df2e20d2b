"""Commands for the ledger and its audit: ledger show, audit, audit export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import HomeOption, console, open_home
from cli.net import BootstrapOption
from node.run import load_genesis
from swarm.errors import ConfigError
from swarm.evidence import EvidenceStore
from swarm.ledger import LedgerStore
from swarm.ledger.training import read_disputes
from swarm.ledger.views import QuotaUse, read_quota_use
from swarm.messages import PolicyAnnouncement, decode, run_id_of
from swarm.net import parse_peer_addr
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
    limit: Annotated[
        int, typer.Option("--limit", min=1, max=10_000, help="Events and balances per page.")
    ] = 50,
    before: Annotated[
        str | None,
        typer.Option("--before", help="Page on: events with ids below this hex id."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    home: HomeOption = None,
) -> None:
    """Print balances (the banned first), open disputes and the newest events, a page at a time
    (index reads only, however large the ledger), and each worker's requests of the window's
    versions with a verdict (``submitted 37 of 64``: what it did not submit of its quota shows;
    one scan of those versions' verdicts)."""
    path = _ledger_path(db, run, home)
    store = LedgerStore.open_existing(path)
    try:
        cursor = bytes.fromhex(before) if before else None
    except ValueError as exc:
        raise ConfigError(f"--before {before!r} is not a hex event id") from exc
    balances = store.balances()
    peers = store.lowest(limit) if peer is None else [peer]
    events = store.page(peer=peer, before=cursor, limit=limit)
    disputes = store.disputes(limit)
    conflicts = _policy_conflicts(store.path)
    training_disputes = read_disputes(store.path)
    params = store.genesis.message.params
    tally = read_quota_use(path, params.quota, params.async_level + 1)
    uses = tally.of(peer) if peer is not None else tally.rows()[:limit]
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "run_id": store.run_id,
                    "events_total": len(store),
                    "pending": store.pending_count(),
                    "balances": {
                        p: {"balance": balances.of(p), "banned": balances.banned(p)} for p in peers
                    },
                    "disputes": [
                        {
                            "id": d.id.hex(),
                            "disputed_validator": d.message.peer,
                            "by": d.signer,
                            "verdict": d.message.evidence.hex(),
                            "disputed_verdict": d.message.related[0].hex(),
                        }
                        for d in disputes
                    ],
                    "events": [
                        {
                            "id": e.id.hex(),
                            "event": e.event,
                            "peer": e.peer,
                            "amount": e.amount,
                            "evidence": e.evidence.hex(),
                            "signer": e.signer,
                            "counted": e.counted,
                        }
                        for e in events
                    ],
                    "next_before": events[-1].id.hex() if len(events) == limit else None,
                    "policy_conflicts": conflicts,
                    "training_disputes": training_disputes,
                    "quota_use": {
                        "quota": params.quota,
                        "versions": tally.versions(),
                        "workers": [u.as_dict() for u in uses],
                    },
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
    if disputes:
        disputes_table = Table(title=f"{store.dispute_count()} open dispute(s): settle with audit")
        for col in ("disputed validator", "by", "disputed verdict"):
            disputes_table.add_column(col)
        for d in disputes:
            disputes_table.add_row(
                d.message.peer[-12:], d.signer[-12:], d.message.related[0].hex()[:16]
            )
        console.print(disputes_table)
    if training_disputes:
        trainer_table = Table(
            title=f"{len(training_disputes)} training dispute(s): check with audit --training"
        )
        for col in ("version", "reason", "trainer", "by", "detail"):
            trainer_table.add_column(col)
        for t in training_disputes:
            trainer_table.add_row(
                str(t["version"]), t["reason"], t["trainer"][-12:], t["by"][-12:], t["detail"]
            )
        console.print(trainer_table)
    events_table = Table(title=f"newest {len(events)} of {len(store)} events")
    for col in ("id", "event", "peer", "amount", "evidence", "signer", "counted"):
        events_table.add_column(col)
    for e in events:
        events_table.add_row(
            e.id.hex()[:16],
            e.event,
            e.peer[-12:],
            str(e.amount),
            e.evidence.hex()[:16],
            e.signer[-12:],
            "yes" if e.counted else "no",
        )
    console.print(events_table)
    if len(events) == limit:
        console.print(f"next page: --before {events[-1].id.hex()}")
    if uses:
        console.print(_quota_table(uses, params.quota))
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


def _quota_table(uses: list[QuotaUse], quota: int) -> Table:
    """Requests per worker and version with a verdict, fewest first: withholding shows."""
    what = f"of the quota of {quota} per version" if quota else "(this run has no quota)"
    table = Table(title=f"requests with a verdict {what}")
    for col in ("worker", "version", "requests"):
        table.add_column(col)
    for u in uses:
        table.add_row(u.worker[-12:], f"v{u.version}", u.describe())
    return table


def _policy_conflicts(ledger_path: Path) -> list[dict[str, Any]]:
    """Policy versions announced with two manifests, as the node that saw them kept them in the
    evidence store beside its ledger (none when it has no store)."""
    path = ledger_path.with_name("evidence.db")
    if not path.exists():
        return []
    store = EvidenceStore(path)
    by_version: dict[int, list[dict[str, str]]] = {}
    try:
        for raw in store.of_kind(POLICY_CONFLICT):
            a = decode(raw, PolicyAnnouncement)
            by_version.setdefault(a.message.version, []).append(
                {"manifest": a.message.manifest_id.hex(), "signer": a.signer}
            )
    finally:
        store.close()
    return [{"version": v, "manifests": ms} for v, ms in sorted(by_version.items())]


def audit(
    target: Annotated[
        list[str] | None,
        typer.Argument(
            help="LEDGER_DB or BUNDLE to verify; or `export SUBMISSION_ID` with --db, -o."
            " Omit it with --run and --bootstrap to audit from the swarm."
        ),
    ] = None,
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
    run: Annotated[
        Path | None,
        typer.Option("--run", help="With --bootstrap: the genesis of the run to audit."),
    ] = None,
    bootstrap_peers: BootstrapOption = None,
    discover: Annotated[
        float,
        typer.Option("--discover", min=1, help="Seconds to look for the run's validators."),
    ] = 60.0,
    workdir: Annotated[
        Path | None,
        typer.Option("--workdir", help="Where a swarm audit keeps what it fetched (default: temp)"),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="A copy of the run's model (checked against its card; default: the home's cache).",
        ),
    ] = None,
    tasks: Annotated[
        Path | None,
        typer.Option("--tasks", help="A copy of the run's data set (default: the home's cache)."),
    ] = None,
    training: Annotated[
        bool,
        typer.Option(
            "--training",
            help="With --run and --bootstrap: audit the trainer (its signed records, replaying"
            " each chosen step) instead of the ledger.",
        ),
    ] = False,
    versions: Annotated[
        str | None,
        typer.Option("--versions", help="--training: the versions to audit (1,3,5-8)."),
    ] = None,
    sample: Annotated[
        int | None,
        typer.Option("--sample", min=1, help="--training: audit N versions drawn at random."),
    ] = None,
    home: HomeOption = None,
) -> None:
    """Re-verify every signature and balance of a ledger and replay the evidence of every slash
    and dispute (exit 1 on any disagreement); or export/replay one self-contained proof bundle
    (with --db, the manifest ids of a run with a quota come from that ledger's evidence store
    when the bundle holds no announcement of its version).
    With --run and --bootstrap, fetch the ledger, the evidence and the weights from the swarm
    first (a sample of 8 credits unless --credits says otherwise)."""
    # The audit re-runs the model: torch loads only for this command.
    from node.audit import (
        AuditAssets,
        audit_bundle,
        audit_ledger,
        export_bundle,
        is_ledger_file,
        ledger_manifests,
        no_manifests,
        policy_dir_source,
    )
    from node.audit_weights import checked_source, store_manifests

    if training:
        if run is None or not bootstrap_peers:
            raise ConfigError("audit --training needs --run GENESIS and --bootstrap ADDR")
        _audit_training(
            run,
            bootstrap_peers,
            workdir,
            AuditAssets(model=model, tasks=tasks, home=home),
            versions,
            sample,
            discover,
            as_json,
        )
        return
    if not target:
        if run is None or not bootstrap_peers:
            raise ConfigError(
                "name what to audit: LEDGER_DB, BUNDLE, or --run GENESIS --bootstrap ADDR"
            )
        assets = AuditAssets(model=model, tasks=tasks, home=home)
        path, rows = _audit_swarm(run, bootstrap_peers, workdir, credits, discover, assets)
        _print_rows(path, rows, as_json)
        return
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
    if policy_dir is not None:
        # A trainer's run folder keeps the signed manifests beside its policies: every file is
        # checked against its version's tensor hashes before a replay uses it.
        source = checked_source(source, store_manifests(policy_dir.parent / "shards"))
    assets = AuditAssets(model=model, tasks=tasks, home=home)
    if is_ledger_file(path):
        rows = audit_ledger(path, source, credits=credits, assets=assets)
    else:
        # A run with a quota needs the manifest id of the bundle's version: from the bundle's
        # own announcements, else from the evidence store beside the ledger --db names.
        manifests = ledger_manifests(db) if db is not None else no_manifests
        rows = audit_bundle(path, source, assets, manifests=manifests)
    _print_rows(path, rows, as_json)


def _audit_swarm(
    run: Path,
    bootstrap: list[str],
    workdir: Path | None,
    credits: int | None,
    discover: float,
    assets: Any,
) -> tuple[Path, list[Any]]:
    """Gather from the swarm (a node that leaves before the replay), then replay offline."""
    import tempfile

    import trio

    from node.audit import audit_ledger
    from node.audit_swarm import gather
    from node.audit_weights import checked_source, store_manifests

    genesis = load_genesis(run)
    for addr in bootstrap:
        parse_peer_addr(addr)
    folder = workdir or Path(tempfile.mkdtemp(prefix="swarm-audit-"))
    n = 8 if credits is None else credits
    console.print(f"fetching the ledger, evidence and weights of run {run_id_of(genesis)}...")
    gathered = trio.run(lambda: gather(genesis, bootstrap, folder, credits=n, discover_s=discover))
    if gathered.missing_versions:
        console.print(f"weights not served by any peer: v{gathered.missing_versions}")
    evidence = EvidenceStore(gathered.evidence)
    try:
        rows = audit_ledger(
            gathered.ledger,
            checked_source(gathered.policy_path, store_manifests(gathered.shards)),
            credits=n,
            evidence=evidence,
            assets=assets,
            manifests=gathered.manifest_id,
        )
    finally:
        evidence.close()
    return gathered.ledger, rows


def _audit_training(
    run: Path,
    bootstrap: list[str],
    workdir: Path | None,
    assets: Any,
    versions: str | None,
    sample: int | None,
    discover: float,
    as_json: bool,
) -> None:
    """``audit --training``: records, receipts and a replay of each chosen step."""
    import tempfile

    import trio

    from node.audit_training import audit_training, parse_versions

    genesis = load_genesis(run)
    for addr in bootstrap:
        parse_peer_addr(addr)
    wanted = parse_versions(versions) if versions else None
    folder = workdir or Path(tempfile.mkdtemp(prefix="swarm-train-audit-"))
    console.print(f"auditing the trainer of run {run_id_of(genesis)}...")
    report = trio.run(
        lambda: audit_training(
            genesis,
            bootstrap,
            folder,
            assets,
            versions=wanted,
            sample=sample,
            discover_s=discover,
        )
    )
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        table = Table(title=f"training audit of run {run_id_of(genesis)}")
        for col in ("version", "result", "detail"):
            table.add_column(col)
        for row in report.rows:
            colour = {"agreed": "green", "disputed": "red"}.get(row.outcome, "yellow")
            detail = row.detail or "; ".join(f"{f.reason}: {f.detail}" for f in row.findings)
            table.add_row(str(row.version), f"[{colour}]{row.outcome}[/]", detail)
        console.print(table)
        if report.coverage:
            cov = Table(title="coverage (receipted samples per worker)")
            for col in ("worker", "handed", "trained", "left out"):
                cov.add_column(col)
            for worker, c in sorted(report.coverage.items()):
                cov.add_row(worker[-12:], str(c["handed"]), str(c["trained"]), str(c["left_out"]))
            console.print(cov)
        for d in report.disputes:
            console.print(
                f"[red]training dispute[/] v{d['version']} {d['reason']}: {d['detail']}"
                f" (by {d['by'][-8:]})"
            )
        console.print("[green]audit agrees[/]" if report.ok else "[red]the trainer is disputed[/]")
    if not report.ok:
        raise typer.Exit(1)


def _print_rows(path: Path, rows: list[Any], as_json: bool) -> None:
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
