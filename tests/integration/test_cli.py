"""`conveyor submit` against a running stack, as a user runs it: the job's end decides its exit status."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from clients import wait
from conftest import ROOT


def conveyor(stack, *args: str) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args, "--url", stack.url],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_submit_stream_of_a_job_cancelled_meanwhile_prints_its_status(stack):  # type: ignore[no-untyped-def]
    cli = conveyor(stack, "submit", "x", "--raw", "--stream", "--max-tokens", "480", "--ignore-eos")
    assert cli.stderr is not None
    first = cli.stderr.readline()  # "job <id>", written once the job is accepted
    assert first.startswith("job "), first
    job_id = first.split()[1]
    with stack.client() as client:
        deadline = time.monotonic() + 60
        # Printable text, not just a token: the tiny model's byte-level tokens may be whitespace, or
        # part of a UTF-8 sequence that is held back until it is whole.
        while not client.get(f"/v1/jobs/{job_id}").json()["text"].strip():
            assert time.monotonic() < deadline, "the job never generated printable text"
            time.sleep(0.05)
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        out, err = cli.communicate(timeout=60)
        assert wait(client, job_id)["status"] == "cancelled"
    assert cli.returncode == 3, err  # cancelled: documented in `conveyor submit --help`
    assert f"job {job_id} cancelled" in err and "Traceback" not in err
    assert out.strip(), "the tokens streamed before the cancel were printed"


def test_submit_stream_of_a_job_that_succeeds_exits_0(stack):  # type: ignore[no-untyped-def]
    cli = conveyor(stack, "submit", "Hello", "--raw", "--stream", "--max-tokens", "5", "--ignore-eos")
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    job_id = err.split()[1]
    with stack.client() as client:
        assert out == wait(client, job_id)["text"] + "\n"
