"""Stage-hop latency over the lane and through real Celery on Redis, against a plain LPUSH/BRPOP floor.

    .venv/bin/python -m bench.hop [--hops 1000] [--gap-ms 2]

What a hop is: a decode step's stage message (the real `StepMessage` wire form, hidden states
[8, 1, 576] float32 in the raw codec) sent as `app.workers.main` sends it, to one real stage
worker process (`serve()`: a solo-pool Celery worker and its lane thread, the project's app
factory and step task, `bench/hop_worker.py`): over the lane (`lane.send`, how decode steps
travel), and by `send_task` with the msgpack serializer (how prefill steps travel). Measured one
way, on Linux's system-wide monotonic clock: from just before `StepMessage.to_wire()` and the send
in this process to the moment the handler starts in the worker ("start"), and to the moment its
hidden states are decoded ("ready"). One message is in flight at a time, with a short gap between
hops so the worker waits in BRPOP as an idle next stage does. The floor is the same message bytes
through a plain redis-py LPUSH and BRPOP between the same two processes. A second table sweeps the
payload size, inline against the claim check. REDIS_URL (or redis://127.0.0.1:6379/0) is used
under a unique namespace, which is deleted afterwards, as are the worker processes.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import torch

from app.core.broker import create_celery_app
from app.core.config import Settings
from app.core.protocol import STEP_TASK, StepMessage
from app.core.redis import sync_client
from app.partitions.claimcheck import ClaimCheck
from app.partitions.codecs import Wire, encode_tensor
from app.workers import lane
from bench.hop_worker import celery_queue, floor_queue, lane_key, now_ns, results_key
from bench.report import git_commit, percentile, write_results
from bench.systems import say, server_process, terminate_on_sigterm

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
BATCH, HIDDEN = 8, 576
TARGET_P50_MS, TARGET_P99_MS = 1.0, 3.0
FIRST_HOP_TIMEOUT_S = 90.0  # the worker is still starting (imports torch, connects)
HOP_TIMEOUT_S = 10.0
WARMUP = 50
SWEEP = [(1, 300), (2, 300), (4, 300), (16, 200), (128, 60)]  # (sequence length, hops): [8, S, 576] float32

Send = Callable[[StepMessage], None]


@dataclass(frozen=True)
class Hops:
    name: str
    payload_bytes: int
    send_ms: list[float]  # the send call itself, in this process
    start_ms: list[float]
    ready_ms: list[float]

    def stats(self, values: list[float]) -> dict[str, float]:
        return {
            "p50": percentile(values, 50) or 0.0,
            "p99": percentile(values, 99) or 0.0,
            "mean": sum(values) / len(values),
            "max": max(values),
        }

    def series(self) -> dict[str, list[float]]:
        return {"send": self.send_ms, "start": self.start_ms, "ready": self.ready_ms}


def stage_message(seq: int, namespace: str) -> tuple[StepMessage, dict[str, Wire]]:
    """A decode (or, for seq > 1, prefill-sized) forward message from stage 0 to stage 1."""
    hidden = torch.randn(BATCH, seq, HIDDEN)  # [B, S, D]
    msg = StepMessage(
        batch_id=f"hop-{secrets.token_hex(4)}",
        model="hop",
        stage=1,
        num_stages=2,
        kind="decode",
        step=1,
        seq_ids=[f"job-{i:02d}" for i in range(BATCH)],
        routes=[f"{namespace}.stage.hop.0.w0", f"{namespace}.stage.hop.1.w1"],
    )
    return msg, {"hidden": encode_tensor(hidden)}


def run_hops(
    name: str,
    send: Send,
    *,
    redis: Any,
    namespace: str,
    seq: int,
    hops: int,
    gap_s: float,
    claims: ClaimCheck | None = None,
) -> Hops:
    """`hops` messages one at a time (after WARMUP more); times from this process's send instant."""
    msg, tensors = stage_message(seq, namespace)
    sent, start, ready = [], [], []
    for i in range(WARMUP + hops):
        time.sleep(gap_s)
        t0 = now_ns()
        send(msg.forward(tensors=claims.put_all(tensors) if claims else tensors))
        t1 = now_ns()
        popped = redis.blpop(
            [results_key(namespace)], timeout=FIRST_HOP_TIMEOUT_S if i == 0 else HOP_TIMEOUT_S
        )
        if popped is None:
            raise RuntimeError(f"{name}: no answer from the worker after hop {i}")
        started, decoded = msgpack.unpackb(popped[1])
        if i >= WARMUP:
            sent.append((t1 - t0) / 1e6)
            start.append((started - t0) / 1e6)
            ready.append((decoded - t0) / 1e6)
    return Hops(name, len(tensors["hidden"]["data"]), sent, start, ready)


@contextmanager
def worker(mode: str, url: str, namespace: str, logs: Path, *extra: str) -> Iterator[None]:
    argv = [sys.executable, "-m", "bench.hop_worker", mode, "--url", url, "--namespace", namespace, *extra]
    name = f"hop worker ({mode}{' ' + ' '.join(extra) if extra else ''})"
    log = logs / f"{mode}{''.join(extra)}.log"
    with server_process(name, argv, dict(os.environ), log, stop_timeout_s=15.0):
        yield


def celery_sender(app: Any, queue: str, *, argsrepr: bool) -> Send:
    """`send_task` as app/workers/main.py calls it; `argsrepr` given skips Celery's saferepr of the args."""

    def send(msg: StepMessage) -> None:
        if argsrepr:
            summary = f"<{msg.kind} {msg.batch_id} step {msg.step} -> stage {msg.stage}>"
            app.send_task(STEP_TASK, args=[msg.to_wire()], queue=queue, argsrepr=summary, kwargsrepr="{}")
        else:
            app.send_task(STEP_TASK, args=[msg.to_wire()], queue=queue)

    return send


def lane_sender(redis: Any, key: str) -> Send:
    """`lane.send` as a stage's `hand_off` calls it for decode steps (app/workers/main.py)."""

    def send(msg: StepMessage) -> None:
        lane.send(redis, key, msg.to_wire())

    return send


def celery_runs(url: str, namespace: str, redis: Any, args: argparse.Namespace, logs: Path) -> list[Hops]:
    """The decode hop over the lane, then over Celery with task events off, off + argsrepr, on
    (Flower needs them); then the size sweep over Celery (prefill-sized messages travel there)."""
    app = create_celery_app(Settings(namespace=namespace, celery_events=False), url)
    plain = celery_sender(app, celery_queue(namespace), argsrepr=False)
    light = celery_sender(app, celery_queue(namespace), argsrepr=True)
    hop = partial(run_hops, redis=redis, namespace=namespace, gap_s=args.gap_ms / 1000)
    claims = ClaimCheck(redis, namespace=namespace, threshold_bytes=0, ttl_s=60)
    try:
        with worker("celery", url, namespace, logs):
            runs = [
                hop("lane (decode hand-offs)", lane_sender(redis, lane_key(namespace)), seq=1, hops=args.hops)
            ]
            runs.append(hop("celery, events off", plain, seq=1, hops=args.hops))
            runs.append(hop("celery, events off, argsrepr given", light, seq=1, hops=args.hops))
        with worker("celery", url, namespace, logs, "--events"):
            runs.append(hop("celery, events on (default settings)", plain, seq=1, hops=args.hops))
            for seq, hops in SWEEP:
                for how, check in (("inline", None), ("claim check", claims)):
                    runs.append(hop(f"8×{seq}×576, {how}", plain, seq=seq, hops=hops, claims=check))
                    say(f"{runs[-1].name}: p50 ready {runs[-1].stats(runs[-1].ready_ms)['p50']:.2f} ms")
    finally:
        app.close()
    return runs


def floor_run(url: str, namespace: str, redis: Any, args: argparse.Namespace, logs: Path) -> Hops:
    queue = floor_queue(namespace)

    def send(msg: StepMessage) -> None:
        redis.lpush(queue, msgpack.packb(msg.to_wire()))

    with worker("redis", url, namespace, logs):
        name = "redis LPUSH/BRPOP floor"
        return run_hops(
            name, send, redis=redis, namespace=namespace, seq=1, hops=args.hops, gap_s=args.gap_ms / 1000
        )


def cleanup(redis: Any, namespace: str) -> None:
    """Every key this run made: its own namespace, its Celery queues, kombu's binding records of them."""
    patterns = [f"{namespace}:*", f"{namespace}.*", f"_kombu.binding*.{namespace}*"]
    keys = [key for pattern in patterns for key in redis.scan_iter(match=pattern, count=1000)]
    if keys:
        redis.delete(*keys)
    say(f"deleted {len(keys)} keys of namespace {namespace}")


def cells(hops: Hops, values: list[float], *fields: str) -> str:
    s = hops.stats(values)
    return " | ".join(f"{s[f]:.3f}" for f in fields)


def decode_table(runs: list[Hops]) -> list[str]:
    lines = [
        "| path | send p50 ms | start p50 ms | start p99 | start mean | start max | ready p50 ms | ready p99 "
        "| target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for h in runs:
        s = h.stats(h.start_ms)
        verdict = "met" if s["p50"] <= TARGET_P50_MS and s["p99"] <= TARGET_P99_MS else "missed"
        lines.append(
            f"| {h.name} | {cells(h, h.send_ms, 'p50')} "
            f"| {cells(h, h.start_ms, 'p50', 'p99', 'mean', 'max')} "
            f"| {cells(h, h.ready_ms, 'p50', 'p99')} | {verdict} |"
        )
    return lines


def sweep_table(runs: list[Hops]) -> list[str]:
    lines = [
        "| hidden [B, S, D] | tensor bytes | send p50 ms | ready p50 ms | ready p99 | ready mean | hops |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for h in runs:
        lines.append(
            f"| {h.name} | {h.payload_bytes:,} | {cells(h, h.send_ms, 'p50')} "
            f"| {cells(h, h.ready_ms, 'p50', 'p99', 'mean')} | {len(h.ready_ms)} |"
        )
    return lines


def report(decode: list[Hops], sweep: list[Hops], args: argparse.Namespace) -> str:
    load = os.getloadavg()
    return "\n".join(
        [
            "# Stage hop latency",
            "",
            "Decode-sized stage message (hidden [8, 1, 576] float32, raw codec, "
            f"{decode[0].payload_bytes:,} bytes of tensor data) in the `StepMessage` wire form, msgpack "
            f"serializer, one way, {args.hops} hops after {WARMUP} warm-up, {args.gap_ms:g} ms apart. "
            "send = the send call in the sender; start = send → the handler starts in the worker; "
            "ready = send → hidden states decoded. "
            f"Targets (start): p50 ≤ {TARGET_P50_MS:g} ms, p99 ≤ {TARGET_P99_MS:g} ms.",
            f"Commit {git_commit()}, {os.cpu_count()} CPUs shared with other work, "
            f"load average {load[0]:.2f}.",
            "",
            *decode_table(decode),
            "",
            "Payload sweep (celery, events on): send (with the claim-check SET, if any) → hidden states "
            "decoded (after the GETDEL, if any).",
            "",
            *sweep_table(sweep),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hops", type=int, default=1000)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="pause between hops")
    args = parser.parse_args()
    terminate_on_sigterm()
    url = Settings().redis_url or DEFAULT_REDIS_URL
    namespace = f"bench-hop-{secrets.token_hex(4)}"
    redis = sync_client(url)
    logs = Path(tempfile.mkdtemp(prefix="conveyor-hop-"))
    say(f"Redis {url}, namespace {namespace}, worker logs in {logs}")
    try:
        runs = celery_runs(url, namespace, redis, args, logs)
        decode, sweep = [*runs[:4], floor_run(url, namespace, redis, args, logs)], runs[4:]
    finally:
        cleanup(redis, namespace)
    shutil.rmtree(logs)  # kept only when a run failed
    text = report(decode, sweep, args)
    print(text)
    payload = {
        h.name: {"bytes": h.payload_bytes, **{k: h.stats(v) for k, v in h.series().items()}} for h in runs
    }
    write_results("hop", text, payload)


if __name__ == "__main__":
    main()
