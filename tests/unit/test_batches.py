"""The batches one stage holds (`app.workers.batches`): one record per batch, kept consistent
through begin, resume (keep + absorb), joins and drop; stale batches; the join host choice."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tokenizer
from transformers import LlamaConfig

from app.core.protocol import StepMessage
from app.partitions.layers import BatchState
from app.workers.batches import Batches, BatchGone, Join
from app.workers.decode import Sequence
from app.workers.sampling import SamplingParams
from app.workers.textstream import TextStream

CONFIG = LlamaConfig(
    vocab_size=16,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)
TOKENIZER = make_tokenizer()
ROUTES: list[str | None] = ["lane-0", "lane-1"]


def state(seq_ids: list[str], length: int, marker: float = 0.0) -> BatchState:
    """A batch's state after a prefill of `length` positions; row i's keys hold `marker + i`."""
    made = BatchState(CONFIG, seq_ids, torch.ones(len(seq_ids), length, dtype=torch.long))
    with torch.inference_mode():
        for layer in made.slabs:
            keys = torch.stack([torch.full((1, length, 4), marker + i) for i in range(len(seq_ids))])
            layer.update(keys, keys.clone())
    return made


def row_markers(made: BatchState) -> list[float]:
    keys, _ = made.slabs[0]._views()
    return [float(k) for k in keys[:, 0, -1, 0]]


def sequences(batch_id: str, job_ids: list[str]) -> dict[str, Sequence]:
    return {
        j: Sequence(j, batch_id, SamplingParams(), torch.Generator(), 8, TextStream(TOKENIZER))
        for j in job_ids
    }


def last_stage_batch(batches: Batches, batch_id: str, rows: int, *, length: int = 4, routes=ROUTES) -> None:  # type: ignore[no-untyped-def]
    job_ids = [f"{batch_id}-{i}" for i in range(rows)]
    batches.begin(
        batch_id, state(job_ids, length), 0.0, routes=list(routes), sequences=sequences(batch_id, job_ids)
    )


def join(batch_id: str, rows: int) -> Join:
    message = StepMessage(
        batch_id=batch_id, model="m", stage=1, num_stages=2, kind="prefill", step=0, seq_ids=[]
    )
    return Join(message, [(f"{batch_id}-{i}", 7) for i in range(rows)])


def test_begin_holds_one_record_per_batch() -> None:
    batches = Batches()
    running = batches.begin("a", state(["x", "y"], 3), 5.0)
    assert len(batches) == 1 and "a" in batches and batches["a"] is running and batches.get("b") is None
    assert running.state.batch_ids == {"a"} and running.touched == 5.0
    assert running.routes is None and not running.sequences and not running.joins and not running.prefilling


def test_resume_keeps_the_running_rows_absorbs_the_joiners_and_forgets_them() -> None:
    batches = Batches()
    batches.begin("a", state(["x", "y", "z"], 3, marker=0.0), 0.0)
    batches.begin("b", state(["u", "v"], 5, marker=10.0), 0.0)

    merged = batches.resume("a", ["b"], ["x", "z", "v"])  # y and u finished

    assert merged is batches["a"].state and len(batches) == 1 and "b" not in batches
    assert merged.seq_ids == ["x", "z", "v"] and merged.batch_ids == {"a", "b"}
    assert row_markers(merged) == [0.0, 2.0, 11.0]  # each row's cache followed it
    assert merged.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1]] * 2 + [[1] * 6]  # padded, one new step


def test_a_step_for_a_batch_not_held_is_gone_and_changes_nothing() -> None:
    batches = Batches()
    batches.begin("a", state(["x"], 2), 0.0)
    with pytest.raises(BatchGone, match="b"):
        batches.resume("a", ["b"], ["x"])
    assert len(batches) == 1 and batches["a"].state.length == 2


def test_rows_out_of_step_with_the_message_raise() -> None:
    batches = Batches()
    batches.begin("a", state(["x", "y"], 2), 0.0)
    with pytest.raises(RuntimeError, match="out of step"):
        batches.resume("a", [], ["x", "w"])  # w is in no batch held here


def test_drop_forgets_the_batch_and_hands_back_its_waiting_joiners() -> None:
    batches = Batches()
    last_stage_batch(batches, "host", 2)
    last_stage_batch(batches, "joiner", 1)
    batches.park("host", join("joiner", 1))
    waiting = batches.drop("host")
    assert [j.msg.batch_id for j in waiting] == ["joiner"]
    assert "host" not in batches and "joiner" in batches and len(batches) == 1
    assert batches.drop("host") == []  # already gone: nothing


def test_take_joins_moves_the_joiners_sequences_to_the_host() -> None:
    batches = Batches()
    last_stage_batch(batches, "host", 2)
    last_stage_batch(batches, "joiner", 1)
    batches.park("host", join("joiner", 1))
    assert batches["host"].size() == 3

    taken = batches.take_joins("host")

    assert [j.msg.batch_id for j in taken] == ["joiner"] and not batches["host"].joins
    assert sorted(batches["host"].sequences) == ["host-0", "host-1", "joiner-0"]
    joiner = batches["joiner"]
    assert joiner.routes is None and not joiner.sequences  # no longer a host; its rows wait for resume
    assert batches.host_for("new", ROUTES, 1, 1, max_running=64, max_kv_positions=10**6) == "host"


def test_stale_batches_are_the_ones_not_stepped_for_long() -> None:
    batches = Batches()
    batches.begin("old", state(["x"], 2), 0.0)
    batches.begin("recent", state(["y"], 2), 0.0)
    batches.touch("recent", 100.0)
    batches.touch("unknown", 100.0)  # a step for a batch not held records nothing
    assert batches.stale(130.0, 120.0) == [("old", 130.0)]
    assert batches.stale(100.0, 120.0) == []
    assert "unknown" not in batches


def test_a_batch_joins_another_only_when_the_pipeline_stays_full() -> None:
    """A pipeline of N stages needs N batches circulating: with fewer others running, no join."""
    batches = Batches()
    last_stage_batch(batches, "a", 3)
    assert batches.host_for("new", ROUTES, 2, 1, max_running=64, max_kv_positions=10**6) is None
    last_stage_batch(batches, "b", 2)
    assert batches.host_for("new", ROUTES, 2, 1, max_running=64, max_kv_positions=10**6) == "b"  # the smaller


def test_a_host_runs_on_the_same_replicas_is_not_prefilling_and_is_not_waiting_itself() -> None:
    batches = Batches()
    last_stage_batch(batches, "elsewhere", 1, routes=["lane-0", "lane-9"])
    last_stage_batch(batches, "prefilling", 1)
    batches["prefilling"].prefilling = True
    last_stage_batch(batches, "host", 3)
    last_stage_batch(batches, "waiting", 1)
    batches.park("host", join("waiting", 1))
    batches.begin("other-stage", state(["q"], 2), 0.0)  # no routes: not a last-stage batch
    assert batches.host_for("new", ROUTES, 1, 1, max_running=64, max_kv_positions=10**6) == "host"
    batches["prefilling"].prefilling = False
    assert batches.host_for("new", ROUTES, 1, 1, max_running=64, max_kv_positions=10**6) == "prefilling"
    assert batches.host_for("host", ROUTES, 1, 1, max_running=64, max_kv_positions=10**6) == "prefilling"


def test_a_join_needs_room_in_rows_and_in_kv_positions() -> None:
    batches = Batches()
    last_stage_batch(batches, "host", 3, length=4)
    last_stage_batch(batches, "waiting", 1, length=9)
    batches.park("host", join("waiting", 1))
    batches.begin("new", state(["n0", "n1"], 6), 0.0)
    # Rows: 3 running + 1 waiting + 2 new; positions: padded to the longest (9) plus the next step.
    assert batches.merged_positions("host", "new", 6) == 6 * 10
    assert batches.host_for("new", ROUTES, 1, 2, max_running=6, max_kv_positions=60) == "host"
    assert batches.host_for("new", ROUTES, 1, 2, max_running=5, max_kv_positions=60) is None
    assert batches.host_for("new", ROUTES, 1, 2, max_running=6, max_kv_positions=59) is None
