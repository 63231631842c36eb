"""The whole stack in this process: what `conveyor up` runs, without its processes.

- the api: the real app (`create_app`), served by uvicorn on a thread over a loopback port, so the
  tests' clients (httpx, the official `openai` client, a WebSocket) speak real HTTP to it, streams
  included, and a client that hangs up is a disconnect the app sees;
- the batcher: the real `Batcher`, its loop on a thread (or ticked by the test: `batcher="tick"`
  and `tick()`);
- the stage workers: the real `StageRuntime` of every stage and replica of every served model, on the
  tiny models, built from the settings as a worker process builds them (`stage_runtime`); the
  messages the broker and the lanes would carry pass through an in-memory bus to a thread per
  replica, with the broker's order (urgent first, then by priority class, then first come);
- the webhook dispatcher and deliverer, on a thread each;
- one namespace per harness on the one Redis the tests share, forgotten when it stops.

Settings come as `conveyor up` takes them (CONVEYOR_* variables, `extra_env`), so a test moved off a
whole stack keeps its configuration word for word. What needs processes (a SIGKILL, the supervisor,
`--only` hosts, Redis going away under a stack, the README's commands, a browser) stays on
`conftest.start_stack`, in the `e2e` tier.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import redis as redis_lib

from app.core.config import EMBEDDING_MODEL, Settings
from app.core.protocol import StepMessage, broker_priority
from tests.ports import free_port
from tests.tinyapi import forget_namespace

log = logging.getLogger(__name__)

# Settings that turn authentication on (as conftest.AUTH_SETTINGS): without one the stack is open.
AUTH_SETTINGS = {"CONVEYOR_AUTH", "CONVEYOR_API_KEYS", "CONVEYOR_JWT_KEY", "CONVEYOR_JWT_KEY_FILE"}
_ENVIRON = threading.Lock()  # Settings read os.environ: one harness reads it at a time
# The tests' clients share one TLS context: httpx builds one per client otherwise (certifi's bundle
# read and parsed, ~35 ms of CPU a client, where a test may open several).
TLS = httpx.create_ssl_context()


@functools.cache
def tokenizer_of(path: Path) -> Any:
    """A model's tokenizer, loaded once per test process: the last stages of every harness started
    on it only decode with it (Gemma 3's takes seconds to load). The API's catalog loads its own."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def settings_from_env(env: dict[str, str]) -> Settings:
    """Settings as a process started with exactly `env`'s CONVEYOR_* variables and REDIS_URL reads them."""
    ours = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "REDIS_URL"}
    with _ENVIRON, mock.patch.dict(os.environ, {**ours, **env}, clear=True):
        return Settings()


class Bus:
    """The broker's stage queues and the replicas' lanes, in memory. A replica takes the next
    message of its lane or of its stage's shared queue (see `take`); the queue gives its messages
    by priority class, as the worker's BRPOP over the priority lists does, the lane in order."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queues: dict[str, list[tuple[int, int, StepMessage]]] = {}
        self.order = itertools.count()
        self.closed = False

    def put(self, message: StepMessage, queue: str) -> None:
        with self.cond:
            self.queues.setdefault(queue, []).append((broker_priority(message), next(self.order), message))
            self.cond.notify_all()

    def put_lane(self, message: StepMessage, lane: str) -> None:
        with self.cond:  # a lane is first come, first served
            self.queues.setdefault(lane, []).append((0, next(self.order), message))
            self.cond.notify_all()

    def take(self, queue: str, lane: str, timeout_s: float = 0.5) -> StepMessage | None:
        """The next message for the replica that consumes `queue` and `lane`: an urgent one first;
        else the lane's or the queue's, whichever has waited longest, the queue's by priority class."""
        with self.cond:
            deadline = time.monotonic() + timeout_s
            while not self.closed:
                heads = []
                for name in (lane, queue):
                    if waiting := self.queues.get(name):
                        best = min(waiting, key=lambda e: (e[0], e[1]))
                        heads.append((not best[2].urgent, min(e[1] for e in waiting), name, best))
                if heads:
                    *_, name, entry = min(heads, key=lambda h: (h[0], h[1]))
                    self.queues[name].remove(entry)
                    return entry[2]
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return None

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


@dataclass
class Harness:
    """A running in-process stack (see the module's docstring). `url`, `namespace`, `redis_url`,
    `env`, `client()` and `stop()` are those of `conftest.Stack`."""

    settings: Settings
    env: dict[str, str]
    url: str = ""
    threads: list[threading.Thread] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    gate: threading.Lock = field(default_factory=threading.Lock)  # closed by `held()`
    bus: Bus = field(default_factory=Bus)
    batcher: Any = None
    runtimes: dict[tuple[str, int, int], Any] = field(default_factory=dict)  # (model, stage, replica)
    heartbeats: list[Any] = field(default_factory=list)
    server: Any = None
    deliveries: ThreadPoolExecutor | None = None

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    @property
    def redis_url(self) -> str | None:
        return self.settings.redis_url

    @property
    def redis(self) -> redis_lib.Redis:
        return redis_lib.Redis.from_url(self.settings.redis_url or "")

    def client(self, **kwargs: object) -> httpx.Client:
        kwargs.setdefault("verify", TLS)
        return httpx.Client(base_url=self.url, timeout=60.0, **kwargs)  # type: ignore[arg-type]

    def openai(self, **kwargs: Any) -> Any:
        """The official client, over this stack's api."""
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"), **kwargs)

    def tick(self) -> None:
        """One round of the batcher (with `batcher="tick"`)."""
        self.batcher.tick()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The batcher's loop takes no round inside this block (it finishes the one it is in): jobs
        submitted in it reach the batcher's next round together, however slowly they were submitted."""
        with self.gate:
            yield

    # --- start -------------------------------------------------------------------------------------

    def start(
        self, *, api: bool, batcher: str, workers: bool, webhooks: bool, ready_timeout_s: float
    ) -> None:
        from app.core.redis import sync_client

        redis = sync_client(self.settings.redis_url or "")
        if workers:
            self._start_workers(redis)
        if batcher != "off":
            self._start_batcher(redis, run=batcher == "thread")
        if webhooks:
            self._start_webhooks(redis)
        if api:
            self._start_api(ready_timeout_s)

    def _start_batcher(self, redis: Any, *, run: bool) -> None:
        from app.batching import intake
        from app.batching.scheduler import Batcher

        def send(message: StepMessage | dict[str, Any], queue: str) -> None:
            if not isinstance(message, StepMessage):
                raise NotImplementedError("the embeddings pipeline runs on whole stacks only")
            self.bus.put(message, queue)

        self.batcher = Batcher(self.settings.batcher, redis=redis, send=send, max_block_ms=100)
        if run:  # each round passes `gate`
            tick = self.batcher.tick

            def gated_tick() -> None:
                with self.gate:
                    tick()

            self.batcher.tick = gated_tick
            self._thread("batcher", self.batcher.run, self.stopping)
        else:
            intake.ensure_groups(redis, self.batcher.keys)

    def _start_workers(self, redis: Any) -> None:
        import torch

        from app.core.keys import Keys
        from app.core.modelstore import registered_dtype
        from app.partitions.precision import resolve_dtype
        from app.workers.heartbeat import Heartbeat
        from app.workers.main import load_partition, served_info, stage_layers, stage_runtime
        from app.workers.stage import StageIdentity

        settings, keys = self.settings, Keys(self.settings.namespace)
        for model in settings.served_models:
            if model == EMBEDDING_MODEL:
                continue
            path = settings.model_path(model)
            assert path is not None, f"model {model!r} is not configured"
            stages = settings.stages
            chosen = registered_dtype(path)
            dtype = resolve_dtype(chosen if chosen not in (None, "auto") else settings.dtype, "cpu")
            tokenizer = tokenizer_of(path)
            for stage in range(stages):
                layers = stage_layers(settings, path, stage=stage, num_stages=stages)
                for replica in range(settings.replicas):  # each replica its own weights, as its process
                    partition = load_partition(path, layers, "cpu", dtype, settings.compile)
                    worker = f"harness-{model}-{stage}-{replica}-{uuid.uuid4().hex[:6]}"
                    identity = StageIdentity(
                        model=model,
                        stage=stage,
                        num_stages=stages,
                        worker=worker,
                        shared_queue=keys.stage_queue(model, stage),
                        lane=keys.lane(model, stage, worker),
                        next_queue=keys.stage_queue(model, stage + 1) if stage + 1 < stages else None,
                        first_queue=keys.stage_queue(model, 0),
                    )
                    runtime = stage_runtime(
                        settings,
                        identity,
                        partition,
                        tokenizer if partition.is_last or partition.is_first else None,
                        path=path,
                        layers=layers,
                        redis=redis,
                        send=self.bus.put,
                        hand_off=self.bus.put_lane,
                    )
                    self.runtimes[(model, stage, replica)] = runtime
                    info = served_info(settings, model, stage, layers, partition, dtype, "cpu")
                    beat = Heartbeat(
                        redis,
                        keys.workers(model, stage),
                        worker,
                        interval_s=settings.heartbeat_interval_s,
                        ttl_s=settings.heartbeat_ttl_s,
                        devices_key=keys.devices(),
                        info_key=keys.stage_info(),
                        info=info,
                    )
                    beat.beat()
                    beat.start()
                    self.heartbeats.append(beat)
                    self._thread(f"stage{stage}.{replica}-{model}", self._serve, runtime, torch)

    def _serve(self, runtime: Any, torch: Any) -> None:
        """A replica's loop: one message at a time, as its compute thread runs them."""
        torch.set_num_threads(1)
        identity = runtime.identity
        while not self.stopping.is_set():
            busy = getattr(runtime, "busy", False)  # the step engine: a step between two messages
            message = self.bus.take(identity.shared_queue, identity.lane, timeout_s=0.0 if busy else 0.5)
            if message is not None:
                try:
                    runtime.handle(message)
                except Exception:  # the worker's own boundary logs and goes on
                    log.exception("stage %d of %s failed a message", identity.stage, identity.model)
            if getattr(runtime, "busy", False):
                runtime.step_once()

    def _start_webhooks(self, redis: Any) -> None:
        from app.core.keys import Keys
        from app.webhooks.delivery import Deliverer
        from app.webhooks.dispatcher import Dispatcher
        from app.webhooks.signing import TenantSecrets
        from app.webhooks.ssrf import Guard

        keys, hooks, ttl = Keys(self.settings.namespace), self.settings.webhook, self.settings.job_ttl_s
        secrets = TenantSecrets(hooks.secrets, master=hooks.master_key, redis=redis, keys=keys)
        deliverer = Deliverer(
            redis, keys, hooks, guard=Guard(hooks.allow_cidrs), secrets=secrets, job_ttl_s=ttl
        )
        self.deliveries = ThreadPoolExecutor(hooks.concurrency, thread_name_prefix="callbacks")
        pool = self.deliveries

        def send(message: dict[str, Any]) -> None:
            pool.submit(self._deliver, deliverer, message)

        self._thread("webhooks", Dispatcher(redis, keys, hooks, send, job_ttl_s=ttl).run, self.stopping)

    @staticmethod
    def _deliver(deliverer: Any, message: dict[str, Any]) -> None:
        try:
            deliverer.deliver(message)
        except Exception:
            log.exception("webhook delivery failed")

    def _start_api(self, ready_timeout_s: float) -> None:
        import uvicorn

        from app.api.app import create_app
        from app.api.connections import serving

        port = free_port()
        config = uvicorn.Config(
            create_app(self.settings),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            **serving(),
        )
        self.server = uvicorn.Server(config)
        self.url = f"http://127.0.0.1:{port}"
        thread = self._thread("api", self.server.run)
        deadline = time.monotonic() + ready_timeout_s
        while not self.server.started:
            if not thread.is_alive():
                raise RuntimeError("the api did not start (see the log above)")
            assert time.monotonic() < deadline, "the api did not start"
            time.sleep(0.01)

    def _thread(self, name: str, target: Any, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=f"harness-{name}", daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    # --- stop --------------------------------------------------------------------------------------

    def stop(self) -> int:
        if self.server is not None:
            self.server.should_exit = True
        self.stopping.set()
        self.bus.close()
        for beat in self.heartbeats:
            beat.stop()
        for thread in self.threads:
            thread.join(30)
        if self.deliveries is not None:
            self.deliveries.shutdown(wait=True, cancel_futures=True)
        return 0

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def start_harness(
    tmp: Path,
    *,
    redis_url: str,
    models: dict[str, Path],
    default_model: str,
    extra_env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    namespace: str | None = None,
    api: bool = True,
    batcher: str = "thread",
    workers: bool = True,
    webhooks: bool = True,
    ready_timeout_s: float = 120.0,
) -> Harness:
    """`conftest.start_stack`'s arguments, in process: the settings `conveyor up` would give its
    children (open to anonymous clients unless `extra_env` configures auth), `--model`, `--stages`,
    `--replicas` and `--plan` in `args`. `batcher`: "thread" (its loop runs), "tick" (the test runs
    its rounds: `Harness.tick`) or "off" (jobs stay queued)."""
    env = {
        "REDIS_URL": redis_url,
        "CONVEYOR_HOME": str(tmp / "home"),
        "CONVEYOR_NAMESPACE": namespace or f"test-{uuid.uuid4().hex[:8]}",
        "CONVEYOR_MODELS": json.dumps({k: str(v) for k, v in models.items()}),
        "CONVEYOR_DEFAULT_MODEL": default_model,
        "CONVEYOR_EMBEDDING_STAGES": "0",
        "CONVEYOR_METRICS_PORT": "0",
        "CONVEYOR_FLOWER_PORT": "0",  # no Flower: the workers send no task events
        "CONVEYOR_DTYPE": "float32",
        "CONVEYOR_TORCH_THREADS": "1",
        **(extra_env or {}),
    }
    if not AUTH_SETTINGS & set(extra_env or {}):
        env["CONVEYOR_AUTH"] = "none"
        env.setdefault("CONVEYOR_ADMIN_TENANTS", '["anonymous"]')
        env.setdefault("CONVEYOR_TENANT_PRIORITIES", '{"anonymous": ["realtime", "high", "normal", "batch"]}')
    served = [value for flag, value in zip(args, args[1:], strict=False) if flag == "--model"]
    for flag, name in (("--stages", "CONVEYOR_STAGES"), ("--replicas", "CONVEYOR_REPLICAS")):
        if flag in args:
            env[name] = args[args.index(flag) + 1]
    if "--plan" in args:  # one worker per stage of the plan, as `up --plan`
        from app.partitions.planner import Plan

        plan = Path(args[args.index("--plan") + 1])
        env["CONVEYOR_PLAN_FILE"] = str(plan.resolve())
        env["CONVEYOR_STAGES"] = str(len(Plan.from_json(plan.read_text()).stages))
    env["CONVEYOR_SERVED_MODELS"] = json.dumps(list(dict.fromkeys(served)) or [default_model])
    env.setdefault("CONVEYOR_DEFAULT_MODEL", default_model)
    if served:
        env["CONVEYOR_DEFAULT_MODEL"] = served[0]
    settings = settings_from_env(env)
    settings.home.mkdir(parents=True, exist_ok=True)
    if webhooks:  # as `conveyor up` does: a signing secret and a master key under the home
        from app.webhooks.signing import ensure_secret_file

        updates: dict[str, Any] = {}
        if not settings.webhook.secrets:
            updates["webhook_secrets"] = [ensure_secret_file(settings.home / "webhook_secret")]
        if not settings.webhook.master_key:
            updates["webhook_master_key"] = ensure_secret_file(settings.home / "webhook_master_key")
        if updates:
            env.update(
                {
                    f"CONVEYOR_{k.upper()}": json.dumps(v) if isinstance(v, list) else v
                    for k, v in updates.items()
                }
            )
            settings = settings_from_env(env)
    harness = Harness(settings, env)
    try:
        harness.start(
            api=api, batcher=batcher, workers=workers, webhooks=webhooks, ready_timeout_s=ready_timeout_s
        )
    except BaseException:
        harness.stop()
        raise
    return harness


@contextlib.contextmanager
def harness(tmp: Path, **kwargs: Any) -> Iterator[Harness]:
    """`start_harness` for a `with` block; the namespace is forgotten at its end."""
    running = start_harness(tmp, **kwargs)
    try:
        yield running
    finally:
        running.stop()
        forget(running)


def forget(running: Harness) -> None:
    """Delete every key of the harness's namespace."""
    forget_namespace(running.settings.redis_url or "", running.namespace)
