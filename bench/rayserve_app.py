"""Ray Serve as the seeds ran it: one replica, `@serve.batch` around the same model's `model.generate`.

Ray Serve batches requests (up to `MAX_BATCH_SIZE`, waiting at most `BATCH_WAIT_S`); a batch is one
left-padded `generate` call for its longest answer (request-level batching), each request cut to its
own length. Body, answer and prompt rendering are the naive server's (bench/naive_server.py), so
bench.load's `naive_job` drives both.

bench.suite runs it (`python -m bench.rayserve_app --model DIR --port N`; the `bench` extra): a local
Ray (2 CPUs, no dashboard), the app at / on `--port`, a line once ready, until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

BATCH_LINE = "ray serve batch:"
MAX_BATCH_SIZE = 32
BATCH_WAIT_S = 0.05
NUM_CPUS = 2  # the replica's: torch in it uses both cores, as the other systems' workers do
MAX_ONGOING_REQUESTS = 1024  # Ray's default (5) would cap a batch at 5: the open loop sends many more


def build_app(model_path: Path, *, max_batch_size: int, batch_wait_s: float) -> Any:
    """The Serve application: one `Generator` replica over the model at `model_path`."""
    import torch
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from bench.naive_server import Engine, GenerateRequest, generate_rows

    @serve.deployment(
        num_replicas=1,
        ray_actor_options={"num_cpus": NUM_CPUS},
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        max_queued_requests=-1,
    )
    class Generator:
        def __init__(self) -> None:
            torch.set_num_threads(NUM_CPUS)
            self.engine = Engine(model_path)

        def generate(self, rows: list[tuple[list[int], int, bool]]) -> list[list[int]]:
            """One `generate` call for the batch; row i's answer cut to its own `max_tokens`. Each
            call prints a `BATCH_LINE` (the replica's output reaches the server's log), so a run can
            say which batch sizes Ray Serve actually formed (`batch_sizes`)."""
            started = time.perf_counter()
            longest, exact = max(r[1] for r in rows), all(r[2] for r in rows)
            pad_id = int(self.engine.tokenizer.pad_token_id)
            new = generate_rows(self.engine.model, [r[0] for r in rows], pad_id, longest, exact=exact)
            took = time.perf_counter() - started
            print(f"{BATCH_LINE} rows={len(rows)} longest={longest} seconds={took:.3f}", flush=True)
            return [new[i, : r[1]].tolist() for i, r in enumerate(rows)]

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_s)
        async def batched(self, rows: list[tuple[list[int], int, bool]]) -> list[list[int]]:
            # In a thread: the replica's event loop keeps taking requests into the next batch meanwhile.
            return await asyncio.to_thread(self.generate, rows)

        async def __call__(self, request: Request) -> JSONResponse:
            if request.method == "GET":
                return JSONResponse({"status": "ok"})
            try:
                body = GenerateRequest.model_validate(await request.json())
            except ValueError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=422)
            prompt_ids = self.engine.encode(body)
            token_ids = await self.batched((prompt_ids, body.max_tokens, body.ignore_eos))
            return JSONResponse(
                {
                    "text": self.engine.tokenizer.decode(token_ids, skip_special_tokens=True),
                    "token_ids": token_ids,
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": len(token_ids),
                }
            )

    return Generator.bind()


def batch_sizes(log: str) -> list[int]:
    """The size of every batch a replica ran, in order, from the server's log."""
    return [int(m.group(1)) for m in re.finditer(re.escape(BATCH_LINE) + r" rows=(\d+)", log)]


def describe(sizes: list[int]) -> str:
    """`n batches, mean m, max x; sizes: size x count, ...` (what a run says about its batching)."""
    if not sizes:
        return "no batches"
    counts = Counter(sizes)
    spread = ", ".join(f"{size}x{counts[size]}" for size in sorted(counts))
    return f"{len(sizes)} batches, mean {sum(sizes) / len(sizes):.1f}, max {max(sizes)}; sizes: {spread}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=MAX_BATCH_SIZE)
    parser.add_argument("--batch-wait-s", type=float, default=BATCH_WAIT_S)
    args = parser.parse_args(argv)
    import ray
    from ray import serve

    # address="local": a fresh instance of our own, never one another program started on this machine
    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, object_store_memory=200 * 2**20)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(signum, lambda *_: stopping.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        app = build_app(args.model, max_batch_size=args.max_batch_size, batch_wait_s=args.batch_wait_s)
        serve.run(app, name="generator", route_prefix="/")
        print(f"ray serve: ready on port {args.port}", flush=True)
        stopping.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
