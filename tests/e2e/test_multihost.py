"""Two hosts, one Redis: `conveyor up --only` splits a 2-stage pipeline across two homes.

Host A runs the api, the batcher and stage 0; host B runs stage 1. Each is its own `conveyor up`
with its own CONVEYOR_HOME, sharing the Redis (and namespace) the stage workers meet in. A greedy
job's tokens are `generate`'s; host B's worker killed mid-generation is restarted by B's own
supervisor and the job in flight completes, recovered, as on one host.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
from clients import events, submit, tokens, wait
from conftest import Stack, start_stack
from integration.test_generation import reference_tokens
from transformers import AutoModelForCausalLM, AutoTokenizer

# `--only` hosts sharing one Redis
pytestmark = pytest.mark.e2e

# A short stall timeout makes the test quick. The killed worker's heartbeat must then lapse sooner
# than the default 10 s: until it does, the monitor counts the dead worker as live and recovers the
# job into a pipeline that cannot run it yet, spending its attempts before the new worker is up.
ENV = {
    "CONVEYOR_TORCH_THREADS": "1",
    "CONVEYOR_STALL_TIMEOUT_S": "3",
    "CONVEYOR_HEARTBEAT_TTL_S": "2",
}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, redis_url, tiny_model) -> Iterator[tuple[Stack, Stack]]:  # type: ignore[no-untyped-def]
    common = {"redis_url": redis_url, "models": {"tiny": tiny_model}, "default_model": "tiny"}
    # B first: A's api is ready only once every stage, B's included, has a live worker.
    b = start_stack(
        tmp_path_factory.mktemp("host-b"),
        **common,
        extra_env=ENV,
        args=("--stages", "2", "--only", "stage:1"),
        wait_ready=False,
    )
    try:
        a = start_stack(
            tmp_path_factory.mktemp("host-a"),
            **common,
            extra_env=ENV,
            args=("--stages", "2", "--only", "api,batcher", "--only", "stage:0"),
            namespace=b.namespace,
        )
    except Exception:
        b.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


def children(host: Stack) -> dict[str, psutil.Process]:
    """The host's processes by what they run (`app.cli api`, `--stage 1`, ...)."""
    found = {}
    for proc in psutil.Process(host.process.pid).children():
        try:
            found[" ".join(proc.cmdline())] = proc
        except psutil.Error:
            continue
    return found


def stage_worker(host: Stack, stage: int) -> psutil.Process:
    matches = [p for line, p in children(host).items() if f"--stage {stage} " in f"{line} "]
    assert len(matches) == 1, f"{len(matches)} stage {stage} workers on this host"
    return matches[0]


def restarted(host: Stack, stage: int, old_pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if stage_worker(host, stage).pid != old_pid:
                return
        except AssertionError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"host's stage {stage} worker was not restarted")


def generate(model_dir, prompt: str, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """`generate`'s first n greedy tokens with no end-of-sequence token: as `ignore_eos` generates,
    the end-of-sequence token is a token like another (and the next one follows it)."""
    ids = AutoTokenizer.from_pretrained(model_dir)(prompt).input_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(ids) :].tolist()  # type: ignore[no-any-return]


def test_each_host_runs_only_its_part(hosts):  # type: ignore[no-untyped-def]
    a, b = hosts
    on_a, on_b = " | ".join(children(a)), " | ".join(children(b))
    assert "app.cli api" in on_a and "app.cli batcher" in on_a and "--stage 0" in on_a
    assert "--stage 1" not in on_a and "webhooks" not in on_a and "redis-server" not in on_a
    assert "--stage 1" in on_b
    assert "app.cli api" not in on_b and "batcher" not in on_b and "--stage 0" not in on_b


def test_a_greedy_job_across_two_hosts_equals_generate(hosts, tiny_model):  # type: ignore[no-untyped-def]
    a, _ = hosts
    prompt = "The quick brown fox jumps over the lazy dog."
    with a.client() as client:
        job = submit(client, prompt=prompt, max_tokens=24, temperature=0)
        stream = events(client, job["urls"]["events"])
    assert stream[-1].data["status"] == "succeeded", stream[-1].data
    assert [e.data["token_id"] for e in tokens(stream)] == reference_tokens(tiny_model, prompt, 24)


def test_host_bs_worker_killed_mid_generation_is_restarted_there_and_the_job_recovers(hosts, tiny_model):  # type: ignore[no-untyped-def]
    a, b = hosts
    prompt, n = "a job in flight when host B loses its worker", 300
    victim = stage_worker(b, 1)
    with a.client() as client:
        job = submit(client, prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True)
        assert len(events(client, job["urls"]["events"], max_tokens=5)) == 5  # mid-generation
        victim.send_signal(signal.SIGKILL)
        restarted(b, 1, victim.pid)
        final = wait(client, job["id"], timeout_s=180)
        stream = events(client, job["urls"]["events"])
    assert final["status"] == "succeeded", final.get("error")
    assert int(final["attempts"]) >= 1, "the job was not recovered: the kill came too late"
    got = tokens(stream)
    assert [e.data["index"] for e in got] == list(range(n)), "a gap or a duplicate in the stream"
    assert [e.data["token_id"] for e in got] == generate(tiny_model, prompt, n)
    assert "stage1 exited with code -9" in b.log.read_text()
    assert "restarting stage1" in b.log.read_text()
