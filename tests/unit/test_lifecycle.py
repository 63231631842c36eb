import pytest

from app.core.jobs import TERMINAL, TIMESTAMP_FIELD, TRANSITIONS, JobStatus, Transition, predecessors


def reachable(start: JobStatus) -> set[JobStatus]:
    seen, todo = set(), [start]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_terminal_states_have_no_way_out():
    assert all(not TRANSITIONS[s] for s in TERMINAL)
    assert all(s.is_finished for s in TERMINAL)


@pytest.mark.parametrize("status", [s for s in JobStatus if s not in TERMINAL])
def test_every_live_state_can_still_end(status):
    assert reachable(status) & TERMINAL


def test_recovery_path_of_the_design():
    assert JobStatus.RECOVERING in TRANSITIONS[JobStatus.RUNNING]
    assert JobStatus.SCHEDULED in TRANSITIONS[JobStatus.RECOVERING]
    assert JobStatus.SUCCEEDED not in TRANSITIONS[JobStatus.QUEUED]


def test_script_arguments_name_the_allowed_sources_and_stamp_the_time():
    move = Transition("j", JobStatus.SUCCEEDED, {"text": "hi"}).script_move(12.5)
    assert move["to"] == "succeeded"
    assert set(move["from"]) == set(predecessors(JobStatus.SUCCEEDED)) == {"running"}
    assert move["guard"] == {}
    assert move["fields"] == [TIMESTAMP_FIELD[JobStatus.SUCCEEDED], "12.5", "text", "hi"]
