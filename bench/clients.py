"""Conveyor measured by guidellm and NVIDIA aiperf, load clients people point at OpenAI-compatible servers.

Run from the repository root:

    .venv/bin/python -m bench.clients --requests 16 --concurrency 1,8 [--url http://127.0.0.1:8000]

Each client is installed on first use, pinned, into its own virtualenv under .conveyor/bench-venvs/ (their
dependencies conflict with each other and with the project's: never into .venv). Without --url a stack
is started as the other benchmarks start one (`conveyor up`, its own namespace, ports and home) with
SmolLM2 from .conveyor/models, and stopped at the end. Each client then runs once per concurrency level
against /v1/completions, streamed, at fixed prompt and output lengths; the rows come from each tool's
own JSON (bench/clients_tools.py). Prints the table and writes bench/results/clients.md; the tools' raw
outputs and logs stay in a temporary directory whose path is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.clients_tools import (
    AIPERF,
    GUIDELLM,
    PINS,
    Row,
    Workload,
    aiperf_argv,
    aiperf_row,
    client_env,
    client_list,
    concurrency_list,
    guidellm_argv,
    guidellm_rows,
    report,
    table,
    tool_version,
)
from bench.report import RESULTS_DIR, git_commit, write_results
from bench.systems import MODEL_DIR, ROOT, conveyor, log_tail, say, server_process, terminate_on_sigterm

VENVS = ROOT / ".conveyor" / "bench-venvs"
INSTALL_TIMEOUT_S = 1800.0  # guidellm brings torch and CUDA wheels: GBs on a first install
WARM_UP_TOKENS = 8


# ---------------------------------------------------------------- installs


def installed_version(venv: Path, client: str) -> str | None:
    """The client's version in its virtualenv, None when it (or the virtualenv) is not there."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    probe = f"import importlib.metadata as m; print(m.version({client!r}))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() if done.returncode == 0 else None


def ensure_client(client: str) -> Path:
    """The client's virtualenv with the pinned release in it; created or upgraded when it is not."""
    venv, pin = VENVS / client, PINS[client]
    if installed_version(venv, client) == pin:
        return venv
    log = VENVS / f"{client}-install.log"
    say(f"{client}: installing {client}=={pin} into {venv} (log {log}; minutes the first time)")
    VENVS.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        for argv in (
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", f"{client}=={pin}"],
        ):
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{client}: `{shlex.join(argv)}` failed; log ends: {log_tail(log)}")
    return venv


# ---------------------------------------------------------------- the stack


@contextmanager
def target(url: str | None, workdir: Path) -> Iterator[str]:
    """The base URL to measure: `url` as given, or a `conveyor up` started here and stopped after."""
    if url:
        yield url.rstrip("/")
        return
    with conveyor("conveyor", workdir) as system:
        yield system.base_url


def served_model(base_url: str) -> str:
    """The default generation model, as /v1/models names it (the first listed with that kind)."""
    models = httpx.get(f"{base_url}/v1/models", timeout=10.0).raise_for_status().json()["data"]
    return next(m["id"] for m in models if m.get("kind", "generation") == "generation")


def warm_up(base_url: str, model: str) -> None:
    """Two short completions, not counted: first forwards, and proof that /v1/completions answers."""
    body = {"model": model, "prompt": "Hello", "max_tokens": WARM_UP_TOKENS, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=120.0) as client:
        for _ in range(2):
            answer = client.post("/v1/completions", json=body)
            if answer.status_code != 200:
                raise RuntimeError(f"warm-up: POST /v1/completions: HTTP {answer.status_code}: {answer.text}")


# ---------------------------------------------------------------- one client run


def run_client(client: str, argv: list[str], log: Path, timeout_s: float) -> None:
    """Run one client to its end, its output in `log`; RuntimeError with the log's end if it failed.

    In its own session, as a server is (bench.systems): a client stopped on a timeout or by Ctrl-C
    takes its worker processes with it (guidellm's and aiperf's outlive a killed parent otherwise).
    """
    say(f"{client}: {shlex.join(argv)}")
    with server_process(client, argv, client_env(client, os.environ), log, stop_timeout_s=10.0) as process:
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{client}: still running after {timeout_s:.0f} s; see {log}") from None
    if code != 0:
        raise RuntimeError(f"{client}: exit code {code}; log ends: {log_tail(log)}")


def measure(
    client: str, venv: Path, work: Workload, concurrency: int, workdir: Path, timeout_s: float
) -> tuple[list[Row], dict[str, Any], list[str]]:
    """One client at one concurrency: its rows, its JSON, and the command line that produced them."""
    stem = workdir / f"{client}-c{concurrency}"
    if client == GUIDELLM:
        out = stem.with_suffix(".json")
        argv = guidellm_argv(venv, work, concurrency, out)
        run_client(client, argv, stem.with_suffix(".log"), timeout_s)
        doc = json.loads(out.read_text())
        return guidellm_rows(doc), doc, argv
    argv = aiperf_argv(venv, work, concurrency, stem)
    run_client(client, argv, workdir / f"{stem.name}.log", timeout_s)
    doc = json.loads((stem / "profile_export_aiperf.json").read_text())
    return [aiperf_row(doc)], doc, argv


def shown(argv: list[str]) -> str:
    """A command line as the report shows it: paths under the repository relative to it."""
    return shlex.join(a.replace(f"{ROOT}/", "") for a in argv)


# ---------------------------------------------------------------- main


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running stack's base URL (default: start one with SmolLM2)")
    parser.add_argument("--model", help="the model name to ask for (default: the stack's first)")
    parser.add_argument("--tokenizer", type=Path, default=MODEL_DIR, help="the model's local directory")
    parser.add_argument("--clients", type=client_list, default=(GUIDELLM, AIPERF), help="comma-separated")
    parser.add_argument("--requests", type=int, default=16, help="requests per client and concurrency")
    parser.add_argument("--concurrency", type=concurrency_list, default=(1, 8), help="levels, e.g. 1,8")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="per request")
    parser.add_argument("--run-timeout-s", type=float, default=900.0, help="per client run")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where clients.md goes")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.prompt_tokens < 1 or args.output_tokens < 1:
        parser.error("--requests, --prompt-tokens and --output-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if not (args.tokenizer / "tokenizer.json").exists():
        say(f"no tokenizer at {args.tokenizer}; run `.venv/bin/conveyor model pull` first")
        return 2
    terminate_on_sigterm()
    venvs = {client: ensure_client(client) for client in args.clients}  # before the stack: no load then
    workdir = Path(tempfile.mkdtemp(prefix="conveyor-clients-"))
    say(f"clients {', '.join(args.clients)}; outputs and logs in {workdir}")
    rows: list[Row] = []
    failures: list[str] = []
    commands: list[str] = []
    versions = {client: PINS[client] for client in args.clients}
    commit = git_commit()  # now: the code that runs, whatever is edited while it does
    load_before, started = os.getloadavg()[0], time.perf_counter()
    with target(args.url, workdir) as base_url:
        model = args.model or served_model(base_url)
        warm_up(base_url, model)
        work = Workload(
            base_url, model, args.tokenizer, args.requests, args.prompt_tokens, args.output_tokens,
            args.request_timeout_s,
        )  # fmt: skip
        for client in args.clients:
            for concurrency in args.concurrency:
                try:
                    found, doc, command = measure(
                        client, venvs[client], work, concurrency, workdir, args.run_timeout_s
                    )
                except (RuntimeError, OSError, KeyError, ValueError, StopIteration) as exc:
                    failures.append(f"{client} at concurrency {concurrency}: {type(exc).__name__}: {exc}")
                    say(failures[-1])
                    continue
                rows += found
                commands.append(shown(command))
                versions[client] = tool_version(client, doc) or versions[client]
                say("\n".join(table(found)[2:]))
    meta = {
        "command": shlex.join([".venv/bin/python", "-m", "bench.clients", *argv]),
        "model": model,
        "target": "a `conveyor up` stack started by the benchmark" if not args.url else args.url,
        "settings": {k: v for k, v in os.environ.items() if k.startswith("CONVEYOR_")},
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "requests": args.requests,
        "started": time.strftime("%Y-%m-%d %H:%M %Z"),
        "commit": commit,
        "cpus": os.cpu_count(),
        "versions": versions,
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "wall_s": time.perf_counter() - started,
        "commands": commands,
    }
    text = report(rows, meta, failures)
    print(text)
    write_results("clients", text, None, args.results)
    say(f"the clients' own outputs are in {workdir}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
