"""The soak: a whole stack under steady mixed load for half an hour, checked for what a long run
would show and a test would not: lost or stuck jobs, memory that creeps, tracebacks in the log.

One `conveyor up` (its own embedded Redis, two tenants' API keys) is saturated by a closed loop to
measure its capacity; then jobs arrive as a Poisson process at `--load` of it for `--minutes`, from
two tenants (2/3 and 1/3): 5% cancelled shortly after acceptance, 5% poison (each must be refused
4xx, never a 500). Every 15 s the sampler reads Redis's `used_memory` and every stack process's
RSS; every 5 s the watcher reads each accepted job's status straight from Redis (one pipeline, so
the load generator is not the bottleneck); what it has not seen end is polled through the API at
the end. Accepted and gone without ending: lost; not ended after the drain: stuck. Memory slopes
(MiB/h, least squares after the warm-up) tell whether anything grows; the log is searched for
tracebacks. Ended records live `--ended-ttl-s` (300 s, so Redis stops growing by design early);
the warm-up is the longer of that TTL and a fifth of the run, or `--warmup-min`: what fills to a
cap (the prefix cache, the capped streams: `--env CONVEYOR_AUDIT_MAXLEN=...`) must be full by then.

    python -m bench.soak [--model tiny|smollm2] [--minutes 30] [--load 0.7] [--warmup-min 10]

Not part of `make test`. Writes bench/results/soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis as redis_lib

from app.core.discovery import EMBEDDING_MODEL
from bench.load import JobResult, closed_loop_until, inference_job, poisson_arrivals
from bench.prompts import Prompt
from bench.report import RESULTS_DIR, git_commit, table, write_results
from bench.systems import (
    Model,
    System,
    child_pids,
    chosen_model,
    consecutive_ports,
    conveyor,
    redis_server,
    say,
    terminate_on_sigterm,
)

SAMPLE_S = 15.0
WATCH_S = 5.0
TENANTS = (("tenant-a", 2 / 3), ("tenant-b", 1 / 3))
TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
POISON = (
    {"temperature": 1e-300},  # 422: out of the sampling bounds
    {"model": "SmolLM2-135M-Instruct/"},  # 404: an alias of a served model's name
    {"top_k": 2**63},  # 422: past int64
)
WORDS = "river stone cloud lantern orbit maple signal harbor copper meadow violet engine".split()


def kind_of(rng: random.Random, cancel: float, poison: float) -> str:
    """What one arrival is: `cancel`, `poison` or `normal`."""
    draw = rng.random()
    return "cancel" if draw < cancel else "poison" if draw < cancel + poison else "normal"


def tenant_of(rng: random.Random) -> str:
    return rng.choices([tenant for tenant, _ in TENANTS], weights=[share for _, share in TENANTS])[0]


def slope_per_hour(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) samples, per hour; None with fewer than 3 samples."""
    if len(samples) < 3 or len({t for t, _ in samples}) < 2:
        return None
    return statistics.linear_regression(*zip(*samples, strict=True)).slope * 3600


def role_of(cmdline: str) -> str:
    """The stack's name for a process, from its command line."""
    for needle, role in (
        ("redis-server", "redis"),
        (f"--model {EMBEDDING_MODEL} ", "embeddings worker"),
        ("webhooks dispatcher", "webhooks dispatcher"),
        ("webhooks worker", "callbacks worker"),
        (" worker ", "stage worker"),
        ("batcher", "batcher"),
        ("flower", "flower"),
        (" api", "api"),
        (" up", "supervisor"),
    ):
        if needle in f" {cmdline} ":
            return role
    return cmdline.split()[0] if cmdline else "?"


def tracebacks(log: str) -> list[str]:
    """Each traceback's last line (the exception) in a log."""
    lines, found = log.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            tail = next((lines[j] for j in range(i + 1, len(lines)) if not lines[j].startswith(" ")), "?")
            found.append(tail)
    return found


@dataclass
class Tally:
    accepted: dict[str, str] = field(default_factory=dict)  # job id -> tenant
    cancelled: set[str] = field(default_factory=set)  # cancel asked and answered 200
    refused: Counter[int] = field(default_factory=Counter)  # poison: status code -> count
    unexpected: Counter[str] = field(default_factory=Counter)  # e.g. "500", "poison 202", errors
    ended: set[str] = field(default_factory=set)  # seen ending (its final event, or polled)
    final: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    lag_s: float = 0.0  # how far the arrivals fell behind their schedule, at most
    stuck: list[str] = field(default_factory=list)
    tokens: Counter[str] = field(default_factory=Counter)  # tenant -> tokens of its succeeded jobs


@dataclass
class Samples:
    redis: list[tuple[float, float]] = field(default_factory=list)  # (s, MiB)
    rss: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # "role pid" -> (s, MiB)


def job_body(i: int, max_tokens: int) -> dict[str, object]:
    words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(8 + i % 24))
    return {"prompt": f"{i}: {words}", "max_tokens": max_tokens, "temperature": 0.7, "seed": i}


async def calibrate(
    client: httpx.AsyncClient, keys: dict[str, str], seconds: float, max_tokens: int
) -> float:
    """Jobs per second the stack finishes when kept saturated (a closed loop of 32 clients)."""
    job = inference_job(lambda p: job_body(p.index, max_tokens), {"X-API-Key": keys["tenant-a"]})
    done: list[JobResult] = []
    stop = asyncio.Event()
    started = time.perf_counter()
    loops = asyncio.create_task(
        closed_loop_until(
            client,
            job,
            lambda n: Prompt(n, [], 0, []),
            clients=32,
            cls="",
            stagger_s=0.0,
            stop=stop,
            done=done,
        )
    )
    await asyncio.sleep(seconds)
    stop.set()
    await loops  # the jobs in flight end
    return sum(1 for j in done if j.ok) / (time.perf_counter() - started)


async def one(
    client: httpx.AsyncClient,
    keys: dict[str, str],
    i: int,
    kind: str,
    tally: Tally,
    args: argparse.Namespace,
    rng: random.Random,
) -> None:
    tenant = tenant_of(rng)
    headers = {"X-API-Key": keys[tenant]}
    body = job_body(i, args.max_tokens)
    if kind == "poison":
        body |= POISON[i % len(POISON)]
    try:
        answer = await client.post("/v1/jobs", json=body, headers=headers)
    except httpx.HTTPError as exc:
        tally.unexpected[f"submit {type(exc).__name__}"] += 1
        return
    if kind == "poison":
        if 400 <= answer.status_code < 500:
            tally.refused[answer.status_code] += 1
        else:
            tally.unexpected[f"poison {answer.status_code}"] += 1
        return
    if answer.status_code != 202:
        tally.unexpected[str(answer.status_code)] += 1
        return
    job_id = answer.json()["id"]
    tally.accepted[job_id] = tenant
    if kind == "cancel":
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        cancelled = await client.post(f"/v1/jobs/{job_id}/cancel", headers=headers)
        if cancelled.status_code == 200:
            tally.cancelled.add(job_id)
        elif cancelled.status_code != 409:  # 409: it had ended already
            tally.unexpected[f"cancel {cancelled.status_code}"] += 1


async def watch(redis: redis_lib.Redis, namespace: str, tally: Tally, stop: asyncio.Event) -> None:
    """Every few seconds, read the status of each accepted job not yet seen ending, straight from
    Redis (one pipeline: it costs the API nothing and the load generator little). A record gone
    before its job was seen ending is a lost job: an ended record lives `--ended-ttl-s`, far longer
    than a round of this."""
    from app.core.keys import Keys

    keys = Keys(namespace)
    while True:
        waiting = [j for j in tally.accepted if j not in tally.ended and j not in tally.lost]
        pipe = redis.pipeline(transaction=False)
        for job_id in waiting:
            pipe.hmget(keys.job(job_id), ["status", "completion_tokens"])
        rows = await asyncio.to_thread(pipe.execute) if waiting else []
        for job_id, (status, tokens) in zip(waiting, rows, strict=True):
            if status is None:
                tally.lost.append(job_id)
            elif status.decode() in TERMINAL:
                ended(tally, job_id, tally.accepted[job_id], status.decode(), int(tokens or 0))
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), WATCH_S)
        except TimeoutError:
            pass


def ended(tally: Tally, job_id: str, tenant: str, status: str, tokens: int) -> None:
    if job_id in tally.ended:
        return
    tally.ended.add(job_id)
    tally.final[status] += 1
    if status == "succeeded":
        tally.tokens[tenant] += tokens


async def sample(redis: redis_lib.Redis, roots: list[int], samples: Samples, t: float) -> None:
    used = (await asyncio.to_thread(redis.info, "memory"))["used_memory"]
    samples.redis.append((t, used / 2**20))
    for pid in [p for root in roots for p in (root, *child_pids(root))]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if rss is not None:
            samples.rss.setdefault(f"{role_of(cmdline)} {pid}", []).append((t, rss / 1024))


async def soak(
    client: httpx.AsyncClient,
    keys: dict[str, str],
    redis: redis_lib.Redis,
    roots: list[int],
    rate: float,
    args: argparse.Namespace,
    namespace: str,
) -> tuple[Tally, Samples]:
    rng = random.Random(args.seed + 1)  # the traffic mix; the arrivals have the seed's own stream
    tally, samples = Tally(), Samples()
    stop = asyncio.Event()
    watching = asyncio.create_task(watch(redis, namespace, tally, stop))
    seconds = args.minutes * 60
    times = poisson_arrivals(rate, seconds, args.seed)
    say(f"soak: {len(times)} arrivals over {args.minutes:g} min at {rate:.2f}/s")
    started = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()

    async def sampler() -> None:
        while (t := time.monotonic() - started) < seconds:
            await sample(redis, roots, samples, t)
            await asyncio.sleep(SAMPLE_S)

    sampling = asyncio.create_task(sampler())
    for i, at in enumerate(times):
        delay = at - (time.monotonic() - started)
        tally.lag_s = max(tally.lag_s, -delay)  # the generator behind its schedule: it is the bottleneck
        await asyncio.sleep(max(delay, 0.0))  # always yield, or a late loop would starve every request
        task = asyncio.create_task(
            one(client, keys, i, kind_of(rng, args.cancel, args.poison), tally, args, rng)
        )
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if i % 2000 == 0 and i:
            say(f"soak: {i} arrivals, {len(tally.accepted)} accepted, {time.monotonic() - started:.0f} s")
    await asyncio.gather(*tasks)
    await sampling
    deadline = time.monotonic() + args.drain_s  # the last jobs finish: the watcher sees them end
    while time.monotonic() < deadline and any(
        j not in tally.ended and j not in tally.lost for j in tally.accepted
    ):
        await asyncio.sleep(WATCH_S)
    stop.set()
    await watching
    return tally, samples


async def drain(client: httpx.AsyncClient, keys: dict[str, str], tally: Tally, timeout_s: float) -> None:
    """Poll every accepted job until it ends; lost: gone (404); stuck: not ended by the deadline."""
    waiting = {j: t for j, t in tally.accepted.items() if j not in tally.ended and j not in tally.lost}
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for job_id, tenant in list(waiting.items()):
            answer = await client.get(f"/v1/jobs/{job_id}", headers={"X-API-Key": keys[tenant]})
            if answer.status_code == 404:  # accepted, never seen ending, and gone
                tally.lost.append(job_id)
                del waiting[job_id]
            elif answer.status_code == 200 and (job := answer.json())["status"] in TERMINAL:
                ended(tally, job_id, tenant, job["status"], int(job["usage"]["completion_tokens"]))
                del waiting[job_id]
        if waiting:
            await asyncio.sleep(1.0)
    tally.stuck = list(waiting)


def run(args: argparse.Namespace, model: Model, workdir: Path) -> str:
    from app.api.auth import key_digest, new_api_key

    keys = {tenant: new_api_key() for tenant, _ in TENANTS}
    settings = {
        "CONVEYOR_AUTH": "keys",
        "CONVEYOR_API_KEYS": json.dumps({key_digest(k): t for t, k in keys.items()}),
        "CONVEYOR_ENDED_JOB_TTL_S": str(args.ended_ttl_s),
        "CONVEYOR_METRICS_PORT": str(consecutive_ports(8)),
        "CONVEYOR_RATE_LIMITS": json.dumps({t: {"rps": 1000, "burst": 2000} for t in keys}),
        **dict(e.split("=", 1) for e in args.env),
    }
    with redis_server(workdir) as (url, redis_process):
        with conveyor("conveyor up", workdir, settings | {"REDIS_URL": url}, model=model) as system:
            capacity, elapsed, tally, samples = asyncio.run(measure(system, keys, [redis_process.pid], args))
        text = system.log.read_text(errors="replace")
    return report(args, model, capacity, elapsed, tally, samples, tracebacks(text))


async def measure(
    system: System, keys: dict[str, str], roots: list[int], args: argparse.Namespace
) -> tuple[float, float, Tally, Samples]:
    """Capacity, then the soak at `--load` of it and the drain: the elapsed time, the tally, the samples."""
    assert system.process is not None
    redis = redis_lib.Redis.from_url(system.env["REDIS_URL"])
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=system.base_url, timeout=120.0, limits=limits) as client:
        capacity = await calibrate(client, keys, args.calibrate_s, args.max_tokens)
        say(f"capacity: {capacity:.2f} jobs/s")
        t0 = time.time()
        roots = [system.process.pid, *roots]
        tally, samples = await soak(client, keys, redis, roots, capacity * args.load, args, system.namespace)
        await drain(client, keys, tally, 30.0)  # what the watcher did not see end, as a client sees it
    return capacity, time.time() - t0, tally, samples


def report(
    args: argparse.Namespace,
    model: Model,
    capacity: float,
    elapsed: float,
    tally: Tally,
    samples: Samples,
    traces: list[str],
) -> str:
    warmup = args.warmup_min * 60 if args.warmup_min is not None else max(args.ended_ttl_s, args.minutes * 12)
    after = lambda series: [s for s in series if s[0] >= warmup]  # noqa: E731
    rows = [("redis used_memory", samples.redis)] + sorted(samples.rss.items())
    unexpected = ", ".join(f"{c}: {n}" for c, n in sorted(tally.unexpected.items())) or 0
    lines = [
        "# Soak",
        "",
        f"`python -m bench.soak --model {args.model} --minutes {args.minutes:g} --load {args.load:g}"
        f" --calibrate-s {args.calibrate_s:g}"
        f"{'' if args.warmup_min is None else f' --warmup-min {args.warmup_min:g}'}"
        f"{''.join(f' --env {e}' for e in args.env)}` at commit"
        f" {git_commit()},"
        f" {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; 2 cores, load average at the end"
        f" {Path('/proc/loadavg').read_text().split()[0]}.",
        "",
        f"Capacity {capacity:.2f} jobs/s (closed loop of 32, `max_tokens` {args.max_tokens}); offered"
        f" {args.load:.0%} of it as Poisson arrivals for {args.minutes:g} min, {args.cancel:.0%} cancelled,"
        f" {args.poison:.0%} poison, tenants {', '.join(f'{t} {s:.0%}' for t, s in TENANTS)};"
        f" ended jobs kept {args.ended_ttl_s} s; run and drain {elapsed / 60:.1f} min.",
        "",
        *table(
            "jobs | count>",
            [
                ("accepted (202)", len(tally.accepted)),
                *((f"ended {status}", n) for status, n in sorted(tally.final.items())),
                ("cancel answered 200", len(tally.cancelled)),
                ("**lost** (accepted, then gone)", f"**{len(tally.lost)}**"),
                ("**stuck** (not ended after the drain)", f"**{len(tally.stuck)}**"),
                ("poison refused", ", ".join(f"{c}: {n}" for c, n in sorted(tally.refused.items())) or 0),
                ("unexpected answers", unexpected),
                ("tracebacks in the log", len(traces)),
                ("arrivals behind schedule, at most", f"{tally.lag_s:.2f} s"),
            ],
        ),
        "",
        "Tokens of succeeded jobs per tenant: "
        + ", ".join(f"{t} {n}" for t, n in sorted(tally.tokens.items()))
        + ".",
        "",
        f"Memory after the {warmup / 60:.0f}-minute warm-up (sampled every {SAMPLE_S:g} s):",
        "",
    ]
    cells = []
    for name, series in rows:
        if kept := after(series):
            slope = slope_per_hour(kept)
            cells.append(
                (name, f"{kept[0][1]:.1f}", f"{kept[-1][1]:.1f}", "-" if slope is None else f"{slope:+.1f}")
            )
    lines += table("process | first MiB> | last MiB> | slope MiB/h>", cells)
    if traces:
        lines += ["", "Tracebacks: " + "; ".join(sorted(set(traces)))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--cancel", type=float, default=0.05)
    parser.add_argument("--poison", type=float, default=0.05)
    parser.add_argument("--calibrate-s", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ended-ttl-s", type=int, default=300)
    parser.add_argument("--drain-s", type=float, default=300.0)
    parser.add_argument("--warmup-min", type=float, help="minutes before the slopes (default: see above)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="set in the stack's environment"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.md")
    args = parser.parse_args(argv)
    terminate_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        model = chosen_model(args.model, Path(tmp))
        if model is None:
            return 1
        text = run(args, model, Path(tmp))
    print(text)
    write_results(args.out.stem, text, None, args.out.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
