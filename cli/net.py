"""Network commands: bootstrap, join, announce, status. Parse, call node/ and bootstrap/,
render; the logic lives in ``node.runtime`` and ``bootstrap.service``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import trio
import typer
from rich.logging import RichHandler

from bootstrap.peers import EMPTY_LIST_HELP, default_peers
from bootstrap.service import BootstrapConfig, BootstrapPeer
from cli.common import HomeOption, console, err_console, open_home
from node import admin
from node.compute.devices import check_nproc, choose
from node.model.loading import check_model_dir
from node.model.text import chat_template_wanted
from node.roles.cheats import cheat_by_name, rogue_by_name
from node.run import load_genesis
from node.run_assets import AssetDirs, check_local
from node.runtime import Node, RuntimeConfig, forever_policy
from swarm.errors import ConfigError, SwarmError
from swarm.messages import parse_role, run_id_of
from swarm.net import DialPolicy, parse_multiaddr, parse_peer_addr, policy_topic
from swarm.net.connections import bounds_for

ListenOption = Annotated[
    list[str] | None,
    typer.Option("--listen", help="Multiaddr to listen on (repeat). Default: the home's config."),
]
HttpOption = Annotated[
    str | None,
    typer.Option(
        "--http",
        help="Serve the read-only web dashboard on [ADDR:]PORT (127.0.0.1 unless ADDR is given).",
    ),
]
BootstrapOption = Annotated[
    list[str] | None,
    typer.Option("--bootstrap", help="Bootstrap peer multiaddr with /p2p/<id> (repeat)."),
]


JOIN_DIAL = DialPolicy()
"""How ``join`` and ``announce`` dial without ``--wait`` (tests swap in a quicker one)."""


def _logging(verbose: bool) -> None:
    handler = RichHandler(console=err_console, show_path=False, rich_tracebacks=False)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        handlers=[handler],
        format="%(message)s",
        force=True,
    )
    # py-libp2p logs peers' protocol mistakes as warnings; they are not ours to act on.
    logging.getLogger("libp2p").setLevel(logging.DEBUG if verbose else logging.CRITICAL)
    logging.getLogger("multiaddr").setLevel(logging.ERROR)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def run_async(fn: Callable[[], Awaitable[Any]]) -> Any:
    """``trio.run`` that re-raises the first ``SwarmError`` (or Ctrl-C) out of task groups."""
    try:
        return trio.run(fn)
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        for leaf in leaves:
            if isinstance(leaf, KeyboardInterrupt):
                raise KeyboardInterrupt from group
        for leaf in leaves:
            if isinstance(leaf, SwarmError):
                raise leaf from group
        raise


def run_until_stopped(fn: Callable[[], Awaitable[Any]]) -> None:
    """``run_async`` for a long-lived command: Ctrl-C is the normal way out and says so."""
    try:
        run_async(fn)
    except KeyboardInterrupt:
        err_console.print("stopped", highlight=False)


def _listen(home_listen: tuple[str, ...], listen: list[str] | None) -> list[str]:
    addrs = list(listen or home_listen)
    for addr in addrs:
        parse_multiaddr(addr)
    return addrs


def _bootstrap_list(given: list[str] | None, home_list: tuple[str, ...]) -> list[str]:
    peers = list(given or home_list or default_peers())
    if not peers:
        raise ConfigError(EMPTY_LIST_HELP)
    for addr in peers:
        parse_peer_addr(addr)
    return peers


async def _forever() -> None:
    await trio.sleep_forever()


def bootstrap(
    listen: ListenOption = None,
    peer: Annotated[
        list[str] | None, typer.Option("--peer", help="Another bootstrap peer to dial (repeat).")
    ] = None,
    run: Annotated[
        list[Path] | None,
        typer.Option("--run", help="Genesis of a run to validate fully (repeat; optional)."),
    ] = None,
    http: HttpOption = None,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics (127.0.0.1).")
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
    home: HomeOption = None,
) -> None:
    """Run a long-lived bootstrap peer (DHT server, gossip router for any run). With --run and
    --http it keeps a replica of that run's ledger from gossip and serves the dashboard of the
    first run given."""
    node_home = open_home(home)
    settings = node_home.load_config()
    addrs = _listen(settings.listen, listen)
    peers = [a for a in (peer or []) if parse_peer_addr(a)]
    genesis = tuple(load_genesis(p) for p in run or [])
    if http is not None:
        from node.web.serve import parse_http

        parse_http(http)
        if not genesis:
            raise ConfigError("--http on a bootstrap peer needs --run GENESIS: the run to show")
    key = node_home.load_key()
    _logging(verbose)
    config = BootstrapConfig(
        key=key,
        listen=addrs,
        peers=peers,
        genesis=genesis,
        ledger_dir=node_home.path / "runs" if http is not None else None,
        metrics_port=metrics_port if metrics_port is not None else (settings.metrics_port or None),
    )

    async def main() -> None:
        with node_home.lock():
            async with BootstrapPeer.start(config) as boot, trio.open_nursery() as nursery:

                async def status(_req: dict[str, Any]) -> dict[str, Any]:
                    return {"status": boot.status()}

                await nursery.start(
                    admin.serve_admin, admin.socket_path(node_home.path), {"status": status}
                )
                for addr in boot.addrs():
                    console.print(addr, highlight=False)
                if http is not None:
                    from node.web.serve import start_dashboard
                    from node.web.views import bootstrap_view

                    view = bootstrap_view(boot, genesis[0], node_home.path)
                    url = await start_dashboard(nursery, view, http)
                    console.print(f"dashboard {url}", highlight=False)
                err_console.print(
                    "bootstrap peer running; add the address above to the"
                    " bootstrap lists. Ctrl-C stops it.",
                    highlight=False,
                )

    run_until_stopped(main)


def join(
    role: Annotated[str, typer.Option("--role", help="trainer, inference or validator.")],
    run: Annotated[Path, typer.Option("--run", help="The run's genesis file.")],
    bootstrap_peers: BootstrapOption = None,
    listen: ListenOption = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Keep dialing until a bootstrap peer answers.")
    ] = False,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Serve Prometheus metrics (127.0.0.1).")
    ] = None,
    http: HttpOption = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
    max_versions: Annotated[
        int | None,
        typer.Option("--max-versions", help="Trainer: stop training after this many versions."),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="A local copy of the run's model (checked against the genesis's model card;"
            " default: the home's cache, else fetched from peers).",
        ),
    ] = None,
    tasks: Annotated[
        Path | None,
        typer.Option(
            "--tasks",
            help="A local copy of the run's data set: its JSONL file or datasets folder (checked).",
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option("--engine", help="torch or vllm (inference and validators; default torch)."),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device", help="cpu, cuda or cuda:N (default: cuda:0 if present, else cpu)."
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype", help="float32 or bfloat16 (default: bfloat16 on CUDA, else float32)."
        ),
    ] = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            help="Trainer: shard the model over N processes, one per device (FSDP2; gloo on"
            " the CPU, nccl on cuda:K..cuda:K+N-1). Default 1.",
        ),
    ] = None,
    cheat: Annotated[
        str | None,
        typer.Option(
            "--cheat",
            hidden=True,
            help="Demo and tests only: submit forged work of this kind (it gets slashed); a"
            " validator: credit-everything (its credits get disputed).",
        ),
    ] = None,
    conn_low: Annotated[
        int | None,
        typer.Option(
            "--conn-low",
            help="Connections trimmed down to (others are dialed while well under it);"
            " config.toml [node] conn_low, default 32 (trainers and validators 128).",
        ),
    ] = None,
    conn_high: Annotated[
        int | None,
        typer.Option(
            "--conn-high",
            help="The most connections (more are refused; from halfway to it the least useful"
            " are trimmed, never the run's trainers, validators, bootstrap peers or our relays);"
            " [node] conn_high, default 48 (trainers and validators 192).",
        ),
    ] = None,
    home: HomeOption = None,
) -> None:
    """Join a run and do the role's work: generate (inference), judge (validator) or train
    (trainer); advertise the role and follow policy gossip."""
    try:
        node_role = parse_role(role)
    except SwarmError as exc:
        raise ConfigError(str(exc)) from exc
    if node_role == "bootstrap":
        raise ConfigError("use `swarm-node bootstrap` to run a bootstrap peer")
    ranks = check_nproc(nproc, node_role)
    genesis = load_genesis(run)
    node_home = open_home(home)
    settings = node_home.load_config()
    config = RuntimeConfig(
        key=node_home.load_key(),
        genesis=genesis,
        role=node_role,
        listen=_listen(settings.listen, listen),
        bootstrap=_bootstrap_list(bootstrap_peers, settings.bootstrap),
        home=node_home,
        metrics_port=metrics_port if metrics_port is not None else (settings.metrics_port or None),
        dial=forever_policy() if wait else JOIN_DIAL,
        announce=settings.announce,
        connections=bounds_for(  # low > high: exit 2, naming the flags
            node_role,
            conn_low if conn_low is not None else settings.conn_low,
            conn_high if conn_high is not None else settings.conn_high,
        ),
    )
    config.check()  # unauthorized role, bad addresses: exit 2 before any network use
    if http is not None:
        from node.web.serve import parse_http

        parse_http(http)
    _logging(verbose)
    # A validator's --cheat is its own judgement edited (a rogue validator), a worker's its work.
    rogue = rogue_by_name(cheat) if cheat is not None and node_role == "validator" else None
    tamper = cheat_by_name(cheat) if cheat is not None and node_role != "validator" else None
    # A local model or data set that differs from the genesis: exit 2 before any network use.
    check_local(genesis.message, node_role, AssetDirs.under(node_home.path), model, tasks)
    compute = choose(engine, device, dtype, nproc=ranks)  # no vllm, no such GPU(s): exit 2
    if model is not None:  # tokenizer that does not fit, chat template missing: exit 2 here
        check_model_dir(model, chat_template=chat_template_wanted(genesis.message))

    from node.roles.launch import launch  # the role's engine and trainer load torch

    async def main() -> None:
        async with (
            Node.start(config) as node,
            launch(
                node,
                node_home.run_dir(node.run_id),
                tamper=tamper,
                rogue=rogue,
                max_versions=max_versions,
                compute=compute,
                model_dir=model,
                tasks=tasks,
                torch_threads=1,
            ) as handle,
            trio.open_nursery() as nursery,
        ):
            if http is not None:
                from node.web.serve import start_dashboard
                from node.web.views import node_view

                view = node_view(node, handle.ledger.path, handle.feed)
                url = await start_dashboard(nursery, view, http)
                console.print(f"dashboard {url}", highlight=False)
            err_console.print(
                f"joined run {node.run_id} as {node.role} ({node.peer_id}); listening on"
                f" {', '.join(node.overlay.addrs())}. Ctrl-C stops the node.",
                highlight=False,
            )
            await _forever()

    run_until_stopped(main)


def announce(
    run: Annotated[Path, typer.Option("--run", help="The run's genesis file.")],
    version: Annotated[int, typer.Option("--version", help="The policy version.", min=0)],
    manifest: Annotated[str, typer.Option("--manifest", help="Manifest id (64 hex chars).")],
    bootstrap_peers: BootstrapOption = None,
    listen: ListenOption = None,
    home: HomeOption = None,
) -> None:
    """Announce a policy version as a genesis trainer (through the home's running node, or
    by joining briefly when none runs)."""
    genesis = load_genesis(run)
    run_id = run_id_of(genesis)
    try:
        manifest_id = bytes.fromhex(manifest)
    except ValueError as exc:
        raise ConfigError(f"--manifest {manifest[:80]!r} is not hex") from exc
    if len(manifest_id) != 32:
        raise ConfigError("--manifest must be 32 bytes (64 hex characters)")
    node_home = open_home(home)
    sock = admin.socket_path(node_home.path)
    if sock.exists():

        async def through_node() -> dict[str, Any]:
            status = (await admin.query(sock, {"cmd": "status"}))["status"]
            if status.get("run_id") != run_id:
                raise ConfigError(
                    f"the node running with home {node_home.path} is in run"
                    f" {status.get('run_id')}, not {run_id}"
                )
            return await admin.query(
                sock, {"cmd": "announce", "version": version, "manifest": manifest}
            )

        answer = run_async(through_node)
        console.print(f"announced policy version {version} ({answer['announced']['id'][:16]})")
        return
    settings = node_home.load_config()
    config = RuntimeConfig(
        key=node_home.load_key(),
        genesis=genesis,
        role="trainer",
        listen=_listen(("/ip4/0.0.0.0/tcp/0",), listen),
        bootstrap=_bootstrap_list(bootstrap_peers, settings.bootstrap),
        home=node_home,
        dial=JOIN_DIAL,
    )
    config.check()
    _logging(False)

    async def transient() -> None:
        async with Node.start(config) as node:
            topic = policy_topic(node.run_id)
            with trio.move_on_after(10):
                while not node.overlay.mesh_peers(topic):
                    await trio.sleep(0.1)
            await node.announce_policy(version, manifest_id)
            await trio.sleep(2 * config.heartbeat)  # let the mesh carry it on

    run_async(transient)
    console.print(f"announced policy version {version}")


def register(app: typer.Typer) -> None:
    app.command("bootstrap")(bootstrap)
    app.command("join")(join)
    app.command("announce")(announce)
