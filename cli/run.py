"""Commands for run genesis files: create and show."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cli.common import HomeOption, console, open_home
from node.model import DEFAULT_MODEL_DIR
from node.model.card import card_for_dir
from node.run import (
    DEFAULT_MODEL,
    bind_tasks,
    create_genesis,
    describe,
    load_genesis,
    parse_params,
    write_genesis,
)
from node.run_assets import AssetDirs
from swarm.errors import ConfigError

_DEFAULT_COLUMNS = {
    "prompt": "prompt",
    "answer": "answer",
    "verifier_column": "",
    "verifier": "exact",
    "target_len_column": "",
}

run_app = typer.Typer(
    help="Run genesis files: create (as the run owner) and show.", no_args_is_help=True
)


@run_app.command("create")
def run_create(
    name: Annotated[str, typer.Option("--name", help="A human name for the run.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the genesis.")],
    trainer: Annotated[
        list[str], typer.Option("--trainer", help="Peer ID allowed to publish policies (repeat).")
    ],
    validator: Annotated[
        list[str], typer.Option("--validator", help="Peer ID allowed to judge work (repeat).")
    ],
    param: Annotated[
        list[str] | None, typer.Option("--param", help="Run parameter key=value (repeat).")
    ] = None,
    task_seed: Annotated[int, typer.Option("--task-seed", help="Seed of the task suite.")] = 0,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="Local Hugging Face model directory to bind (default: the embedded model).",
        ),
    ] = None,
    model_name: Annotated[
        str | None, typer.Option("--model-name", help="The model's name (default: the folder).")
    ] = None,
    chat_template: Annotated[
        bool | None,
        typer.Option(
            "--chat-template/--no-chat-template",
            help="Apply the model's chat template to prompts (default: when it has one).",
        ),
    ] = None,
    tasks: Annotated[
        str,
        typer.Option(
            "--tasks",
            help="The task source: default (the built-in suite), reasoning-gym:NAME[,NAME...],"
            " a JSONL file (prompt, answer, verifier), or a Hugging Face datasets folder or"
            " parquet/arrow/csv file (columns named by --prompt-column etc.).",
        ),
    ] = "default",
    task_config: Annotated[
        Path | None,
        typer.Option(
            "--task-config",
            help="reasoning-gym: YAML/JSON in its composite format (datasets: [{name, weight,"
            " config}]) giving each data set's config and weight.",
        ),
    ] = None,
    task_size: Annotated[
        int, typer.Option("--task-size", help="reasoning-gym: items to build (all nodes alike).")
    ] = 1000,
    prompt_column: Annotated[
        str, typer.Option("--prompt-column", help="datasets: the prompt column.")
    ] = "prompt",
    answer_column: Annotated[
        str, typer.Option("--answer-column", help="datasets: the reference answer column.")
    ] = "answer",
    verifier_column: Annotated[
        str,
        typer.Option("--verifier-column", help="datasets: a column naming each row's verifier."),
    ] = "",
    verifier: Annotated[
        str,
        typer.Option("--verifier", help="datasets: the verifier of every row (exact or math)."),
    ] = "exact",
    target_len_column: Annotated[
        str,
        typer.Option("--target-len-column", help="datasets: a target-length column (optional)."),
    ] = "",
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUTPUT if it exists.")] = False,
    home: HomeOption = None,
) -> None:
    """Sign a run genesis with this node's key (this node becomes the run owner)."""
    params = parse_params(param or [])
    if output.exists() and not force:
        raise ConfigError(f"{output} exists; pass --force to overwrite it or choose another -o")
    card = card_for_dir(
        model or DEFAULT_MODEL_DIR,
        name=model_name or (model.resolve().name if model else DEFAULT_MODEL),
        chat_template=chat_template,
    )
    node_home = open_home(home)
    owner = node_home.load_key()
    columns = {
        "prompt": prompt_column,
        "answer": answer_column,
        "verifier_column": verifier_column,
        "verifier": verifier,
        "target_len_column": target_len_column,
    }
    binding = bind_tasks(
        tasks,
        task_config=task_config,
        seed=task_seed,
        size=task_size,
        columns=None if tasks.endswith(".jsonl") and columns == _DEFAULT_COLUMNS else columns,
        cache=AssetDirs.under(node_home.path).data,
    )
    genesis = create_genesis(
        owner,
        name=name,
        trainers=trainer,
        validators=validator,
        params=params,
        model=card,
        task_seed=task_seed,
        tasks=binding,
    )
    write_genesis(genesis, output)
    console.print(f"run {describe(genesis)['run_id']} written to {output}", highlight=False)


@run_app.command("show")
def run_show(
    path: Annotated[Path, typer.Argument(help="A genesis file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Verify a genesis file and print its run id, owner, roles and parameters."""
    view = describe(load_genesis(path))
    if as_json:
        typer.echo(json.dumps(view, indent=2))
        return
    table = Table(show_header=False, box=None)
    for key, value in view.items():
        if isinstance(value, list):
            value = "\n".join(value) or "-"
        elif isinstance(value, dict):
            value = "\n".join(f"{k} = {v}" for k, v in sorted(value.items()))
        table.add_row(f"[bold]{key}[/]", str(value))
    console.print("[green]signature verified[/]")
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(run_app, name="run")
