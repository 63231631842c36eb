"""`conveyor docs`: write the generated reference pages (docs/configuration.md, docs/openapi.json).

The tests compare the committed pages with what these commands print, so after changing a setting
or a route, run `conveyor docs config` and `conveyor docs openapi` (or `make docs`) and commit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

docs_cli = typer.Typer(help="Generated reference pages: configuration and OpenAPI.", no_args_is_help=True)


def _emit(text: str, out: Path | None) -> None:
    if out is None:
        typer.echo(text, nl=False)
        return
    out.write_text(text)
    typer.echo(f"wrote {out}", err=True)


@docs_cli.command("config")
def config_page(
    out: Annotated[
        Path | None, typer.Option(help="Write here (docs/configuration.md); default stdout.")
    ] = None,
) -> None:
    """The configuration reference, generated from `Settings` and the comments beside its fields."""
    from app.core.config_doc import render

    _emit(render(), out)


@docs_cli.command("openapi")
def openapi_page(
    out: Annotated[Path | None, typer.Option(help="Write here (docs/openapi.json); default stdout.")] = None,
) -> None:
    """The API's OpenAPI document, built from the routes with the default settings."""
    from app.api.openapi_doc import openapi_document

    _emit(openapi_document(), out)
