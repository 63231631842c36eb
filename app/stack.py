"""Which processes `conveyor up` starts: the whole stack, or the part that `--only` names.

`conveyor up` calls `processes` for every child it could start and `Only.parse` for its `--only`
options; `Only.pick` keeps the children named. With `--only`, one stack can be spread over several
hosts that share one Redis (`REDIS_URL`): host A runs `--only api,batcher,stage:0`, host B
`--only stage:1`, and the stage workers find each other through the queues and heartbeats in Redis.

The names (`conveyor up --only NAME[,NAME...]`, repeatable):

    redis       the embedded Redis (only without REDIS_URL)
    api, batcher, webhooks (the dispatcher), callbacks (the delivery worker), flower
    stages      every stage worker of every served model
    stage:N     stage N of every served model (all its --replicas)
    stage:MODEL:N   stage N of one model
    embeddings  every embeddings worker;  embed:N  one of them
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from app.core.config import EMBEDDING_MODEL, Settings
from app.core.redis import ensure_password
from app.launcher import Child

SERVICES = ("redis", "api", "batcher", "webhooks", "callbacks", "flower")
STAGE = re.compile(r"stage:(?:(?P<model>[A-Za-z0-9][A-Za-z0-9._-]*):)?(?P<stage>\d+)")
EMBED = re.compile(r"embed:(?P<stage>\d+)")


@dataclass(frozen=True)
class Part:
    """What a process is: a service by name, or a worker of one model's stage (model None: any)."""

    kind: str  # one of SERVICES, "stage" or "embed"
    model: str | None = None
    stage: int | None = None  # None in a selector: every stage

    def covers(self, other: Part) -> bool:
        """Whether this selector names `other` (a process's own part)."""
        return (
            self.kind == other.kind
            and self.model in (None, other.model)
            and self.stage in (None, other.stage)
        )


@dataclass(frozen=True)
class Only:
    """The parts `--only` names; `everything` when it was not given."""

    selectors: tuple[tuple[str, Part], ...]  # (as written, what it names)

    @property
    def everything(self) -> bool:
        return not self.selectors

    @classmethod
    def parse(cls, values: Iterable[str]) -> Only:
        """`["api,batcher", "stage:1"]` -> its selectors; raises ValueError naming a bad one."""
        selectors = []
        for value in values:
            for name in filter(None, (n.strip() for n in value.split(","))):
                selectors.append((name, _selector(name)))
        return cls(tuple(selectors))

    def wants(self, part: Part) -> bool:
        return self.everything or any(selector.covers(part) for _, selector in self.selectors)

    def pick(self, planned: list[tuple[Part, Child]], services: Iterable[str]) -> list[Child]:
        """The children named. `services`: the processes other than `planned` this stack may start
        (the api, flower, the embedded Redis). A name that names nothing here is refused."""
        parts = [part for part, _ in planned] + [Part(name) for name in services]
        for written, selector in self.selectors:
            if not any(selector.covers(part) for part in parts):
                raise ValueError(f"--only {written}: this stack starts no such process")
        return [child for part, child in planned if self.wants(part)]


def _selector(name: str) -> Part:
    if name in SERVICES:
        return Part(name)
    if name == "stages":
        return Part("stage")
    if name == "embeddings":
        return Part("embed")
    if match := STAGE.fullmatch(name):
        return Part("stage", match["model"], int(match["stage"]))
    if match := EMBED.fullmatch(name):
        return Part("embed", None, int(match["stage"]))
    raise ValueError(
        f"--only {name}: not a process name (one of {', '.join(SERVICES)}, stages, stage:N, "
        "stage:MODEL:N, embeddings, embed:N)"
    )


def passwordless_remote_redis(url: str) -> bool:
    """Whether `url` reaches a Redis beyond this host without a password: no password in the URL
    (`redis://:PASSWORD@`, `redis://USER:PASSWORD@` or `?password=`) and a host that is not a loopback
    address or `localhost` (a Unix socket is local)."""
    parts = urlsplit(url)
    if parts.scheme == "unix" or parts.password or parse_qs(parts.query).get("password"):
        return False
    host = (parts.hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a name: it resolves elsewhere as often as here


FLOWER_USER = "conveyor"


def flower_child(settings: Settings, broker_url: str, login: str) -> Child:
    """Flower, on loopback, behind a login: `login` is "user:password[,...]". The broker URL and the
    login go in its environment (Flower reads FLOWER_* options there), never on its command line,
    which every local user can read in `ps`."""
    argv = [sys.executable, "-m", "celery", "flower", f"--port={settings.flower_port}", "--address=127.0.0.1"]
    return Child("flower", argv, env={"BROKER_URL": broker_url, "FLOWER_BASIC_AUTH": login})


def flower_login(settings: Settings, say: Callable[[str], object]) -> str:
    """Flower's login: CONVEYOR_FLOWER_BASIC_AUTH, else user `conveyor` with a password made once
    under the home (owner-only, `<home>/flower_password`), as the embedded Redis's is."""
    if settings.flower_basic_auth:
        return settings.flower_basic_auth
    path = settings.home / "flower_password"
    password = ensure_password(path)
    say(f"Flower asks for a login: user {FLOWER_USER}, password in {path}")
    return f"{FLOWER_USER}:{password}"


def torch_threads(cores: int, stage_workers: int, embed_workers: int) -> tuple[int, int]:
    """Torch threads for each stage worker and each embeddings worker of a stack on `cores` cores.

    One core is left to the api, the batcher and Redis (vLLM's CPU server keeps one for its own
    processes too): a compute thread team that shares its cores with them waits on its slowest
    thread at every kernel, and on a small machine that costs more than the extra thread gives
    (docs/benchmarks.md, "Against vLLM", has the measurement). The stage workers split
    the rest; an embeddings worker (a small encoder, idle unless asked) gets a share of the rest
    over all of them.
    """
    spare = max(1, cores - 1)
    per_stage = max(1, spare // max(1, stage_workers))
    per_embed = max(1, spare // max(1, stage_workers + embed_workers))
    return per_stage, per_embed


def processes(
    settings: Settings,
    models: list[str],
    me: list[str],
    only: Only | None = None,
    cores: int | None = None,
) -> list[tuple[Part, Child]]:
    """Every child `up` supervises but the api, Flower and Redis, with what each one is: the
    batcher, the webhook processes, stages x replicas workers per model, the embeddings workers.

    Without CONVEYOR_TORCH_THREADS, each worker this host starts (`only`'s choice, every one
    without it) is given its share of the host's cores (`torch_threads`; a stage worker widens to
    the others while they idle); `cores` defaults to the CPUs this process may run on.
    """
    planned = [
        (Part("batcher"), Child("batcher", [*me, "batcher"])),
        (Part("webhooks"), Child("webhooks", [*me, "webhooks", "dispatcher"])),
        (Part("callbacks"), Child("callbacks", [*me, "webhooks", "worker"])),
    ]
    for name in models:  # each model its own pipeline: stages x replicas workers
        prefix = "" if len(models) == 1 else f"{name}:"
        for stage in range(settings.stages):
            argv = [*me, "worker", "--model", name, "--stage", str(stage), "--stages", str(settings.stages)]
            for replica in range(settings.replicas):
                suffix = f".{replica}" if settings.replicas > 1 else ""
                planned.append((Part("stage", name, stage), Child(f"{prefix}stage{stage}{suffix}", argv)))
    for stage in range(settings.embedding_stages):
        argv = [
            *me,
            "worker",
            "--model",
            EMBEDDING_MODEL,
            "--stage",
            str(stage),
            "--stages",
            str(settings.embedding_stages),
        ]
        planned.append((Part("embed", None, stage), Child(f"embed{stage}", argv)))
    if not settings.torch_threads:
        _share_cores(planned, only or Only(()), cores or len(os.sched_getaffinity(0)))
    return planned


def _share_cores(planned: list[tuple[Part, Child]], only: Only, cores: int) -> None:
    """Give each stage and embeddings worker this host starts its torch threads (`torch_threads`)."""
    here = [(part, child) for part, child in planned if only.wants(part)]
    stages = sum(part.kind == "stage" for part, _ in here)
    per_stage, per_embed = torch_threads(cores, stages, sum(part.kind == "embed" for part, _ in here))
    for part, child in here:
        if part.kind == "stage":  # its share, and the other cores while they idle (app.workers.threads)
            child.argv = [*child.argv, "--share", str(per_stage)]
        elif part.kind == "embed":
            child.env["CONVEYOR_TORCH_THREADS"] = str(per_embed)
