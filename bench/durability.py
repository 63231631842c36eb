"""What synchronous durability costs a submit: `CONVEYOR_SUBMIT_DURABILITY` memory vs fsync.

For each mode, the real API app (in process, no worker: jobs stay queued) on an embedded Redis of
its own, configured as `conveyor up` configures it for that mode (`appendfsync everysec`, or
`always`), takes `--submits` POST /v1/jobs at each concurrency, the two modes interleaved for
`--rounds` rounds; the submits per second (median of the rounds) and the latency of each submit
(request to 202) are measured in the same run, and the ratio printed. The disk
is this machine's: an fsync's price is the disk's, so measure on the disk you will deploy on.

    python -m bench.durability [--submits 1000] [--concurrency 1,8] [--rounds 3]

Writes bench/results/durability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis as redis_lib
from fastapi.testclient import TestClient

from bench.report import RESULTS_DIR, git_commit, percentile
from bench.systems import redis_server, say, tiny

MODES = (("memory", "everysec"), ("fsync", "always"))


def submit(client: TestClient, i: int, latencies: list[float]) -> None:
    started = time.perf_counter()
    answer = client.post("/v1/jobs", json={"prompt": f"job {i}", "max_tokens": 4})
    if answer.status_code != 202:
        raise RuntimeError(f"{answer.status_code} {answer.text[:200]}")
    latencies.append(time.perf_counter() - started)


@contextlib.contextmanager
def api(mode: str, appendfsync: str, workdir: Path) -> Iterator[TestClient]:
    """The API in process with `mode`, on an embedded Redis of its own with `appendfsync`."""
    from app.api.app import create_app
    from app.core.config import Settings
    from app.core.keys import Keys

    model = tiny(workdir)
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    with redis_server(workdir, appendfsync) as (url, _):
        settings = Settings(
            redis_url=url,
            namespace=namespace,
            models={model.name: model.path},
            default_model=model.name,
            embedding_stages=0,
            auth="none",
            submit_durability=mode,  # type: ignore[arg-type]
            queue_depth_limit=10**6,
            overload_limit=10**6,
            rate_limits={"anonymous": {"rps": 10**6, "burst": 10**6}},  # type: ignore[dict-item]
        )
        redis_lib.Redis.from_url(url).zadd(Keys(namespace).workers(model.name, 0), {"w0": time.time() + 3600})
        with TestClient(create_app(settings)) as client:
            for i in range(20):  # warm: tokenizer, scripts, connections
                submit(client, i, [])
            yield client


def measure(client: TestClient, clients: int, submits: int) -> tuple[float, list[float]]:
    """Submits per second and each submit's latency (s), `clients` at a time."""
    latencies: list[float] = []
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda i: submit(client, i, latencies), range(submits)))
    return submits / (time.perf_counter() - started), latencies


def run(
    levels: list[int], submits: int, rounds: int, workdir: Path
) -> dict[str, dict[int, dict[str, float]]]:
    """Both modes side by side, interleaved round by round (the machine's noise hits both alike)."""
    rates: dict[tuple[str, int], list[float]] = {}
    latencies: dict[tuple[str, int], list[float]] = {}
    with contextlib.ExitStack() as stack:
        clients = {mode: stack.enter_context(api(mode, fsync, workdir)) for mode, fsync in MODES}
        for r in range(rounds):
            for c in levels:
                for mode, _ in MODES:
                    rate, took = measure(clients[mode], c, submits)
                    rates.setdefault((mode, c), []).append(rate)
                    latencies.setdefault((mode, c), []).extend(took)
                    say(f"round {r + 1}: {mode} c{c}: {rate:.0f} submits/s")
    return {
        mode: {
            c: {
                "rate": statistics.median(rates[mode, c]),
                "p50": statistics.median(latencies[mode, c]) * 1000,
                "p99": (percentile(latencies[mode, c], 99) or 0.0) * 1000,
            }
            for c in levels
        }
        for mode, _ in MODES
    }


def report(results: dict[str, dict[int, dict[str, float]]], args: argparse.Namespace) -> str:
    lines = [
        "# Submit durability: what `CONVEYOR_SUBMIT_DURABILITY=fsync` costs",
        "",
        f"`python -m bench.durability --submits {args.submits} --concurrency {args.concurrency}"
        f" --rounds {args.rounds}` at commit"
        f" {git_commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; 2 cores, this machine's"
        " disk;"
        f" load average at the end {Path('/proc/loadavg').read_text().split()[0]}. The API in process, no"
        " worker; the embedded Redis (6.2) with `appendfsync everysec` (memory) or `always` (fsync).",
        "",
        "| clients | memory submits/s | fsync submits/s | ratio | memory p50 ms | fsync p50 ms | memory p99 ms | fsync p99 ms |",  # noqa: E501
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    memory, fsync = results["memory"], results["fsync"]
    for c in sorted(memory):
        m, f = memory[c], fsync[c]
        lines.append(
            f"| {c} | {m['rate']:.0f} | {f['rate']:.0f} | {f['rate'] / m['rate']:.2f}x | {m['p50']:.1f} |"
            f" {f['p50']:.1f} | {m['p99']:.1f} | {f['p99']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submits", type=int, default=1000)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "durability.md")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-durability-") as tmp:
        results = run(levels, args.submits, args.rounds, Path(tmp))
    text = report(results, args)
    print(text)
    args.out.write_text(text)
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
