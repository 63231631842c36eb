"""Every system a benchmark starts and stops, and the processes under them.

    conveyor            `python -m app.cli up` with this run's own namespace, ports and home, a model
                        (`Model`: SmolLM2 or the tests' tiny random Llama) and settings over them
    naive server        bench/naive_server.py under uvicorn: `model.generate` one request at a time
    ray serve           bench/rayserve_app.py: one replica, `@serve.batch` around `generate`
    vllm, llama.cpp     the peers, in .conveyor/bench-venvs (docs/benchmarks.md: installing them)
    redis               an embedded redis-server of its own (app.core.redis.start_embedded)

Each is a context manager that yields a `System` (name, base URL, log, process) once it answers,
and on the way out stops it and whatever it started: a server runs in its own session with its
output in a log file, gets SIGTERM, then SIGKILL after a timeout, and its leftover descendants are
killed. A system that does not come up raises RuntimeError with the end of its log, reported in
place of its figures. `terminate_on_sigterm` makes SIGTERM unwind like Ctrl-C. Unlike the tests'
`start_stack`, a benchmark passes the user's CONVEYOR_* settings through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.core.cpus import allowed, format_cpus
from bench.load import Job, conveyor_job, load_client, naive_job
from bench.prompts import Prompt

ROOT = Path(__file__).resolve().parent.parent  # the repository root: servers run there
MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_DIR = ROOT / ".conveyor" / "models" / MODEL_NAME
VLLM_VENV = ROOT / ".conveyor" / "bench-venvs" / "vllm"
LLAMA_CPP = ROOT / ".conveyor" / "bench-venvs" / "llama.cpp"  # llama-server and the model as a bf16 GGUF
READY_TIMEOUT_S = 300.0
LOG_TAIL_LINES = 6


def say(line: str) -> None:
    """A progress line on stderr (stdout is for the results)."""
    print(f"[bench] {line}", file=sys.stderr, flush=True)


def terminate_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` stops the servers it started."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


@dataclass(frozen=True)
class Model:
    name: str
    path: Path

    def env(self) -> dict[str, str]:
        return {
            "CONVEYOR_MODELS": json.dumps({self.name: str(self.path)}),
            "CONVEYOR_DEFAULT_MODEL": self.name,
        }


def smollm2() -> Model:
    return Model(MODEL_NAME, MODEL_DIR)


def tiny(workdir: Path) -> Model:
    """The tests' tiny random Llama (tests/tiny.py): the stack's machinery without the model's cost."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import make_tiny_model

    return Model("tiny", make_tiny_model(workdir / "tiny-model", context=2048))


def chosen_model(name: str, workdir: Path) -> Model | None:
    """`tiny` (made in `workdir`) or SmolLM2; None, said, when SmolLM2 has not been pulled yet."""
    model = tiny(workdir) if name == "tiny" else smollm2()
    if not (model.path / "config.json").exists():
        say(f"no model at {model.path}; run `.venv/bin/conveyor model pull` first")
        return None
    return model


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def consecutive_ports(n: int) -> int:
    """The first of `n` consecutive free ports (`conveyor up` numbers its children's metrics ports)."""
    for _ in range(100):
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def stop(name: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    if process.poll() is not None:
        say(f"{name}: had already exited with code {process.returncode}")
        return
    descendants = child_pids(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout_s)
        say(f"{name}: stopped (exit code {code})")
    except subprocess.TimeoutExpired:
        say(f"{name}: did not stop within {timeout_s:.0f} s; killing it and its children")
        process.kill()
        process.wait()
    for pid in descendants:  # normally already gone: `up` stops its own children
        kill_pid(pid)


def child_pids(pid: int) -> list[int]:
    """Every descendant of `pid` (Linux /proc), so that nothing a killed parent started outlives us."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    say(f"killed leftover process {pid}")


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float, log_path: Path) -> None:
    """Poll `url` until it answers 200; RuntimeError if the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"exited with code {process.returncode} before ready; see {log_path}")
            try:
                answer = client.get(url)
                if answer.status_code == 200:
                    return
                last = f"{answer.status_code} {answer.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s (last: {last}); see {log_path}")


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last non-empty lines of a log, for a reason why a system did not come up."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    kept = [line.strip()[:200] for line in text if line.strip()][-lines:]
    return " | ".join(kept)[-1200:]


def fresh_log(workdir: Path, name: str) -> Path:
    """`name.log` (spaces as dashes), or `name-2.log` and so on when the system was started before."""
    stem, n = re.sub(r"[^\w.-]+", "-", name).strip("-"), 1
    while (workdir / f"{stem}{'' if n == 1 else f'-{n}'}.log").exists():
        n += 1
    return workdir / f"{stem}{'' if n == 1 else f'-{n}'}.log"


@contextmanager
def started(
    name: str,
    argv: list[str],
    env: Mapping[str, str],
    log: Path,
    ready_url: str | None,
    *,
    stop_timeout_s: float,
    ready_timeout_s: float = READY_TIMEOUT_S,
    cwd: Path = ROOT,
) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` run in `cwd` (a `python -m` there imports that tree's code) in a session of its own, its
    output in `log`, once `ready_url` answers 200 (at once when None); a start that fails raises
    RuntimeError with the end of its log. On the way out: SIGTERM, SIGKILL after `stop_timeout_s`."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        say(f"{name}: started pid {process.pid}, log {log}")
        try:
            began = time.perf_counter()
            if ready_url is not None:
                try:
                    wait_ready(ready_url, process, ready_timeout_s, log)
                except RuntimeError as exc:
                    tail = log_tail(log)
                    raise RuntimeError(f"{name}: {exc}" + (f"; log ends: {tail}" if tail else "")) from exc
                say(f"{name}: ready after {time.perf_counter() - began:.1f} s")
            yield process
        finally:
            stop(name, process, stop_timeout_s)


@dataclass(frozen=True)
class System:
    """A running system: where to reach it and what its jobs are."""

    name: str
    base_url: str
    log: Path
    make: Callable[..., Job] = conveyor_job  # a job client for n tokens (Conveyor's: and a priority)
    process: subprocess.Popen[bytes] | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # Conveyor: CONVEYOR_* and REDIS_URL it saw
    model: str = MODEL_NAME  # the name it serves the model by

    @property
    def namespace(self) -> str:
        return self.env.get("CONVEYOR_NAMESPACE", "")


def conveyor_env(api_port: int, workdir: Path) -> dict[str, str]:
    """The user's environment (REDIS_URL and any CONVEYOR_* pass through) plus this run's own stack."""
    env = dict(os.environ)
    env.update(
        CONVEYOR_FLOWER_PORT="0",  # no Flower
        CONVEYOR_API_PORT=str(api_port),
        CONVEYOR_NAMESPACE=f"bench-{secrets.token_hex(4)}",
        CONVEYOR_EMBEDDED_REDIS_PORT=str(free_port()),
        # Its own home: the embedded Redis keeps its data away from a developer's .conveyor/redis.
        CONVEYOR_HOME=str(workdir / "home"),
        CONVEYOR_EMBEDDING_STAGES="0",  # only the generation pipeline is measured
    )
    env.setdefault("CONVEYOR_AUTH", "none")  # the load clients send no credential (loopback only)
    return env


@contextmanager
def conveyor(
    name: str,
    workdir: Path,
    settings: Mapping[str, str] | None = None,
    *,
    model: Model | None = None,
    cwd: Path = ROOT,
) -> Iterator[System]:
    """`conveyor up` run in `cwd` (bench.ab: an earlier commit's tree) with this run's own namespace,
    ports and home (`conveyor_env`), the model (SmolLM2 unless given) and `settings` over them; its
    home is removed afterwards."""
    model, port = model or smollm2(), free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**conveyor_env(port, workdir), **model.env(), **(settings or {})}
    base, log = f"http://127.0.0.1:{port}", fresh_log(workdir, name)
    argv = [sys.executable, "-m", "app.cli", "up"]
    try:
        with started(name, argv, env, log, f"{base}/readyz", stop_timeout_s=60.0, cwd=cwd) as process:
            used = {k: v for k, v in env.items() if k.startswith("CONVEYOR_") or k == "REDIS_URL"}
            yield System(name, base, log, process=process, env=used, model=model.name)
    finally:
        shutil.rmtree(env["CONVEYOR_HOME"], ignore_errors=True)


@contextmanager
def naive(workdir: Path, model: Model | None = None) -> Iterator[System]:
    """bench/naive_server.py under uvicorn; stopped with requests still queued, it does not serve them."""
    model, port = model or smollm2(), free_port()
    env = {**os.environ, "BENCH_MODEL_PATH": str(model.path)}
    argv = [
        sys.executable, "-m", "uvicorn", "--factory", "bench.naive_server:app_from_env",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
        "--timeout-graceful-shutdown", "1",
    ]  # fmt: skip
    base, log = f"http://127.0.0.1:{port}", fresh_log(workdir, "naive-server")
    with started("naive server", argv, env, log, f"{base}/healthz", stop_timeout_s=5.0) as process:
        yield System("naive server", base, log, naive_job, process=process, model=model.name)


@contextmanager
def ray_serve(workdir: Path, model: Model | None = None) -> Iterator[System]:
    """bench/rayserve_app.py in its own process (Ray's own processes are its children)."""
    try:
        import ray  # noqa: F401  (only whether the `bench` extra is installed)
    except ImportError as exc:
        raise RuntimeError(f"ray serve: Ray is not installed ({exc}); pip install -e '.[bench]'") from exc
    from bench.rayserve_app import batch_sizes, describe

    model, port = model or smollm2(), free_port()
    argv = [sys.executable, "-m", "bench.rayserve_app", "--model", str(model.path), "--port", str(port)]
    base, log = f"http://127.0.0.1:{port}", fresh_log(workdir, "ray-serve")
    with started("ray serve", argv, os.environ, log, f"{base}/healthz", stop_timeout_s=30.0) as process:
        try:
            yield System("ray serve", base, log, naive_job, process=process, model=model.name)
        finally:  # what `@serve.batch` formed, not what it may form (max 32)
            say(f"ray serve: {describe(batch_sizes(log.read_text(errors='replace')))}")


@contextmanager
def vllm(
    workdir: Path, model: Model | None = None, name: str = "vllm", both_cores: bool = False
) -> Iterator[System]:
    """vLLM's OpenAI server from its virtualenv (docs/benchmarks.md, "Installing the peers")."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"vLLM is not installed in {VLLM_VENV}: see docs/benchmarks.md")
    model, port = model or smollm2(), free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if both_cores:  # its model's threads on every core, none kept for its servers
        env["VLLM_CPU_OMP_THREADS_BIND"] = format_cpus(allowed())
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model.path), "--served-model-name", model.name,
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    base, log = f"http://127.0.0.1:{port}", fresh_log(workdir, name)
    # vLLM compiles its model at start-up
    with started(name, argv, env, log, f"{base}/health", stop_timeout_s=60.0, ready_timeout_s=600.0) as p:
        yield System(name, base, log, process=p, model=model.name)


@contextmanager
def llama_cpp(workdir: Path) -> Iterator[System]:
    """llama.cpp's `llama-server` on every core this process may use, SmolLM2 as a bf16 GGUF, 64
    slots of 512 positions (docs/benchmarks.md, "Installing the peers", says how to build both)."""
    server, gguf = LLAMA_CPP / "llama-server", LLAMA_CPP / f"{MODEL_NAME}-bf16.gguf"
    if not (server.exists() and gguf.exists()):
        raise RuntimeError(f"llama.cpp is not built into {LLAMA_CPP}: see docs/benchmarks.md")
    port, threads = free_port(), str(len(allowed()))
    argv = [str(server), "-m", str(gguf), "--alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", threads, "-tb", threads, "-np", "64", "-c", str(64 * 512)]
    base, log = f"http://127.0.0.1:{port}", fresh_log(workdir, "llama.cpp")
    env = {**os.environ, "LD_LIBRARY_PATH": str(LLAMA_CPP)}  # its libraries, copied beside it
    with started("llama.cpp", argv, env, log, f"{base}/health", stop_timeout_s=30.0) as p:
        yield System("llama.cpp", base, log, process=p, model=MODEL_NAME)


def vllm_version() -> str:
    found = sorted((VLLM_VENV / "lib").glob("python3*/site-packages/vllm_cpu-*.dist-info"))
    return found[0].name.removeprefix("vllm_cpu-").removesuffix(".dist-info") if found else "unknown"


@contextmanager
def redis_server(workdir: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """An embedded Redis of its own (the bundled redis-server, a random password): its URL and process."""
    from app.core.redis import start_embedded

    process, url = start_embedded(
        workdir / f"redis-{secrets.token_hex(2)}",
        free_port(),
        password=secrets.token_hex(16),
    )
    try:
        yield url, process
    finally:
        process.terminate()
        process.wait(10)


WARM_UP_PROMPTS = 4  # the prompts `warm_up` sends: its first ones


def warm_up(system: System, prompts: Sequence[Prompt], job: Job | None = None) -> None:
    """Two jobs one after the other, then four at once (8 tokens unless `job` is given): first
    forwards, thread pools and batch shapes, not counted."""
    job = job or system.make(8)

    async def run() -> None:
        async with load_client(system.base_url, WARM_UP_PROMPTS) as client:
            for prompt in prompts[:2]:
                result = await job(client, prompt)
                if not result.ok:
                    say(f"{system.name}: warm-up job failed: {result.error}")
            await asyncio.gather(*(job(client, p) for p in prompts[:WARM_UP_PROMPTS]))

    asyncio.run(run())
