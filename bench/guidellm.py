"""guidellm, an independent client, against a system `bench.peers` started: the same model, 128 -> 64
tokens (`ignore_eos`), streamed `/v1/completions`, closed-loop streams, its own synthetic prompts
(a seed per concurrency: no prompt sent twice). Its requests become a `Run` as the suite's own
client's do; each request's mean inter-token latency stands for its gaps (guidellm keeps none).

Installed beside the project: docs/benchmarks.md, "Installing the peers".
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench.load import JobResult, Run
from bench.systems import MODEL_DIR, ROOT, System

GUIDELLM = ROOT / ".conveyor" / "bench-venvs" / "guidellm" / "bin" / "guidellm"
SUFFIX = " (guidellm)"  # its rows are the system's name and this


def guidellm_run(
    system: System, name: str, concurrency: int, count: int, *, prompt_tokens: int, output_tokens: int
) -> Run:
    """`count` requests from `concurrency` streams (it runs on the CPUs the caller's thread may use)."""
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp:
        out = Path(tmp) / "run.json"
        options = {
            "--backend": f"kind=openai_http,target={system.base_url},request_format=/v1/completions",
            "--profile": f"kind=concurrent,streams={concurrency}",
            "--data": f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--seed": f"kind=static,value={1000 + concurrency}",
            "--tokenizer": f"kind=huggingface_auto,model={MODEL_DIR}",
            "--constraint": f"kind=max_requests,count={count}",
            "--output": f"kind=json,path={out}",
        }
        command = [str(GUIDELLM), "run", *itertools.chain(*options.items()), "--disable-console"]
        before, quiet = os.getloadavg()[0], {**os.environ, "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}
        subprocess.run(command, check=True, cwd=tmp, stdout=subprocess.DEVNULL, env=quiet)
        (benchmark,) = json.loads(out.read_text())["benchmarks"]
    requests = benchmark["requests"]
    done, failed = requests["successful"], requests["errored"] + requests["incomplete"]
    jobs = [
        JobResult(
            prompt=i,
            ok=r["output_tokens"] == output_tokens,  # as the suite's client counts a request
            error=None if r["output_tokens"] == output_tokens else f"{r['output_tokens']} tokens",
            latency_s=r["request_latency"],
            ttft_s=r["time_to_first_token_ms"] / 1000,
            tokens=r["output_tokens"],
            gaps_s=[r["inter_token_latency_ms"] / 1000] * max(0, r["output_tokens"] - 1),
            submitted=r["request_start_time"],
        )
        for i, r in enumerate(done)
    ]
    jobs += [
        JobResult(prompt=-1, ok=False, latency_s=0.0, ttft_s=None, tokens=0, error=str(r.get("error")))
        for r in failed
    ]
    span = [(r["request_start_time"], r["request_end_time"]) for r in done] or [(0.0, 0.0)]
    wall_s = max(end for _, end in span) - min(start for start, _ in span)
    return Run(name + SUFFIX, jobs, wall_s=wall_s, load=(before, os.getloadavg()[0]), clients=concurrency)
