"""Slow clients against a running API: how `/healthz` answers while N connections are held open
without ever sending their headers, against the same API with none held.

    conveyor up &                      # or `conveyor api`, or the proxy in front of it
    python -m bench.slow_clients [--url http://127.0.0.1:8000] [--connections 20000]
        [--processes 2] [--api-key cvk_...]

Raises its own soft limit of open files to the hard limit; `--processes` spreads the connections
over that many processes, each under its own limit (`ulimit -Hn` must allow N / processes plus a
few). Prints how many connections it held, how many the server had closed by the end, and the
median `/healthz` latency with them over the median without (a ratio; a server that stops answering
prints `no answer`); with `--api-key`, the same for an authenticated submit (`POST /v1/jobs`, 202).
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import time
from multiprocessing.connection import Connection
from urllib.parse import urlsplit

import httpx

from app.api.connections import raise_fd_limit


def median_ms(url: str, n: int = 15, api_key: str | None = None) -> float | None:
    """The median time of `n` GET /healthz, or with `api_key` of `n` authenticated submits (202)."""
    took = []
    with httpx.Client(timeout=10) as client:
        for _ in range(n):
            started = time.perf_counter()
            try:
                if api_key is None:
                    client.get(f"{url}/healthz").raise_for_status()
                else:
                    answer = client.post(
                        f"{url}/v1/jobs",
                        headers={"X-API-Key": api_key},
                        json={"prompt": "held connections", "max_tokens": 1},
                    )
                    if answer.status_code != 202:
                        return None
            except httpx.HTTPError:
                return None
            took.append((time.perf_counter() - started) * 1000)
    return statistics.median(took)


def hold(host: str, port: int, n: int) -> list[socket.socket]:
    held = []
    for _ in range(n):
        try:
            held.append(socket.create_connection((host, port), timeout=5))
        except OSError as exc:
            print(f"stopped opening at {len(held)}: {exc}")
            break
    return held


def closed_by_server(held: list[socket.socket]) -> int:
    closed = 0
    for s in held:
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except ConnectionError:
            closed += 1
    return closed


def holder(host: str, port: int, n: int, pipe: Connection) -> None:
    """One process's share: open `n`, report how many, wait for the word, report how many closed."""
    raise_fd_limit()
    held = hold(host, port, n)
    pipe.send(len(held))
    pipe.recv()
    pipe.send(closed_by_server(held))
    for s in held:
        s.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--connections", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=1, help="processes holding the connections")
    parser.add_argument("--api-key", default=None, help="also time an authenticated submit")
    args = parser.parse_args()
    print(f"open files allowed here: {raise_fd_limit()} per process, {args.processes} processes")
    parts = urlsplit(args.url)
    probes = {"/healthz": None, **({"submit": args.api_key} if args.api_key else {})}
    for key in probes.values():
        median_ms(args.url, n=5, api_key=key)  # warm-up: the first answers pay for imports and connections
    baseline = {name: median_ms(args.url, api_key=key) for name, key in probes.items()}
    pipes = []
    for i in range(args.processes):
        share = args.connections // args.processes + (i < args.connections % args.processes)
        ours, theirs = multiprocessing.Pipe()
        target = (parts.hostname or "127.0.0.1", parts.port or 80, share, theirs)
        multiprocessing.Process(target=holder, args=target, daemon=True).start()
        pipes.append(ours)
    held = sum(p.recv() for p in pipes)
    loaded = {name: median_ms(args.url, api_key=key) for name, key in probes.items()}
    for p in pipes:
        p.send("close")
    closed = sum(p.recv() for p in pipes)
    print(f"held {held} connections without headers; {closed} closed by now (by the server, or reset)")
    for name in probes:
        before, during = baseline[name], loaded[name]
        if before is None or during is None:
            print(f"{name}: no answer ({'with' if before else 'without'} the idle connections)")
        else:
            print(f"{name} median {during:.1f} ms with them, {before:.1f} ms without: {during / before:.2f}x")


if __name__ == "__main__":
    main()
