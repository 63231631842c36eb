"""The `conveyor` command: run the stack or one of its processes, submit jobs, plan stages; its
groups live beside it (`app/cli_up.py`, `app/cli_models.py`, `app/cli_keys.py`, `app/cli_docs.py`,
`app/cli_batch.py`)."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from app.cli_batch import batch_cli
from app.cli_common import (
    SslCertfile,
    SslKeyfile,
    exit_on_known_secrets,
    keys_redis,
    load_settings,
    setup_logging,
)
from app.cli_docs import docs_cli
from app.cli_keys import keys_cli
from app.cli_models import model_cli
from app.cli_up import up
from app.core.config import Settings
from app.core.errors import UnsupportedModel

if TYPE_CHECKING:
    import torch

    from app.partitions.planner import Plan

cli = typer.Typer(
    help="Conveyor: message-queue driven asynchronous LLM inference.",
    no_args_is_help=True,
    add_completion=False,
)
cli.command()(up)
cli.add_typer(model_cli, name="model")
webhooks_cli = typer.Typer(
    help="Webhook delivery processes (`conveyor up` starts both).", no_args_is_help=True
)
cli.add_typer(webhooks_cli, name="webhooks")
cli.add_typer(keys_cli, name="keys")
cli.add_typer(docs_cli, name="docs")
cli.add_typer(batch_cli, name="batch")


@cli.command()
def api(ssl_certfile: SslCertfile = None, ssl_keyfile: SslKeyfile = None) -> None:
    """Run the HTTP API (one process); HTTPS with --ssl-certfile and --ssl-keyfile."""
    setup_logging()
    settings = load_settings()
    exit_on_known_secrets(settings)  # before importing the app (torch, transformers: seconds)
    import uvicorn

    from app.api.app import create_app
    from app.api.connections import serving

    options = uvicorn_options(settings, ssl_certfile, ssl_keyfile)
    uvicorn.run(create_app(settings), **options, **serving())


def uvicorn_options(settings: Settings, certfile: Path | None, keyfile: Path | None) -> dict[str, Any]:
    """uvicorn's arguments for the api: its address, and TLS when both files are given (1.3 at least,
    see `tls_context`)."""
    options: dict[str, Any] = {
        "host": settings.api_host,
        "port": settings.api_port,
        "log_level": "info",
        "timeout_graceful_shutdown": 5,
    }
    if certfile is not None and keyfile is not None:
        options.update(
            ssl_certfile=str(certfile),
            ssl_keyfile=str(keyfile),
            ssl_context_factory=tls_context,
        )
    elif certfile is not None or keyfile is not None:
        raise typer.BadParameter("--ssl-certfile and --ssl-keyfile go together")
    return options


# The oldest TLS version the api accepts: 1.3 drops 1.2's negotiable weak ciphers and renegotiation.
MIN_TLS_VERSION = ssl.TLSVersion.TLSv1_3


def tls_context(config: Any, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    """uvicorn's `ssl_context_factory` (uvicorn 0.47+): its own context (certificate, key, ciphers)
    with no TLS version older than MIN_TLS_VERSION. uvicorn's `ssl_version` only picks a protocol
    constant; the floor is a property of the context, so it is set here."""
    context = default()
    context.minimum_version = MIN_TLS_VERSION
    return context


@cli.command()
def batcher() -> None:
    """Run the batcher: intake queues -> batches -> stage 0."""
    from app.batching.scheduler import run_batcher

    setup_logging()
    run_batcher(load_settings())


@webhooks_cli.command("dispatcher")
def webhooks_dispatcher() -> None:
    """Follow the event streams of jobs with a callback_url; enqueue one delivery per webhook event."""
    from app.webhooks.dispatcher import run_dispatcher

    setup_logging()
    run_dispatcher(load_settings())


@webhooks_cli.command("worker")
def webhooks_worker() -> None:
    """Deliver webhooks: a Celery worker (thread pool) on the callbacks queue."""
    from app.webhooks.worker import run_callbacks_worker

    setup_logging()
    settings = load_settings()
    exit_on_known_secrets(settings)
    run_callbacks_worker(settings)


@cli.command()
def worker(
    stage: Annotated[int, typer.Option(help="Which stage of the pipeline this worker serves.")] = 0,
    stages: Annotated[int | None, typer.Option(help="Stages in the pipeline.")] = None,
    model: Annotated[str | None, typer.Option(help="Model name; the default model when omitted.")] = None,
    share: Annotated[
        int | None,
        typer.Option(
            help="Torch threads this worker keeps while other processes use the host's CPUs (its share "
            "of a host it shares; `conveyor up` passes it); it takes the others while they are idle. "
            "Default: every CPU but one. CONVEYOR_TORCH_THREADS fixes the count instead.",
            min=1,
        ),
    ] = None,
) -> None:
    """Run one stage worker (a Celery worker owning one partition of the model): layers of a
    generation model, or a piece of the embeddings model's graph (`--model all-MiniLM-L6-v2`)."""
    from app.core.discovery import EMBEDDING, kind_of

    setup_logging()
    embedding = model is not None and kind_of(model) == EMBEDDING
    settings = load_settings() if embedding else load_settings(stages=stages)
    if settings.cpus:  # before any thread of the model's starts: they all run there
        from app.core.cpus import bind, parse_cpus

        bind(parse_cpus(settings.cpus))
    if embedding:
        from app.workers.embedding import run_embedding_worker

        run_embedding_worker(settings, stage=stage, num_stages=stages or settings.embedding_stages)
        return
    from app.launcher import UNSERVABLE_EXIT
    from app.workers.main import run_worker

    name = model or settings.default_model
    try:
        run_worker(settings, model=name, stage=stage, num_stages=settings.stages, share=share)
    except UnsupportedModel as exc:  # one line, and an exit `conveyor up` does not restart
        typer.echo(f"conveyor: model {name!r} cannot be served: {exc.message}", err=True)
        raise typer.Exit(UNSERVABLE_EXIT) from exc


# How `conveyor submit` exits, by the job's final status (1 also when the submission is refused).
EXIT_CODES = {"succeeded": 0, "failed": 1, "cancelled": 3, "expired": 4}


@cli.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="The user message (or raw prompt with --raw).")],
    stream: Annotated[bool, typer.Option(help="Print tokens as they are generated.")] = False,
    raw: Annotated[
        bool, typer.Option(help="Send a raw completion prompt instead of a chat message.")
    ] = False,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    priority: Annotated[str, typer.Option(help="realtime, high, normal or batch (low = batch).")] = "normal",
    ignore_eos: Annotated[bool, typer.Option(help="Generate exactly --max-tokens tokens.")] = False,
    url: Annotated[str | None, typer.Option(help="API base URL.")] = None,
    api_key: Annotated[str | None, typer.Option(help="An API key (`conveyor keys create`).")] = None,
) -> None:
    """Submit a job and print its text; its id goes to stderr. Exit status: 0 succeeded, 1 failed (or
    refused), 3 cancelled, 4 expired; a job that did not succeed also prints its status to stderr."""
    import httpx

    settings = load_settings()
    base = url or f"http://{settings.api_host}:{settings.api_port}"
    body: dict[str, object] = {"max_tokens": max_tokens, "temperature": temperature, "priority": priority}
    body.update({"prompt": prompt} if raw else {"messages": [{"role": "user", "content": prompt}]})
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(10.0, read=None)
    with httpx.Client(base_url=base, timeout=timeout, headers=headers) as client:
        answer = client.post("/v1/jobs", json=body)
        if answer.status_code != 202:
            typer.echo(answer.text, err=True)
            raise typer.Exit(1)
        job = answer.json()
        typer.echo(f"job {job['id']}", err=True)
        if stream:
            final = _follow(client, job)
        else:
            final = _poll(client, job)
            typer.echo(final["text"])
    if final["status"] != "succeeded":
        typer.echo(f"job {final['id']} {final['status']}: {final.get('error')}", err=True)
    raise typer.Exit(EXIT_CODES.get(final["status"], 1))


def _follow(client: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Print the job's tokens as they come; the job as its final event (done, error, cancelled or
    expired) carries it."""
    from app.core.jobs import FINAL_EVENTS

    with client.stream("GET", job["urls"]["events"]) as events:
        for event, data in _sse(events.iter_lines()):
            if event == "token":
                typer.echo(json.loads(data)["text"], nl=False)
            elif event in FINAL_EVENTS:
                typer.echo()
                return dict(json.loads(data))
    typer.echo()
    return _poll(client, job)  # no final event: the stream had ended before (204), or was cut


def _poll(client: Any, job: dict[str, Any]) -> dict[str, Any]:
    while True:
        record: dict[str, Any] = client.get(job["urls"]["self"]).json()
        if record["status"] in EXIT_CODES:
            return record
        time.sleep(0.2)


def _sse(lines):  # type: ignore[no-untyped-def]
    event, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", list[str]()
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


@cli.command("plan")
def plan_command(
    model: Annotated[str, typer.Option(help="A model dir, a config.json, or a bundled config name.")] = "",
    max_mem: Annotated[float | None, typer.Option(help="Memory budget per device, MiB.")] = None,
    stages: Annotated[int | None, typer.Option(help="A fixed number of stages instead of a budget.")] = None,
    dtype: Annotated[
        str,
        typer.Option(help="Weight dtype: float16, bfloat16, float32; default: what the workers will use."),
    ] = "",
    kv_tokens: Annotated[int, typer.Option(help="KV-cache tokens in flight each stage must hold.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Write the plan here (for `conveyor up --plan`).")] = None,
    rebalance: Annotated[
        Path | None, typer.Option(help="Propose new cuts for this plan from measured step latency.")
    ] = None,
    latency_s: Annotated[
        str | None,
        typer.Option(help="Per-stage step latency, comma-separated; default: what workers report."),
    ] = None,
) -> None:
    """Plan stage cut points on the meta device (no weights), or rebalance a plan from measurements."""
    from app.partitions import planner
    from app.partitions.families import family_for

    settings = load_settings()
    source = model or str(settings.model_path(settings.default_model) or settings.default_model)
    try:
        config = planner.load_config(source)
        family_for(config)  # plan only what a worker can run
        if rebalance is not None:
            old = planner.Plan.from_json(rebalance.read_text())
            measured = _latencies(settings, old, latency_s)
            typer.echo(
                "measured: " + ", ".join(f"stage {i} {s * 1000:.1f} ms" for i, s in enumerate(measured))
            )
            result = planner.rebalance(old, measured, config)
        else:
            if (max_mem is None) == (stages is None):
                stages = stages or (None if max_mem else 1)
            result = planner.plan_decoder(
                config,
                dtype=planner.parse_dtype(dtype or _workers_dtype(settings, source)),
                max_mem_mb=max_mem,
                stages=stages,
                kv_budget_tokens=kv_tokens,
                name=Path(source).name if model else settings.default_model,
            )
    except (ValueError, OSError, UnsupportedModel) as exc:
        typer.echo(f"conveyor plan: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(planner.format_table(result))
    if out is not None:
        out.write_text(result.to_json())
        typer.echo(f"plan written to {out}; start it with `conveyor up --plan {out}`")


def _workers_dtype(settings: Settings, source: str) -> torch.dtype:
    """The dtype stage 0's worker would load this model in (its `model add --dtype`, else the setting)."""
    from app.core.modelstore import registered_dtype
    from app.partitions.precision import resolve_dtype
    from app.workers.main import resolve_device

    chosen = registered_dtype(Path(source)) if Path(source).is_dir() else None
    setting = chosen if chosen not in (None, "auto") else settings.dtype
    return resolve_dtype(setting, resolve_device(settings.device, 0))


def _latencies(settings: Settings, plan: Plan, given: str | None) -> list[float]:
    if given:
        return [float(x) for x in given.split(",")]
    from redis.exceptions import RedisError

    from app.workers.latency import read_latencies

    client, keys = keys_redis(settings)  # REDIS_URL, else the embedded Redis of a running `conveyor up`
    try:
        reports = read_latencies(client, keys, settings.default_model)
    except RedisError as exc:
        raise ValueError(f"no --latency-s given and Redis does not answer ({exc}); is the stack up?") from exc
    stages = len(plan.stages)
    missing = [s for s in range(stages) if s not in reports]
    if missing:
        raise ValueError(f"no latency reported for stages {missing}; run load through the pipeline first")
    return [float(reports[s]["ewma_s"]) for s in range(stages)]


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
