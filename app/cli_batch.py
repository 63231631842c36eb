"""`conveyor batch`: OpenAI's Batch API from the command line (docs/batches.md).

`submit FILE` uploads a JSONL file of requests and creates a batch from it, `status ID` shows a batch
(and, with --wait, waits for its end), `download ID` writes its output (or error) lines.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from app.core.config import Settings

batch_cli = typer.Typer(help="Batches of requests: OpenAI's Batch API.", no_args_is_help=True)

ENDED = ("completed", "failed", "cancelled", "expired")
# How `conveyor batch status --wait` exits, by the batch's final status.
EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 3, "expired": 4}

Url = Annotated[str | None, typer.Option(help="API base URL.")]
ApiKey = Annotated[str | None, typer.Option(help="An API key (`conveyor keys create`).")]


def _client(url: str | None, api_key: str | None) -> Any:
    import httpx

    settings = Settings()
    base = url or f"http://{settings.api_host}:{settings.api_port}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(30.0))


def _checked(answer: Any) -> Any:
    if answer.status_code >= 400:
        typer.echo(answer.text, err=True)
        raise typer.Exit(1)
    return answer


def _summary(batch: dict[str, Any]) -> str:
    counts = batch["request_counts"]
    done = f"{counts['completed']} completed, {counts['failed']} failed of {counts['total']}"
    return f"{batch['id']} {batch['status']}: {done}"


@batch_cli.command("submit")
def submit(
    file: Annotated[Path, typer.Argument(help="JSONL: one request a line (custom_id, method, url, body).")],
    endpoint: Annotated[
        str, typer.Option(help="/v1/chat/completions, /v1/completions or /v1/embeddings.")
    ] = "/v1/chat/completions",
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """Upload FILE and create a batch from it; print the batch's id."""
    with _client(url, api_key) as client:
        files = {"file": (file.name, file.read_bytes(), "application/jsonl")}
        uploaded = _checked(client.post("/v1/files", files=files, data={"purpose": "batch"})).json()
        body = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h"}
        batch = _checked(client.post("/v1/batches", json=body)).json()
    typer.echo(batch["id"])


@batch_cli.command("status")
def status(
    batch_id: Annotated[str, typer.Argument(help="The batch's id.")],
    wait: Annotated[
        bool, typer.Option(help="Wait for its end; exit 0 completed, 1 failed, 3 cancelled, 4 expired.")
    ] = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """Show a batch: its status and request counts; a failed batch's line errors go to stderr."""
    with _client(url, api_key) as client:
        batch = _checked(client.get(f"/v1/batches/{batch_id}")).json()
        while wait and batch["status"] not in ENDED:
            time.sleep(1.0)
            batch = _checked(client.get(f"/v1/batches/{batch_id}")).json()
    typer.echo(_summary(batch))
    if batch.get("errors"):
        for error in batch["errors"]["data"]:
            typer.echo(f"line {error.get('line')}: {error['code']}: {error['message']}", err=True)
    if wait:
        raise typer.Exit(EXIT_CODES.get(batch["status"], 1))


@batch_cli.command("download")
def download(
    batch_id: Annotated[str, typer.Argument(help="The batch's id.")],
    out: Annotated[Path | None, typer.Option(help="Write here; default stdout.")] = None,
    errors: Annotated[bool, typer.Option(help="The error file instead of the output file.")] = False,
    url: Url = None,
    api_key: ApiKey = None,
) -> None:
    """Write a batch's output lines (or, with --errors, its error lines), in input order."""
    with _client(url, api_key) as client:
        batch = _checked(client.get(f"/v1/batches/{batch_id}")).json()
        file_id = batch.get("error_file_id" if errors else "output_file_id")
        if file_id is None:
            typer.echo(f"{_summary(batch)}; no {'error' if errors else 'output'} file", err=True)
            raise typer.Exit(1)
        content = _checked(client.get(f"/v1/files/{file_id}/content")).content
    if out is None:
        typer.echo(content.decode(), nl=False)
    else:
        out.write_bytes(content)
        lines = content.count(b"\n")
        typer.echo(f"wrote {out} ({lines} lines)", err=True)
