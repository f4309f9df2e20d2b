"""SHARDCAST commands: publish a policy version (genesis trainers), fetch one. Parse, call
``node.shardcast`` and ``swarm.shardcast``, render."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import trio
import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from cli.common import HomeOption, console, err_console, open_home
from cli.net import (
    BootstrapOption,
    ListenOption,
    _bootstrap_list,
    _listen,
    _logging,
    run_until_stopped,
)
from node.run import load_genesis
from node.runtime import Node, RuntimeConfig
from node.shardcast import MIB, ShardcastService, open_store
from node.version_chain import VersionChain
from swarm.errors import PeerError
from swarm.messages import RunGenesis, Signed, run_id_of
from swarm.net import policy_topic
from swarm.net.host import check_peer_id
from swarm.shardcast import FetchConfig, FetchProgress, ShardStore, inline_manifest, publish
from swarm.shardcast.datachannel import DataChannelConfig

RETRY_S = 2.0
"""``shardcast fetch``: a failed fetch is tried again after this, until ``--wait`` is spent."""

shardcast_app = typer.Typer(
    help="Policy weights: publish a version (trainers), fetch one from the swarm.",
    no_args_is_help=True,
)

RunOption = Annotated[Path, typer.Option("--run", help="The run's genesis file.")]
MaxDiskOption = Annotated[
    int | None,
    typer.Option("--max-disk", help="Disk budget for kept versions, MiB.", min=1),
]
DataHostOption = Annotated[
    str,
    typer.Option("--data-host", help="Address the plain-TCP data channel binds and offers."),
]
DataPortOption = Annotated[int, typer.Option("--data-port", help="Data channel port (0: any).")]


def _config(
    home: Any, genesis: Signed[RunGenesis], role: str, listen: Any, bootstrap: Any
) -> RuntimeConfig:
    settings = home.load_config()
    return RuntimeConfig(
        key=home.load_key(),
        genesis=genesis,
        role=role,  # type: ignore[arg-type]
        listen=_listen(settings.listen, listen),
        bootstrap=_bootstrap_list(bootstrap, settings.bootstrap),
        home=home,
    )


@asynccontextmanager
async def _serving(
    config: RuntimeConfig, store: ShardStore, data_host: str, data_port: int
) -> AsyncIterator[tuple[Node, ShardcastService]]:
    """A node with SHARDCAST serving ``store`` (and its data channel on host:port)."""
    async with (
        Node.start(config) as node,
        ShardcastService.start(
            node, config.genesis, store, data_channel=DataChannelConfig(data_host, data_port)
        ) as service,
    ):
        yield node, service


@shardcast_app.command("publish")
def publish_cmd(
    files: Annotated[
        list[Path],
        typer.Argument(help="A safetensors checkpoint, or the files of a sharded one in order."),
    ],
    version: Annotated[int, typer.Option("--version", help="The policy version.", min=0)],
    run: RunOption,
    shard_mib: Annotated[
        int | None, typer.Option("--shard-mib", help="Shard size in MiB (default: the run's).")
    ] = None,
    max_disk: MaxDiskOption = None,
    serve: Annotated[
        bool, typer.Option("--serve/--no-serve", help="Join, announce and serve until Ctrl-C.")
    ] = True,
    data_host: DataHostOption = "0.0.0.0",
    data_port: DataPortOption = 0,
    bootstrap_peers: BootstrapOption = None,
    listen: ListenOption = None,
    home: HomeOption = None,
) -> None:
    """Cut FILES (one version: a checkpoint, or a sharded checkpoint's files) into shards,
    sign the manifest (genesis trainers only), store it; then serve it, advertise it and
    announce it on the policy topic. Published here, a version travels whole."""
    node_home = open_home(home)
    genesis = load_genesis(run)
    key = node_home.load_key()
    store = open_store(node_home.path, genesis, max_disk)
    signed = publish(
        files[0] if len(files) == 1 else files,
        key=key,
        genesis=genesis,
        version=version,
        store=store,
        shard_size=shard_mib * MIB if shard_mib else None,
    )
    m = signed.message
    console.print(
        f"version {version}: {m.total_size / MIB:.1f} MiB in {len(m.shard_hashes)} shards of"
        f" {m.shard_size / MIB:g} MiB, manifest {signed.id.hex()}, stored in"
        f" {store.directory(version)}",
        highlight=False,
    )
    if not serve:
        return
    config = _config(node_home, genesis, "trainer", listen, bootstrap_peers)
    config.check()
    _logging(False)

    async def main() -> None:
        async with _serving(config, store, data_host, data_port) as (node, service):
            await service.advertise(version)
            topic = policy_topic(run_id_of(genesis))
            with trio.move_on_after(10):
                while not node.overlay.mesh_peers(topic):
                    await trio.sleep(0.1)
            await node.announce_policy(version, signed.id, inline_manifest(signed))
            err_console.print(
                f"announced version {version}; serving it (data channel port"
                f" {service.channel.port if service.channel else '-'}). Ctrl-C stops.",
                highlight=False,
            )
            await trio.sleep_forever()

    run_until_stopped(main)


@shardcast_app.command("fetch")
def fetch_cmd(
    run: RunOption,
    version: Annotated[
        int | None, typer.Option("--version", help="Version to fetch (default: newest).", min=0)
    ] = None,
    max_disk: MaxDiskOption = None,
    wait: Annotated[
        float,
        typer.Option(
            "--wait",
            help="Seconds to wait for a provider to appear and serve (a failed fetch is tried"
            " again until then).",
        ),
    ] = 30.0,
    serve: Annotated[
        bool, typer.Option("--serve", help="Keep serving the version after the fetch.")
    ] = False,
    data_host: DataHostOption = "0.0.0.0",
    data_port: DataPortOption = 0,
    concurrency: Annotated[int, typer.Option("--concurrency", help="Shards at once.", min=1)] = 4,
    from_peers: Annotated[
        list[str] | None,
        typer.Option("--from", help="Fetch from this peer ID only (repeatable); for debugging."),
    ] = None,
    bootstrap_peers: BootstrapOption = None,
    listen: ListenOption = None,
    home: HomeOption = None,
) -> None:
    """Fetch a policy version from every provider at once; resumes an interrupted fetch."""
    only = tuple(from_peers or ())
    for peer in only:
        check_peer_id(peer)
    node_home = open_home(home)
    genesis = load_genesis(run)
    store = open_store(node_home.path, genesis, max_disk)
    config = _config(node_home, genesis, "inference", listen, bootstrap_peers)
    config.check()
    _logging(False)

    async def main() -> None:
        async with _serving(config, store, data_host, data_port) as (node, service):
            with trio.move_on_after(wait) as waiting:
                if only:  # their adverts say how to reach them (relayed addresses too)
                    while not all(node.membership.advert_of(p) for p in only):
                        await trio.sleep(0.2)
                while not only and not await service.providers(version):
                    await trio.sleep(0.2)
            with Progress(
                TextColumn("[bold]v{task.fields[version]}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[peers]} peers"),
                console=console,
            ) as bar:
                task = bar.add_task("fetch", total=None, version="?", peers=0)

                def show(p: FetchProgress) -> None:
                    active = sum(1 for s in p.peers() if not s["dropped"])
                    bar.update(
                        task,
                        total=p.total_bytes,
                        completed=p.done_bytes,
                        version=p.version,
                        peers=active,
                    )

                # Tried again until --wait is spent: a provider reached only through a
                # relay may refuse the first circuit (its reservation being renewed), or one at
                # its connection cap the first dial (a CI run's fetch across two NATs failed
                # at its one try, 4 s into a 60 s --wait). What was verified is kept.
                while True:
                    try:
                        result = await service.fetch(
                            version,
                            config=FetchConfig(concurrency=concurrency),
                            on_progress=show,
                            only=only,
                        )
                        break
                    except PeerError as exc:
                        if trio.current_time() + RETRY_S >= waiting.deadline:
                            raise PeerError(f"{exc} (tried for {wait:g} s: --wait)") from exc
                        bar.console.print(f"[yellow]retrying in {RETRY_S:g} s:[/] {exc}")
                        await trio.sleep(RETRY_S)
                # Which path each peer's shards took, while the connections are up.
                paths = {
                    str(p["peer"]): service.path_to(str(p["peer"])) for p in result.progress.peers()
                }
                # A patch needs its base (and the chain back to a snapshot) to load, from any
                # provider (a --from peer need not hold the whole chain); a sharded version is
                # split into its files.
                loaded = await VersionChain(service.store).weights(
                    service, result.version, config=FetchConfig(concurrency=concurrency)
                )
            console.print(
                f"version {result.version} complete at {loaded}: {result.fetched_shards}"
                f" shards fetched, {result.resumed_shards} already on disk, in"
                f" {result.seconds:.1f} s",
                highlight=False,
            )
            for peer in result.progress.peers():
                console.print(
                    f"  {str(peer['peer'])[-12:]}: {peer['shards']} shards,"
                    f" {peer['rate_mib_s']} MiB/s, {peer['failures']} failures,"
                    f" path {paths.get(str(peer['peer'])) or service.path_to(str(peer['peer']))}"
                    + (" (dropped)" if peer["dropped"] else ""),
                    highlight=False,
                )
            if serve:
                err_console.print("serving; Ctrl-C stops.", highlight=False)
                await trio.sleep_forever()

    run_until_stopped(main)


def register(app: typer.Typer) -> None:
    app.add_typer(shardcast_app, name="shardcast")
