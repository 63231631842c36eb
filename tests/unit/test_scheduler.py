"""The step scheduler (`app.workers.engine`): the plans it makes for given queues, budgets and
sampled tokens, and what its block pool holds after. No torch, no Redis."""

from __future__ import annotations

import pytest

from app.partitions.digest import digests
from app.workers.engine.blocks import BlockPool
from app.workers.engine.scheduler import (
    Credit,
    Scheduler,
    SchedulerConfig,
    Seq,
    SeqState,
    StepPlan,
    drain,
)

REALTIME, NORMAL, BATCH = 0, 2, 3


def scheduler(
    num_blocks: int = 64, *, tokens: int = 2048, seqs: int = 16, block_size: int = 16, caching: bool = True
) -> Scheduler:
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        prefix_caching=caching,
    )
    return Scheduler(config)


def seq(
    seq_id: str,
    length: int,
    *,
    max_tokens: int = 8,
    rank: int = NORMAL,
    first: int | None = None,
    **kw: object,
) -> Seq:
    """A sequence of `length` consecutive ids from `first` (by default its own, shared with no other)."""
    if first is None:
        first = 1000 * sum(map(ord, seq_id))
    return Seq(seq_id, tuple(range(first, first + length)), max_tokens, rank=rank, **kw)  # type: ignore[arg-type]


def shape(plan: StepPlan) -> dict[str, tuple[int, int]]:
    """Each row as (start, tokens)."""
    return {r.seq_id: (r.start, len(r.tokens)) for r in plan.rows}


def step(s: Scheduler, token: int = 7) -> StepPlan:
    plan = s.schedule()
    s.update(plan, {r.seq_id: token for r in plan.rows if r.samples})
    return plan


# ---------------------------------------------------------------- states


def test_the_finished_states_are_final_and_name_their_reason() -> None:
    assert [s for s in SeqState if s.is_finished] == [
        SeqState.FINISHED_STOPPED,
        SeqState.FINISHED_LENGTH,
        SeqState.FINISHED_ABORTED,
    ]
    assert SeqState.FINISHED_LENGTH.finish_reason == "length"
    assert SeqState.PREEMPTED.finish_reason is None


# ---------------------------------------------------------------- prefill, chunks and decode


def test_a_prompt_within_the_budget_runs_whole_then_decodes_one_token_a_step() -> None:
    s = scheduler()
    s.add(seq("a", 10, max_tokens=3, first=0))
    first = s.schedule()
    assert first.decodes == () and shape(first) == {"a": (0, 10)}
    assert first.chunks[0].tokens == tuple(range(10)) and first.chunks[0].samples
    assert s.update(first, {"a": 100})[0].finish_reason is None
    second = s.schedule()
    assert [(r.seq_id, r.start, r.tokens) for r in second.decodes] == [("a", 10, (100,))]
    s.update(second, {"a": 101})
    third = s.schedule()
    outputs = s.update(third, {"a": 102})
    assert [(o.token, o.finish_reason) for o in outputs] == [(102, "length")]
    assert not s.has_work and s.pool.free_blocks == 64


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget_and_samples_only_at_its_end() -> None:
    s = scheduler(tokens=32)
    s.add(seq("a", 80))
    plans = [s.schedule()]
    for _ in range(2):
        s.update(plans[-1], {r.seq_id: 5 for r in plans[-1].rows if r.samples})
        plans.append(s.schedule())
    assert [shape(p)["a"] for p in plans] == [(0, 32), (32, 32), (64, 16)]
    assert [p.chunks[0].samples for p in plans] == [False, False, True]
    with pytest.raises(ValueError, match="the step samples"):
        s.update(plans[-1], {})  # the last chunk's token is missing


def test_the_budget_is_shared_in_arrival_order_and_the_rest_waits() -> None:
    s = scheduler(tokens=32)
    for name in "abc":
        s.add(seq(name, 20))
    first = step(s)
    assert shape(first) == {"a": (0, 20), "b": (0, 12)}
    second = step(s)
    assert shape(second) == {"a": (20, 1), "b": (12, 8), "c": (0, 20)}  # 1 + 8 + 20 <= 32
    assert [r.seq_id for r in second.decodes] == ["a"]


def test_no_more_sequences_run_than_max_num_seqs() -> None:
    s = scheduler(seqs=2)
    for name in "abc":
        s.add(seq(name, 4, max_tokens=2))
    assert set(shape(step(s))) == {"a", "b"}
    assert set(shape(step(s))) == {"a", "b"}  # a and b end here
    assert set(shape(s.schedule())) == {"c"}


def test_running_rows_are_never_delayed_by_a_long_prompt_more_than_one_chunk() -> None:
    s = scheduler(tokens=64)
    for name in "abcd":
        s.add(seq(name, 8, max_tokens=100))
    step(s)
    s.add(seq("long", 1000, max_tokens=1))
    for _ in range(5):
        plan = step(s)
        assert [r.seq_id for r in plan.decodes] == list("abcd")
        assert shape(plan)["long"][1] == 60  # the rest of the budget, one chunk a step


def test_waiting_sequences_are_taken_by_class_then_arrival() -> None:
    s = scheduler(seqs=1)
    s.add(seq("batch", 4, rank=BATCH, max_tokens=1))
    s.add(seq("normal", 4, rank=NORMAL, max_tokens=1))
    s.add(seq("realtime", 4, rank=REALTIME, max_tokens=1))
    s.add(seq("normal2", 4, rank=NORMAL, max_tokens=1))
    order = [next(iter(shape(p))) for p in drain(s, {n: [1] for n in s.sequences})]
    assert order == ["realtime", "normal", "normal2", "batch"]


# ---------------------------------------------------------------- preemption


def test_an_urgent_arrival_preempts_the_least_urgent_latest_running_sequence() -> None:
    s = scheduler(seqs=2)
    s.add(seq("n", 4, rank=NORMAL, max_tokens=50))
    s.add(seq("b1", 4, rank=BATCH, max_tokens=50))
    step(s)
    s.add(seq("b2", 4, rank=BATCH, max_tokens=50))  # no slot, same class as b1: waits
    assert set(shape(step(s))) == {"n", "b1"}
    s.add(seq("rt", 4, rank=REALTIME, max_tokens=50))
    plan = s.schedule()
    assert plan.preempted == ("b1",)
    assert set(shape(plan)) == {"n", "rt"} and shape(plan)["rt"] == (0, 4)
    assert s.sequences["b1"].state is SeqState.PREEMPTED and s.pool.table("b1") == ()


def test_an_arrival_of_the_same_class_waits_for_room_instead_of_preempting() -> None:
    s = scheduler(num_blocks=2, block_size=4, seqs=4)
    s.add(seq("a", 4, max_tokens=4))
    step(s)  # a holds 1 block, then 2 for its decode
    s.add(seq("b", 4, max_tokens=4))
    plan = step(s)
    assert plan.preempted == () and set(shape(plan)) == {"a"}


def test_when_blocks_run_out_the_latest_sequence_is_preempted_and_resumes_by_recomputing_its_outputs() -> (
    None
):
    s = scheduler(num_blocks=4, block_size=4, caching=False)
    s.add(seq("a", 4, max_tokens=6))
    s.add(seq("b", 4, max_tokens=6, first=50))
    tokens = iter(range(100, 200))
    plans = []
    while "b" in s.sequences and not any(p.preempted for p in plans):
        plan = s.schedule()
        plans.append(plan)
        s.update(plan, {r.seq_id: next(tokens) for r in plan.rows if r.samples})
    # a and b fill a block each with their prompts, the next with their next 4 ids; then a needs
    # a third block: b (arrived later) gives up its two, its fifth token not yet computed
    preempting = plans[-1]
    assert preempting.preempted == ("b",) and set(shape(preempting)) == {"a"}
    b = s.sequences["b"]
    assert b.state is SeqState.PREEMPTED and b.computed == 0 and len(b.output) == 5
    ids = b.ids
    resumed = next(p for p in iter(lambda: step(s, 9), None) if "b" in shape(p))
    row = next(r for r in resumed.rows if r.seq_id == "b")
    assert row.start == 0 and row.tokens == ids and row.samples  # prompt and outputs; then its last token
    assert b.state is SeqState.FINISHED_LENGTH and b.output[-1] == 9 and s.pool.free_blocks == 4


def test_a_preempted_sequence_resumes_from_its_cached_blocks() -> None:
    s = scheduler(num_blocks=6, block_size=4, seqs=2)
    s.add(seq("a", 8, max_tokens=8, rank=BATCH))
    step(s)
    step(s)  # a: 9 ids computed, its first two blocks cached
    s.add(seq("rt", 8, max_tokens=1, rank=REALTIME, first=100))
    s.add(seq("rt2", 8, max_tokens=1, rank=REALTIME, first=200))
    plan = s.schedule()
    assert plan.preempted == ("a",) and set(shape(plan)) == {"rt", "rt2"}
    s.update(plan, {"rt": 1, "rt2": 1})
    resumed = s.schedule()
    assert shape(resumed) == {"a": (8, 2)}  # its two whole blocks hit; the last prompt id and output run


def test_a_sequence_that_could_never_fit_is_refused() -> None:
    s = scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="more than the 2 blocks"):
        s.add(seq("a", 6, max_tokens=3))
    s.add(seq("b", 5, max_tokens=3))


# ---------------------------------------------------------------- prefix sharing


def test_a_prompt_starting_with_cached_whole_blocks_computes_only_the_rest() -> None:
    s = scheduler()
    s.add(seq("a", 40, max_tokens=1, first=0))
    step(s)
    assert s.pool.cached_blocks == 2
    s.add(Seq("b", tuple(range(32)) + (999,) * 5, 1))
    plan = s.schedule()
    assert shape(plan) == {"b": (32, 5)}
    assert plan.chunks[0].table[:2] == s.pool.table("b")[:2]


def test_a_prompt_of_whole_cached_blocks_still_runs_its_last_token() -> None:
    s = scheduler()
    s.add(seq("a", 32, max_tokens=1, first=0))
    step(s)
    s.add(seq("b", 32, max_tokens=1, first=0))
    assert shape(s.schedule()) == {"b": (16, 16)}


def test_a_sequence_that_computes_every_id_ignores_the_cached_blocks() -> None:
    s = scheduler()
    s.add(seq("a", 40, max_tokens=1, first=0))
    step(s)
    s.add(seq("b", 40, max_tokens=1, first=0, reuse=False))  # echo's logprobs need every position
    assert shape(s.schedule()) == {"b": (0, 40)}


def test_running_sequences_share_their_common_blocks() -> None:
    s = scheduler()
    s.add(seq("a", 40, max_tokens=10, first=0))
    step(s)
    s.add(seq("b", 40, max_tokens=10, first=0))
    step(s)
    shared = s.pool.table("a")[:2]
    assert s.pool.table("b")[:2] == shared and [s.pool.refs(i) for i in shared] == [2, 2]
    assert s.pool.table("a")[2] != s.pool.table("b")[2]


def test_the_pool_names_blocks_as_the_prefix_cache_does() -> None:
    pool = BlockPool(4, 16)
    ids = list(range(40))
    pool.grow("a", 40)
    pool.commit("a", ids, 40)
    assert set(pool._cached) == set(digests(ids, 2))
    assert pool.hits(ids + [1]) == list(pool.table("a")[:2])


def test_a_digest_whose_tokens_differ_is_a_miss() -> None:
    pool = BlockPool(4, 4)
    pool.grow("a", 8)
    pool.commit("a", [1, 2, 3, 4, 5], 5)
    block = pool.blocks[pool.table("a")[0]]
    block.tokens = (9, 9, 9, 9)  # as if another prefix had the same digest
    assert pool.hits([1, 2, 3, 4, 5]) == []


def test_finishing_frees_every_block_and_keeps_the_whole_ones_cached() -> None:
    s = scheduler(num_blocks=16, block_size=4)
    for name in "abc":
        s.add(seq(name, 9, max_tokens=4))
    drain(s, {n: [1, 2, 3, 4] for n in "abc"})
    assert s.pool.free_blocks == 16 and s.sequences == {}
    assert s.pool.cached_blocks == 3 * 3  # 12 ids computed each (9 + 3 outputs): 3 whole blocks


def test_blocks_holding_nothing_go_first_then_the_least_recently_freed_cached_ones() -> None:
    pool = BlockPool(4, 2)
    pool.grow("a", 4)  # blocks 0, 1
    pool.commit("a", [1, 2, 3, 4], 4)  # both cached
    pool.grow("b", 3)  # blocks 2, 3
    pool.commit("b", [5, 6, 7], 3)  # block 2 cached
    pool.free("a")  # its last block first: 1, then 0
    pool.free("b")  # 3 holds nothing worth keeping: it goes to the head
    assert pool.hits([1, 2, 3, 4, 5]) == [0, 1] and pool.hits([5, 6, 7]) == [2]
    pool.grow("c", 2)
    assert pool.table("c") == (3,)
    pool.grow("c", 4)
    assert pool.table("c") == (3, 1) and pool.hits([1, 2, 3, 4, 5]) == [0]  # a's tail went first
    pool.grow("c", 8)
    assert pool.table("c") == (3, 1, 0, 2) and pool.hits([5, 6, 7]) == []
    assert not pool.grow("c", 9) and pool.table("c") == (3, 1, 0, 2)


# ---------------------------------------------------------------- ending, aborting, credit


def test_a_stop_id_ends_a_sequence_before_max_tokens() -> None:
    s = scheduler()
    s.add(seq("b", 4, max_tokens=10, stop_ids=frozenset({2})))
    step(s, 5)
    plan = s.schedule()
    assert [(o.token, o.finish_reason) for o in s.update(plan, {"b": 2})] == [(2, "stop")]
    assert "b" not in s.sequences and s.pool.table("b") == ()


def test_an_aborted_sequence_frees_its_blocks_and_its_row_is_skipped() -> None:
    s = scheduler()
    s.add(seq("a", 4, max_tokens=10))
    s.add(seq("b", 4, max_tokens=10))
    plan = s.schedule()
    s.abort("a")
    assert [o.seq_id for o in s.update(plan, {"a": 1, "b": 1})] == ["b"]
    assert s.pool.table("a") == () and set(shape(s.schedule())) == {"b"}


def test_credit_counts_free_slots_and_blocks_not_spoken_for() -> None:
    s = scheduler(num_blocks=10, block_size=4, seqs=3)
    assert s.credit() == Credit(sequences=3, blocks=10)
    s.add(seq("a", 6, max_tokens=4))
    assert s.credit() == Credit(sequences=2, blocks=8)  # a's prompt and first token: 2 blocks promised
    step(s)
    assert s.credit() == Credit(sequences=2, blocks=8)  # a holds them now
    s.add(seq("b", 11, max_tokens=4))
    assert s.credit() == Credit(sequences=1, blocks=5)


def test_a_plan_must_be_updated_once_before_the_next() -> None:
    s = scheduler()
    s.add(seq("a", 4))
    plan = s.schedule()
    with pytest.raises(RuntimeError, match="not updated"):
        s.schedule()
    with pytest.raises(ValueError, match="the step samples"):
        s.update(plan, {"a": 1, "z": 1})
    s.update(plan, {"a": 1})
    with pytest.raises(ValueError, match="not the oldest step planned"):
        s.update(plan, {"a": 1})


def test_a_row_maps_its_positions_to_slots_of_its_blocks() -> None:
    s = scheduler(block_size=4)
    s.add(seq("a", 6, max_tokens=4))
    step(s)
    plan = s.schedule()
    row = plan.decodes[0]
    table = row.table
    assert row.slots(4) == [table[1] * 4 + 2] and row.writes(4) == (table[1],)
    s.update(plan, {"a": 1})


def test_a_config_whose_budget_cannot_hold_a_decode_row_per_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        SchedulerConfig(num_blocks=8, max_num_seqs=16, max_num_batched_tokens=8)


def test_under_random_load_the_budgets_hold_and_every_block_is_accounted_for() -> None:
    """Arrivals of every class with shared prefixes into a pool that forces preemptions: each plan
    keeps its budgets, each row's table covers it, and the blocks held are exactly the tables'."""
    import itertools
    import random

    rng = random.Random(7)
    s = scheduler(num_blocks=24, block_size=4, tokens=24, seqs=6)
    names = iter(range(10_000))
    finished: dict[str, int] = {}
    preempted = 0
    for _ in range(300):
        if rng.random() < 0.3:
            name = f"s{next(names)}"
            prompt = tuple(rng.choice([0, 1]) * 1000 + i for i in range(rng.randint(1, 30)))
            s.add(Seq(name, prompt, rng.randint(1, 12), rank=rng.randint(0, 3), stop_ids=frozenset({3})))
        if not s.has_work:
            continue
        plan = s.schedule()
        preempted += len(plan.preempted)
        assert plan.num_tokens <= 24 and len(plan) <= 6 and len({r.seq_id for r in plan.rows}) == len(plan)
        for row in plan.rows:
            assert (
                len(row.table) * 4 >= row.stop
                and row.tokens == s.sequences[row.seq_id].ids[row.start : row.stop]
            )
        outputs = s.update(plan, {r.seq_id: rng.randint(0, 50) for r in plan.rows if r.samples})
        finished.update({o.seq_id: 1 for o in outputs if o.finish_reason})
        held = [i for seq_id in s.sequences for i in s.pool.table(seq_id)]
        assert all(s.pool.refs(i) == held.count(i) for i in range(24))
        assert s.pool.free_blocks == 24 - len(set(held))
    assert len(finished) > 20 and preempted > 0
    drain(s, {seq_id: itertools.repeat(1) for seq_id in s.sequences}, steps=500)  # every one ends
    assert s.pool.free_blocks == 24


def test_an_urgent_arrival_that_would_not_fit_anyway_preempts_nobody() -> None:
    s = scheduler(num_blocks=6, block_size=4, seqs=4)
    s.add(seq("rt", 12, max_tokens=4, rank=REALTIME))  # 3 blocks
    s.add(seq("b", 4, max_tokens=4, rank=BATCH))  # 1 block
    step(s)
    s.add(seq("high", 16, max_tokens=1, rank=1))  # 4 blocks: the 2 free and b's 1 would not do
    plan = s.schedule()
    assert plan.preempted == () and set(shape(plan)) == {"rt", "b"}
    assert s.sequences["high"].state is SeqState.WAITING


# ---------------------------------------------------------------- plans in flight (pipelines)


def in_flight(depth: int, **kw: object) -> Scheduler:
    base = scheduler(**kw).config  # type: ignore[arg-type]
    return Scheduler(SchedulerConfig(**{**base.__dict__, "max_in_flight": depth}))


def test_a_sequence_in_a_plan_in_flight_is_in_no_plan_after_it_until_that_plan_is_updated() -> None:
    s = in_flight(2)
    for name in "ab":
        s.add(seq(name, 4))
    first = s.schedule(max_seqs=1)  # one micro-batch each
    second = s.schedule(max_seqs=1)
    assert set(shape(first)) == {"a"} and set(shape(second)) == {"b"}
    assert s.in_flight == 2 and s.idle_sequences == 0
    with pytest.raises(RuntimeError, match="not updated"):
        s.schedule()  # as many plans in flight as the pipeline has stages
    with pytest.raises(ValueError, match="oldest"):
        s.update(second, {"b": 1})  # plans come back in the order they left
    s.update(first, {"a": 1})
    third = s.schedule()
    assert [(r.seq_id, r.start) for r in third.decodes] == [("a", 4)]  # b is still in flight
    s.update(second, {"b": 2})
    s.update(third, {"a": 3})
    assert s.sequences["a"].output == [1, 3] and s.sequences["b"].output == [2]


def test_a_plan_with_nothing_to_run_is_not_in_flight() -> None:
    s = in_flight(2)
    s.add(seq("a", 4))
    s.schedule()
    empty = s.schedule()  # a is in flight: nothing else to run
    assert not empty.rows and s.in_flight == 1
    assert s.update(empty, {}) == []


def test_a_sequence_in_flight_is_never_preempted_the_one_planning_gives_way_instead() -> None:
    s = in_flight(2, num_blocks=2, block_size=4, caching=False)
    s.add(seq("a", 4, max_tokens=4))
    s.add(seq("b", 3, max_tokens=4, first=50))
    step(s)  # a and b a block each, their prompts computed
    first = s.schedule(max_seqs=1)  # a decodes into a second block: b is preempted, not in flight
    assert set(shape(first)) == {"a"} and first.preempted == ("b",)
    s.add(seq("c", 4, max_tokens=4, rank=REALTIME, first=90))  # urgent: a, in flight, is not its victim
    second = s.schedule()
    assert not second.rows and second.preempted == () and s.sequences["a"].state is SeqState.RUNNING
    s.update(first, {"a": 1})
    third = s.schedule()
    assert third.preempted == ("a",) and set(shape(third)) == {"c"}  # now it is


def test_an_aborted_sequence_in_flight_and_added_again_waits_for_that_plan() -> None:
    s = in_flight(2)
    s.add(seq("a", 4))
    first = s.schedule()
    s.abort("a")
    s.add(seq("a", 4))  # recovered and sent here again
    assert not s.schedule().rows
    assert s.update(first, {"a": 1}) == []  # the aborted sequence's row is skipped
    again = s.schedule()
    assert shape(again) == {"a": (0, 4)}
