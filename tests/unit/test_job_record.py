"""The typed job record and the job store's scripts, without Redis: the hash a record writes is the
one the API has always written (a rolling upgrade reads both ways), and the states each script may
move a job from come from the transition table."""

from __future__ import annotations

import json
import re

from app.core import jobscripts as scripts
from app.core.jobrecord import JobRecord, JobRequest
from app.core.jobs import FINAL_EVENT, FINAL_EVENTS, TERMINAL, TRANSITIONS, WAITING, JobStatus
from app.core.sampling import SamplingParams
from app.webhooks.events import FAILED_EVENTS

REQUEST = JobRequest(
    max_tokens=16,
    sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=7),
    stop=("\n\n",),
    ignore_eos=False,
    min_tokens=2,
)


def queued(**extra: object) -> JobRecord:
    fields: dict = dict(
        id="j1",
        status=JobStatus.QUEUED,
        model="tiny",
        tenant="acme",
        priority="high",
        created_at=1764800000.125,
        request=REQUEST,
        prompt_ids=(1, 2, 3),
        prompt_tokens=3,
        completion_tokens=0,
        text="",
        attempts=0,
    )
    return JobRecord(**{**fields, **extra})


def test_a_submitted_job_writes_the_hash_the_api_always_wrote() -> None:
    record = queued(route="auto", route_reason="short", deadline=1764800030.5)
    record = JobRecord(
        **{**record.__dict__, "callback_url": "https://hooks.example/x", "callback_events": ("completed",)}
    )
    params = {"max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 7}
    params |= {"stop": ["\n\n"], "ignore_eos": False, "min_tokens": 2}
    assert record.to_hash() == {
        "id": "j1",
        "status": "queued",
        "model": "tiny",
        "tenant": "acme",
        "priority": "high",
        "created_at": "1764800000.125",
        "request": json.dumps(params),
        "prompt_ids": "[1, 2, 3]",
        "prompt_tokens": "3",
        "completion_tokens": "0",
        "text": "",
        "attempts": "0",
        "route": "auto",
        "route_reason": "short",
        "deadline": "1764800030.5",
        "callback_url": "https://hooks.example/x",
        "callback_events": '["completed"]',
    }
    assert list(record.to_hash())[:6] == ["id", "status", "model", "tenant", "priority", "created_at"]


def test_an_embeddings_job_writes_its_texts_and_no_generation_fields() -> None:
    record = JobRecord(
        id="e1",
        status=JobStatus.QUEUED,
        model="minilm",
        tenant="acme",
        kind="embedding",
        priority="normal",
        created_at=2.5,
        input=("a", "b"),
    )
    assert record.to_hash() == {
        "id": "e1",
        "status": "queued",
        "model": "minilm",
        "tenant": "acme",
        "kind": "embedding",
        "priority": "normal",
        "created_at": "2.5",
        "input": '["a", "b"]',
    }


def test_a_hash_as_the_scripts_leave_it_reads_back_and_round_trips() -> None:
    written = queued().to_hash()
    del written["prompt_ids"]  # an ended job's inputs are dropped
    written |= {"status": "failed", "batch_id": "b1", "batch_size": "4", "scheduled_at": "3.25"}
    written |= {"started_at": "3.5", "first_token_at": "3.75", "finished_at": "4.0", "attempts": "1"}
    written |= {"error": '{"code":"worker_error","message":"boom"}', "completion_tokens": "5"}
    written |= {"text": "hello", "from_a_newer_version": "kept"}
    raw = {k.encode(): v.encode() for k, v in written.items()}
    record = JobRecord.from_hash(raw)
    assert record.status is JobStatus.FAILED and record.prompt_ids is None
    assert record.error == {"code": "worker_error", "message": "boom"}
    assert (record.batch_size, record.finished_at, record.request) == (4, 4.0, REQUEST)
    assert record.other == {"from_a_newer_version": "kept"}
    assert record.to_hash() == written
    assert JobRecord.from_hash(record.to_hash()) == record


def test_a_request_written_before_min_tokens_existed_reads_with_defaults() -> None:
    old = json.dumps({"max_tokens": 8, "temperature": 0, "top_p": 1.0, "top_k": 0})
    assert JobRequest.from_json(old) == JobRequest(max_tokens=8, sampling=SamplingParams(temperature=0))


def lua_set(script: str, name: str) -> set[str]:
    """The statuses of a Lua set literal assigned to `name` in a script."""
    names = re.findall(r"local ([\w, ]+) = (\{.*)", script)
    for targets, values in names:
        tables = re.findall(r"\{([^}]*)\}", values)
        for target, table in zip([t.strip() for t in targets.split(",")], tables, strict=False):
            if target == name:
                return set(re.findall(r"\['(\w+)'\] = true", table))
    raise AssertionError(f"no set {name} in the script")


def sources(target: JobStatus) -> set[str]:
    return {str(s) for s, targets in TRANSITIONS.items() if target in targets}


def test_the_scripts_move_jobs_only_from_states_the_table_allows() -> None:
    assert lua_set(scripts.STEP_LUA, "streaming") == sources(JobStatus.SUCCEEDED) == {"running"}
    assert lua_set(scripts.STEP_LUA, "live") == {str(s) for s in JobStatus if s not in TERMINAL}
    recoverable = lua_set(scripts.RECOVER_LUA, "recoverable")
    both = sources(JobStatus.RECOVERING) & sources(JobStatus.FAILED)
    assert recoverable == both == {"scheduled", "running"}
    # A job counts in its tenant's waiting set exactly while it waits in an intake stream.
    assert lua_set(scripts.WAITING_FUNCTION, "waiting_states") == {str(s) for s in WAITING}
    assert {str(s) for s in WAITING} == {"queued", "recovering"}
    # Every lifecycle name in the scripts' templates was filled in.
    for script in (scripts.STEP_LUA, scripts.RECOVER_LUA, scripts.END_LUA, scripts.ADMIT_LUA):
        assert "$" not in script
    for script in (
        scripts.TRANSITION_LUA,
        scripts.END_LUA,
        scripts.RECOVER_LUA,
        scripts.ADMIT_LUA,
    ):
        assert scripts.WAITING_FUNCTION in script  # each may move a job into or out of WAITING


def test_one_final_event_per_final_status() -> None:
    assert set(FINAL_EVENT) == TERMINAL
    assert len(FINAL_EVENTS) == len(TERMINAL)
    assert FAILED_EVENTS == FINAL_EVENTS - {FINAL_EVENT[JobStatus.SUCCEEDED]}
    assert f"'event', '{FINAL_EVENT[JobStatus.SUCCEEDED]}'" in scripts.STEP_LUA
    assert f"'event', '{FINAL_EVENT[JobStatus.FAILED]}'" in scripts.RECOVER_LUA
