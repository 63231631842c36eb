"""The load clients bench/clients.py runs, as data: what to install, how to call each, how to read its answer.

Two independent, widely used load generators for OpenAI-compatible servers measure Conveyor here so that
its figures do not rest on the project's own load generator alone: guidellm (vLLM project) and NVIDIA's
aiperf. Each gets the same workload: `requests` streamed `/v1/completions` requests of `prompt_tokens`
synthetic prompt tokens and exactly `output_tokens` output tokens (`ignore_eos`), with `concurrency`
requests in flight. Everything here is a function of its inputs (no processes, no network), so the
command lines and the parsing of each tool's JSON are unit-tested on fixtures shaped like real output.

The tools are pinned: their JSON layouts change between releases (guidellm 0.8 replaced its whole CLI),
and a row must mean the same thing from run to run.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GUIDELLM = "guidellm"
AIPERF = "aiperf"
PINS = {GUIDELLM: "0.8.1", AIPERF: "0.13.0"}  # the releases whose JSON the parsers below read
CLOSED_HUB = "http://127.0.0.1:9"  # the discard port: nothing listens, so a hub call fails at once


@dataclass(frozen=True)
class Workload:
    """What every client is asked to do, the same for both."""

    url: str  # the stack's base URL, no /v1
    model: str  # the served model's name, as /v1/models lists it
    tokenizer: Path  # the model's local directory: no hub is reachable
    requests: int
    prompt_tokens: int
    output_tokens: int
    timeout_s: float  # per request; a stuck request is a failed one, not a stuck benchmark


@dataclass(frozen=True)
class Row:
    """One client at one concurrency, in the units of the table (what each tool itself reported)."""

    client: str
    concurrency: int
    ok: int
    failed: int
    output_tokens_per_s: float | None
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    latency_p50_s: float | None


# ---------------------------------------------------------------- arguments


def concurrency_list(text: str) -> tuple[int, ...]:
    """`--concurrency 1,8` → (1, 8): positive, deduplicated, in the order given."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be positive integers: {text!r}")
    return tuple(dict.fromkeys(levels))


def client_list(text: str) -> tuple[str, ...]:
    """`--clients guidellm,aiperf`: known names only, so a typo fails before the stack starts."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in PINS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"choose clients from {', '.join(PINS)}; got {text!r}")
    return names


# ---------------------------------------------------------------- command lines


def guidellm_argv(venv: Path, work: Workload, concurrency: int, out: Path) -> list[str]:
    """`guidellm run` (0.8's `kind=...` options): one concurrent profile, stopped after `requests`.

    guidellm itself sends `max_tokens`, `ignore_eos: true` and `stop: null` when the data fixes the
    output length, and `stream_options.continuous_usage_stats`.
    """
    data = f"kind=synthetic_text,prompt_tokens={work.prompt_tokens},output_tokens={work.output_tokens}"
    backend = (
        f"kind=openai_http,target={work.url},model={work.model},request_format=/v1/completions,"
        f"timeout={work.timeout_s:g}"
    )
    return [
        str(venv / "bin" / "guidellm"),
        "run",
        "--backend", backend,
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--data", data,
        "--tokenizer", f"kind=huggingface_auto,model={work.tokenizer}",
        "--constraint", f"kind=max_requests,count={work.requests}",
        "--output", f"kind=json,path={out}",
        "--disable-progress",
    ]  # fmt: skip


def aiperf_argv(venv: Path, work: Workload, concurrency: int, out_dir: Path) -> list[str]:
    """`aiperf profile` against /v1/completions, streaming, with the server's token counts.

    `--use-server-token-count`: aiperf otherwise re-tokenizes the streamed text, which does not always
    give back the 64 tokens generated (a byte-level BPE merges differently across chunk boundaries), and
    its inter-token latency divides by that count. No GPU telemetry and no /metrics scraping: there is no
    GPU and Conveyor's /metrics is not vLLM's.
    """
    return [
        str(venv / "bin" / "aiperf"),
        "profile",
        "--url", work.url,
        "--model", work.model,
        "--endpoint-type", "completions",
        "--streaming",
        "--tokenizer", str(work.tokenizer),
        "--concurrency", str(concurrency),
        "--request-count", str(work.requests),
        "--isl", str(work.prompt_tokens),
        "--osl", str(work.output_tokens),
        "--extra-inputs", "ignore_eos:true",
        "--use-server-token-count",
        "--request-timeout-seconds", f"{work.timeout_s:g}",
        "--no-gpu-telemetry",
        "--no-server-metrics",
        "--ui", "none",
        "--random-seed", "42",
        "--artifact-dir", str(out_dir),
    ]  # fmt: skip


def client_env(client: str, base: Mapping[str, str]) -> dict[str, str]:
    """The environment a client runs in: no model hub, ever.

    Both read the tokenizer from the model's local directory. guidellm honours HF_HUB_OFFLINE /
    TRANSFORMERS_OFFLINE. aiperf must not see them: in offline mode it looks the name up in the hub
    cache only and rejects a directory path (HFValidationError), while online it loads a path directly
    and asks the hub nothing. HF_ENDPOINT points at a closed local port for both, so that a call to the
    hub that slips through fails at once instead of hanging.
    """
    env = {k: v for k, v in base.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=CLOSED_HUB, HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1")
    if client == GUIDELLM:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


# ---------------------------------------------------------------- parsing


def stat(metric: Mapping[str, Any] | None, key: str) -> float | None:
    """`metric[key]` as a float, None where the tool left it out (no successful request, say)."""
    if not metric or metric.get(key) is None:
        return None
    return float(metric[key])


def guidellm_rows(doc: Mapping[str, Any]) -> list[Row]:
    """One row per benchmark in a `guidellm run --output kind=json` file.

    Each metric holds distributions per outcome; the successful requests' are the figures guidellm's
    own console tables print (output tokens/s: its "Server Throughput" mean).
    """
    rows = []
    for bench in doc["benchmarks"]:
        metrics, strategy = bench["metrics"], bench["config"]["strategy"]
        totals = metrics["request_totals"]

        def ok(name: str, key: str = "median", metrics: Mapping[str, Any] = metrics) -> float | None:
            return stat((metrics.get(name) or {}).get("successful"), key)

        rows.append(
            Row(
                client=GUIDELLM,
                concurrency=int(strategy.get("streams") or strategy["max_concurrency"]),
                ok=int(totals["successful"]),
                failed=int(totals["errored"]) + int(totals.get("incomplete", 0)),
                output_tokens_per_s=ok("output_tokens_per_second", "mean"),
                ttft_p50_ms=ok("time_to_first_token_ms"),
                itl_p50_ms=ok("inter_token_latency_ms"),
                latency_p50_s=ok("request_latency"),
            )
        )
    return rows


def aiperf_row(doc: Mapping[str, Any]) -> Row:
    """The row of one `aiperf profile` run, from its `profile_export_aiperf.json`.

    `request_count` counts the requests that succeeded; `error_request_count` is present only when some
    failed. Latencies are in ms there; the table's request latency is in seconds.
    """
    phase = next(p for p in doc["input_config"]["phases"] if p.get("kind", p.get("name")) == "profiling")
    latency_ms = stat(doc.get("request_latency"), "p50")
    return Row(
        client=AIPERF,
        concurrency=int(phase["concurrency"]),
        ok=int(stat(doc.get("request_count"), "avg") or 0),
        failed=int(stat(doc.get("error_request_count"), "avg") or 0),
        output_tokens_per_s=stat(doc.get("output_token_throughput"), "avg"),
        ttft_p50_ms=stat(doc.get("time_to_first_token"), "p50"),
        itl_p50_ms=stat(doc.get("inter_token_latency"), "p50"),
        latency_p50_s=None if latency_ms is None else latency_ms / 1000,
    )


def tool_version(client: str, doc: Mapping[str, Any]) -> str | None:
    """The version a client wrote into its own output (what actually ran, whatever the pin said)."""
    if client == GUIDELLM:
        return doc.get("metadata", {}).get("guidellm_version")
    return doc.get("aiperf_version")


# ---------------------------------------------------------------- the table


def cell(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table(rows: Sequence[Row]) -> list[str]:
    """The Markdown table: one row per client and concurrency, in the order run."""
    lines = [
        "| client | concurrency | requests ok / failed | output tok/s | TTFT p50 (ms) | ITL p50 (ms) "
        "| latency p50 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [
            r.client,
            str(r.concurrency),
            f"{r.ok} / {r.failed}",
            cell(r.output_tokens_per_s, 1),
            cell(r.ttft_p50_ms, 0),
            cell(r.itl_p50_ms, 1),
            cell(r.latency_p50_s, 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(rows: Sequence[Row], meta: Mapping[str, Any], failures: Sequence[str]) -> str:
    """bench/results/clients.md: how it was run, with what, on how loaded a machine, and the table."""
    versions = ", ".join(f"{name} {version}" for name, version in meta["versions"].items())
    load = meta["load_average"]
    settings = ", ".join(f"`{k}={v}`" for k, v in sorted(meta.get("settings", {}).items()))
    lines = [
        "# Conveyor under guidellm and aiperf",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['model']} on {meta['target']}, /v1/completions streamed, {meta['prompt_tokens']} prompt "
        f"tokens → {meta['output_tokens']} output tokens (`ignore_eos`), {meta['requests']} requests per "
        f"client and concurrency; {meta['started']}, commit {meta['commit']}, {meta['cpus']} CPUs.",
        "",
        *table(rows),
        "",
        f"- clients: {versions} (each in its own virtualenv under .conveyor/bench-venvs/)",
        f"- stack settings from the environment: {settings or 'none (the defaults)'}",
        f"- 1-minute load average: {load['before']:.2f} before, {load['after']:.2f} after "
        f"(the machine is shared: other work skews the figures)",
        f"- wall time: {meta['wall_s']:.0f} s",
        *(f"- failure: {line}" for line in failures),
        "",
        "The command lines, as run:",
        "",
        "```",
        *meta["commands"],
        "```",
    ]
    return "\n".join(lines) + "\n"
