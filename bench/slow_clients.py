"""Slow clients against a running API: how `/healthz` answers while N connections are held open
without ever sending their headers, against the same API with none held.

    conveyor up &                      # or `conveyor api`, or the proxy in front of it
    python -m bench.slow_clients [--url http://127.0.0.1:8000] [--connections 20000]

Raises its own soft limit of open files to the hard limit (`ulimit -Hn` must allow N plus a few).
Prints how many connections it held, how many the server had closed by the end, and the median
`/healthz` latency with them over the median without (a ratio; a server that stops answering
prints `no answer`).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from urllib.parse import urlsplit

import httpx

from app.api.connections import raise_fd_limit


def healthz_ms(url: str, n: int = 15) -> float | None:
    took = []
    with httpx.Client(timeout=10) as client:
        for _ in range(n):
            started = time.perf_counter()
            try:
                client.get(f"{url}/healthz").raise_for_status()
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--connections", type=int, default=20_000)
    args = parser.parse_args()
    print(f"open files allowed here: {raise_fd_limit()}")
    parts = urlsplit(args.url)
    healthz_ms(args.url, n=5)  # warm-up: the first answers pay for imports and connections
    baseline = healthz_ms(args.url)
    held = hold(parts.hostname or "127.0.0.1", parts.port or 80, args.connections)
    loaded = healthz_ms(args.url)
    closed = closed_by_server(held)
    print(f"held {len(held)} connections without headers; {closed} closed by now (by the server, or reset)")
    if baseline is None or loaded is None:
        print(f"/healthz: no answer ({'with' if baseline else 'without'} the idle connections)")
    else:
        ratio = loaded / baseline
        print(f"/healthz median {loaded:.1f} ms with them, {baseline:.1f} ms without: {ratio:.2f}x")
    for s in held:
        s.close()


if __name__ == "__main__":
    main()
