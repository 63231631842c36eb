"""The `conveyor` command: run the stack or one of its processes, submit jobs, manage models."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from app.core.config import DEFAULT_MODEL, Settings

cli = typer.Typer(
    help="Conveyor: message-queue driven asynchronous LLM inference.",
    no_args_is_help=True,
    add_completion=False,
)
model_cli = typer.Typer(help="Manage local models.", no_args_is_help=True)
cli.add_typer(model_cli, name="model")


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )


def _settings(**overrides: object) -> Settings:
    settings = Settings()
    return settings.model_copy(update={k: v for k, v in overrides.items() if v is not None})


@cli.command()
def up(
    stages: Annotated[int | None, typer.Option(help="Pipeline stages (one worker each).")] = None,
    replicas: Annotated[int | None, typer.Option(help="Workers per stage, sharing its queue.")] = None,
    flower: Annotated[bool | None, typer.Option(help="Run Flower, Celery's dashboard.")] = None,
) -> None:
    """Start Redis (embedded unless REDIS_URL is set), the api, the batcher, the workers and Flower."""
    from app.core.redis import start_embedded, wait_for_redis
    from app.launcher import Child, Supervisor

    settings = _settings(stages=stages, replicas=replicas, flower=flower)
    _ensure_default_model(settings)
    env = dict(os.environ)
    env["CONVEYOR_STAGES"] = str(settings.stages)
    supervisor = Supervisor(env)
    redis_process = None
    if settings.redis_url:
        url = settings.redis_url
        if not wait_for_redis(url, timeout_s=10):
            raise typer.BadParameter(f"no Redis answers at REDIS_URL={url}")
        supervisor.say(f"using Redis at {url}")
    else:
        try:
            redis_process, url = start_embedded(settings.home / "redis", settings.embedded_redis_port)
        except RuntimeError as exc:
            typer.echo(f"conveyor: {exc}", err=True)
            raise typer.Exit(1) from exc
        supervisor.say(f"started embedded Redis at {url} (data in {settings.home / 'redis'})")
    env["REDIS_URL"] = url
    if redis_process is not None:
        supervisor.add(Child("redis", [], restart=False), redis_process)

    me = [sys.executable, "-m", "app.cli"]
    supervisor.add(Child("api", [*me, "api"]))
    supervisor.add(Child("batcher", [*me, "batcher"]))
    for stage in range(settings.stages):
        argv = [*me, "worker", "--stage", str(stage), "--stages", str(settings.stages)]
        for replica in range(settings.replicas):
            supervisor.add(Child(f"stage{stage}" + (f".{replica}" if settings.replicas > 1 else ""), argv))
    if settings.flower:
        supervisor.add(
            Child(
                "flower",
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "--broker",
                    url,
                    "flower",
                    f"--port={settings.flower_port}",
                    "--address=127.0.0.1",
                ],
            )
        )
    supervisor.say(f"api     http://{settings.api_host}:{settings.api_port}  (docs at /docs)")
    if settings.flower:
        supervisor.say(f"flower  http://127.0.0.1:{settings.flower_port}")
    supervisor.say("Ctrl-C stops everything")
    raise typer.Exit(supervisor.run())


def _ensure_default_model(settings: Settings) -> None:
    if settings.model_path(settings.default_model) is not None:
        return
    if settings.default_model != DEFAULT_MODEL:
        raise typer.BadParameter(f"model {settings.default_model!r} is not configured (CONVEYOR_MODELS)")
    from app.core.modelstore import pull_smollm2

    pull_smollm2(settings.model_home / DEFAULT_MODEL, echo=typer.echo)


@cli.command()
def api() -> None:
    """Run the HTTP API (one process)."""
    import uvicorn

    from app.api.app import create_app

    _logging()
    settings = _settings()
    uvicorn.run(
        create_app(settings),
        host=settings.api_host,
        port=settings.api_port,
        log_level="info",
        timeout_graceful_shutdown=5,
    )


@cli.command()
def batcher() -> None:
    """Run the batcher: intake queues -> batches -> stage 0."""
    from app.batching.scheduler import run_batcher

    _logging()
    run_batcher(_settings())


@cli.command()
def worker(
    stage: Annotated[int, typer.Option(help="Which stage of the pipeline this worker serves.")] = 0,
    stages: Annotated[int | None, typer.Option(help="Stages in the pipeline.")] = None,
    model: Annotated[str | None, typer.Option(help="Model name; the default model when omitted.")] = None,
) -> None:
    """Run one stage worker (a Celery worker owning one partition of the model)."""
    from app.workers.main import run_worker

    _logging()
    settings = _settings(stages=stages)
    run_worker(settings, model=model or settings.default_model, stage=stage, num_stages=settings.stages)


@cli.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="The user message (or raw prompt with --raw).")],
    stream: Annotated[bool, typer.Option(help="Print tokens as they are generated.")] = False,
    raw: Annotated[
        bool, typer.Option(help="Send a raw completion prompt instead of a chat message.")
    ] = False,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    priority: Annotated[str, typer.Option(help="high, normal or low.")] = "normal",
    url: Annotated[str | None, typer.Option(help="API base URL.")] = None,
) -> None:
    """Submit a job and print its text."""
    import httpx

    settings = _settings()
    base = url or f"http://{settings.api_host}:{settings.api_port}"
    body: dict[str, object] = {"max_tokens": max_tokens, "temperature": temperature, "priority": priority}
    body.update({"prompt": prompt} if raw else {"messages": [{"role": "user", "content": prompt}]})
    with httpx.Client(base_url=base, timeout=httpx.Timeout(10.0, read=None)) as client:
        answer = client.post("/v1/jobs", json=body)
        if answer.status_code != 202:
            typer.echo(answer.text, err=True)
            raise typer.Exit(1)
        job = answer.json()
        if stream:
            with client.stream("GET", job["urls"]["events"]) as events:
                for event, data in _sse(events.iter_lines()):
                    if event == "token":
                        typer.echo(json.loads(data)["text"], nl=False)
                    elif event in ("done", "error"):
                        typer.echo()
                        final = json.loads(data)
                        break
        else:
            while True:
                final = client.get(job["urls"]["self"]).json()
                if final["status"] in ("succeeded", "failed", "cancelled", "expired"):
                    break
                time.sleep(0.2)
            typer.echo(final["text"])
    if final["status"] != "succeeded":
        typer.echo(f"job {final['id']} {final['status']}: {final.get('error')}", err=True)
        raise typer.Exit(1)


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


@model_cli.command("pull")
def model_pull(force: Annotated[bool, typer.Option(help="Fetch and convert again.")] = False) -> None:
    """Fetch SmolLM2-135M-Instruct and convert it once into .conveyor/models/."""
    from app.core.modelstore import pull_smollm2

    settings = _settings()
    pull_smollm2(settings.model_home / DEFAULT_MODEL, force=force, echo=typer.echo)


@model_cli.command("list")
def model_list() -> None:
    """The models this machine can serve."""
    settings = _settings()
    for name in settings.model_names():
        typer.echo(f"{name}\t{settings.model_path(name) or Path('?')}")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
