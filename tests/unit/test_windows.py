from app.batching.windows import (
    Item,
    Limits,
    batch_reserve,
    expired,
    length_bucket,
    next_deadline,
    plan,
    within_tokens,
)

LIMITS = Limits(max_batch_size=4, max_wait_s=0.05, length_buckets=(64, 128, 256))


def item(i: int, *, tokens: int = 10, priority: int = 2, arrived: float = 0.0, model: str = "m") -> Item:
    return Item(job_id=f"j{i}", model=model, prompt_tokens=tokens, priority=priority, arrived=arrived)


def ids(batches):  # type: ignore[no-untyped-def]
    return [[it.job_id for it in b.items] for b in batches]


def test_length_bucket_bounds_and_overflow():
    assert length_bucket(1, LIMITS.length_buckets) == 64
    assert length_bucket(64, LIMITS.length_buckets) == 64
    assert length_bucket(65, LIMITS.length_buckets) == 128
    assert length_bucket(300, LIMITS.length_buckets) == 512


def test_idle_pipeline_gets_work_at_once():
    batches = plan([item(0)], inflight={"m": 0}, capacity={"m": 2}, limits=LIMITS, now=0.0)
    assert ids(batches) == [["j0"]]


def test_busy_pipeline_waits_for_the_window_or_a_full_batch():
    pending = [item(0), item(1)]
    assert plan(pending, inflight={"m": 1}, capacity={"m": 2}, limits=LIMITS, now=0.01) == []
    assert ids(plan(pending, inflight={"m": 1}, capacity={"m": 2}, limits=LIMITS, now=0.05)) == [["j0", "j1"]]
    full = [item(i) for i in range(5)]
    assert ids(plan(full, inflight={"m": 1}, capacity={"m": 2}, limits=LIMITS, now=0.0)) == [
        ["j0", "j1", "j2", "j3"]
    ]


def test_no_dispatch_beyond_capacity():
    pending = [item(i, arrived=0.0) for i in range(12)]
    assert plan(pending, inflight={"m": 2}, capacity={"m": 2}, limits=LIMITS, now=1.0) == []
    assert len(plan(pending, inflight={"m": 0}, capacity={"m": 2}, limits=LIMITS, now=1.0)) == 2


def test_high_priority_is_served_first_and_leads_its_batch():
    pending = [
        item(0, priority=2, arrived=0.0),
        item(1, priority=1, arrived=0.01),
        item(2, priority=0, arrived=0.02),
    ]
    batches = plan(pending, inflight={"m": 0}, capacity={"m": 1}, limits=Limits(2, 0.05, (64,)), now=0.1)
    assert ids(batches) == [["j2", "j1"]]


def test_buckets_separate_prompt_lengths_and_models():
    pending = [item(0, tokens=10), item(1, tokens=200), item(2, tokens=12, model="other")]
    batches = plan(pending, inflight={}, capacity={"m": 3, "other": 1}, limits=LIMITS, now=1.0)
    assert sorted(ids(batches)) == [["j0"], ["j1"], ["j2"]]
    assert {(b.model, b.bucket) for b in batches} == {("m", 64), ("m", 256), ("other", 64)}


def test_next_deadline_is_the_oldest_window():
    assert next_deadline([], LIMITS) is None
    assert next_deadline([item(0, arrived=1.0), item(1, arrived=0.5)], LIMITS) == 0.55


def test_aging_lifts_a_waiting_job_one_class_per_aging_period():
    limits = Limits(1, 0.0, (64,), aging_s=10.0)
    old_normal = item(0, priority=2, arrived=0.0)
    new_realtime = item(1, priority=0, arrived=15.0)
    # At t=16 the normal job has aged 1.6 classes (2 -> 0.4): the fresh realtime job still wins.
    assert ids(plan([old_normal, new_realtime], inflight={}, capacity={"m": 1}, limits=limits, now=16.0)) == [
        ["j1"]
    ]
    # From 2 x aging_s on, it ranks as realtime and its earlier arrival puts it first: it cannot starve
    # (the realtime job still goes, on the urgent classes' reserve slot).
    assert ids(plan([old_normal, new_realtime], inflight={}, capacity={"m": 1}, limits=limits, now=20.0)) == [
        ["j0"],
        ["j1"],
    ]


def test_a_batch_line_never_ages_over_an_interactive_job():
    limits = Limits(1, 0.0, (64,), aging_s=10.0)
    old_line = item(0, priority=3, arrived=0.0)
    for now in (15.0, 35.0, 1000.0):
        fresh = item(1, priority=2, arrived=now)
        assert ids(plan([old_line, fresh], inflight={}, capacity={"m": 1}, limits=limits, now=now)) == [
            ["j1"]
        ]


def test_the_batch_class_leaves_the_reserve_to_interactive_jobs():
    limits = Limits(max_batch_size=4, max_wait_s=0.05, length_buckets=(64,))
    lines = [item(i, priority=3) for i in range(20)]
    # 10 seats, 4 reserved: the batch lines take 6 however many wait
    batches = plan(lines, inflight={}, capacity={"m": 8}, limits=limits, now=1.0, room={"m": 10},
                   running={"m": 0}, reserve={"m": 4})  # fmt: skip
    assert [len(b.items) for b in batches] == [4, 2]
    # a normal job that arrives then has its seat at once, ahead of the lines still waiting
    normal = item(99, priority=2, arrived=1.0)
    batches = plan([*lines[6:], normal], inflight={"m": 2}, capacity={"m": 8}, limits=limits, now=1.05,
                   room={"m": 4}, running={"m": 6}, reserve={"m": 4})  # fmt: skip
    assert ids(batches) == [["j99"]]
    # with the interactive work gone and seats free beyond the reserve, the lines fill them
    batches = plan(lines[6:], inflight={"m": 0}, capacity={"m": 8}, limits=limits, now=2.0,
                   room={"m": 64}, running={"m": 0}, reserve={"m": 4})  # fmt: skip
    assert sum(len(b.items) for b in batches) == 14
    assert (
        batch_reserve(64, Limits(32, 0.05, (64,))) == 32 and batch_reserve(16, Limits(32, 0.05, (64,))) == 8
    )


def test_without_aging_the_order_is_strict():
    limits = Limits(1, 0.0, (64,), aging_s=0.0)
    pending = [item(0, priority=3, arrived=0.0), item(1, priority=2, arrived=1000.0)]
    assert ids(plan(pending, inflight={}, capacity={"m": 1}, limits=limits, now=5000.0)) == [["j1"]]


def test_a_job_past_its_deadline_expires_instead_of_running():
    late = Item("late", "m", 10, 2, arrived=0.0, deadline=1.0)
    on_time = Item("ok", "m", 10, 2, arrived=0.0, deadline=10.0)
    assert [it.job_id for it in expired([late, on_time], now=2.0)] == ["late"]
    assert ids(plan([late, on_time], inflight={}, capacity={"m": 1}, limits=LIMITS, now=2.0)) == [["ok"]]
    assert next_deadline([on_time], LIMITS) == LIMITS.max_wait_s  # the window closes first
    assert next_deadline([Item("x", "m", 1, 2, arrived=0.0, deadline=0.01)], LIMITS) == 0.01


def test_a_job_recovered_more_than_once_runs_alone():
    suspect = Item("suspect", "m", 10, 2, arrived=0.0, alone=True)
    mates = [item(i, priority=2, arrived=0.0) for i in range(3)]
    batches = plan([suspect, *mates], inflight={}, capacity={"m": 2}, limits=LIMITS, now=1.0)
    assert sorted(ids(batches)) == [["j0", "j1", "j2"], ["suspect"]]


def test_urgent_classes_skip_the_window_when_the_pipeline_is_busy():
    normal = [item(0, priority=2)]
    high = [item(1, priority=1)]
    assert plan(normal, inflight={"m": 1}, capacity={"m": 2}, limits=LIMITS, now=0.0) == []
    assert ids(plan(high, inflight={"m": 1}, capacity={"m": 2}, limits=LIMITS, now=0.0)) == [["j1"]]


def test_the_sequence_budget_bounds_what_starts_and_urgent_work_has_a_reserve():
    normal = [item(i, priority=2) for i in range(6)]
    # Room for 3 more sequences: a batch of 3 starts, the rest waits for sequences to finish.
    assert ids(plan(normal, inflight={}, capacity={"m": 2}, limits=LIMITS, now=1.0, room={"m": 3})) == [
        ["j0", "j1", "j2"]
    ]
    assert plan(normal, inflight={}, capacity={"m": 2}, limits=LIMITS, now=1.0, room={"m": 0}) == []
    # A saturated pipeline (no room, no free slot) still starts one urgent batch at once.
    high = [item(10, priority=1), item(11, priority=0)]
    batches = plan(high + normal, inflight={"m": 2}, capacity={"m": 2}, limits=LIMITS, now=1.0, room={"m": 0})
    assert ids(batches) == [["j11", "j10"]]


def test_a_pipeline_with_sequences_running_is_not_idle_so_a_window_gathers_a_batch():
    pending = [item(0)]
    # No batch being prefilled, but sequences decoding: wait for the window (or a full batch).
    assert plan(pending, inflight={}, capacity={"m": 2}, limits=LIMITS, now=0.01, running={"m": 5}) == []
    assert ids(plan(pending, inflight={}, capacity={"m": 2}, limits=LIMITS, now=0.05, running={"m": 5})) == [
        ["j0"]
    ]
    assert ids(plan(pending, inflight={}, capacity={"m": 2}, limits=LIMITS, now=0.01, running={"m": 0})) == [
        ["j0"]
    ]


def test_a_prefill_batch_holds_at_most_max_prefill_tokens_padded_positions():
    limits = Limits(8, 0.0, (64, 128, 256), max_prefill_tokens=256)
    pending = [Item(f"j{i}", "m", n, 2, arrived=0.0) for i, n in enumerate([100, 90, 120, 80, 110])]
    # One bucket (<=128): 2 x 120 = 240 fits, a third would pad to 3 x 120 = 360.
    assert ids(plan(pending, inflight={}, capacity={"m": 1}, limits=limits, now=1.0)) == [["j0", "j1"]]
    # A prompt longer than the cap still goes, alone.
    long = [Item("long", "m", 300, 2, arrived=0.0), Item("next", "m", 290, 2, arrived=0.0)]
    assert ids(plan(long, inflight={}, capacity={"m": 1}, limits=limits, now=1.0)) == [["long"]]
    assert within_tokens(pending, None) == pending


def test_urgent_batches_may_take_as_many_slots_again_as_the_pipeline_has():
    highs = [item(i, priority=1, arrived=float(i)) for i in range(4)]
    limits = Limits(1, 0.0, (64,))
    # Both slots held by normal batches: two urgent batches still start, a third waits.
    batches = plan(highs, inflight={"m": 2}, capacity={"m": 2}, limits=limits, now=5.0, room={"m": 1})
    assert ids(batches) == [["j0"], ["j1"]]


def test_urgent_jobs_wait_for_an_urgent_batch_that_has_not_started_and_then_go_together():
    highs = [item(i, priority=1, arrived=0.01 * i) for i in range(3)]
    held = plan(highs, inflight={"m": 1}, capacity={"m": 2}, limits=LIMITS, now=1.0, hold={"m"})
    assert held == []
    # Once it started: one batch of all three (up to a full batch, which goes even while held).
    assert ids(plan(highs, inflight={"m": 1}, capacity={"m": 2}, limits=LIMITS, now=1.0)) == [
        ["j0", "j1", "j2"]
    ]
    four = [*highs, item(3, priority=0)]
    assert ids(plan(four, inflight={"m": 1}, capacity={"m": 2}, limits=LIMITS, now=1.0, hold={"m"})) == [
        ["j3", "j0", "j1", "j2"]
    ]


# --- min_batch_size: an idle pipeline gathers a batch too, up to the window -----------------------

MIN3 = Limits(max_batch_size=4, max_wait_s=0.05, length_buckets=(64, 128, 256), min_batch_size=3)


def test_by_default_an_idle_pipeline_starts_the_first_job_at_once():
    assert LIMITS.min_batch_size == 1
    assert ids(plan([item(0)], inflight={}, capacity={"m": 2}, limits=LIMITS, now=0.0)) == [["j0"]]


def test_with_a_minimum_an_idle_pipeline_waits_until_the_bucket_holds_it():
    two = [item(0, arrived=0.0), item(1, arrived=0.01)]
    assert plan(two, inflight={}, capacity={"m": 2}, limits=MIN3, now=0.02) == []
    three = [*two, item(2, arrived=0.02)]
    assert ids(plan(three, inflight={}, capacity={"m": 2}, limits=MIN3, now=0.02)) == [["j0", "j1", "j2"]]


def test_with_a_minimum_the_window_closing_releases_a_smaller_bucket():
    two = [item(0, arrived=0.0), item(1, arrived=0.01)]
    assert plan(two, inflight={}, capacity={"m": 2}, limits=MIN3, now=0.049) == []
    assert ids(plan(two, inflight={}, capacity={"m": 2}, limits=MIN3, now=0.05)) == [["j0", "j1"]]
    # The batcher wakes up when that window closes: the oldest job's arrival plus the maximum wait.
    assert next_deadline(two, MIN3) == 0.05


def test_the_minimum_counts_per_bucket():
    # Three jobs, but in two length buckets: neither holds three, so both wait for the window.
    split = [item(0, tokens=10), item(1, tokens=10), item(2, tokens=200)]
    assert plan(split, inflight={}, capacity={"m": 3}, limits=MIN3, now=0.01) == []
    assert sorted(ids(plan(split, inflight={}, capacity={"m": 3}, limits=MIN3, now=0.05))) == [
        ["j0", "j1"],
        ["j2"],
    ]


def test_urgent_classes_ignore_the_minimum():
    realtime, high = item(0, priority=0), item(1, priority=1)
    assert ids(plan([realtime], inflight={}, capacity={"m": 2}, limits=MIN3, now=0.0)) == [["j0"]]
    assert ids(plan([high], inflight={"m": 1}, capacity={"m": 2}, limits=MIN3, now=0.0)) == [["j1"]]
    # An urgent job leads its bucket's batch: the normal jobs waiting with it go along, under the minimum.
    mixed = [item(2, priority=2, arrived=0.0), high]
    assert ids(plan(mixed, inflight={}, capacity={"m": 2}, limits=MIN3, now=0.01)) == [["j1", "j2"]]
    # Normal jobs alone, same moment: they wait for the minimum or the window.
    assert plan([item(2, priority=2)], inflight={}, capacity={"m": 2}, limits=MIN3, now=0.01) == []


def test_a_busy_pipeline_still_waits_for_a_full_batch_or_the_window_whatever_the_minimum():
    three = [item(i, arrived=0.0) for i in range(3)]
    assert plan(three, inflight={"m": 1}, capacity={"m": 2}, limits=MIN3, now=0.01) == []
    four = [item(i, arrived=0.0) for i in range(4)]
    assert ids(plan(four, inflight={"m": 1}, capacity={"m": 2}, limits=MIN3, now=0.01)) == [
        ["j0", "j1", "j2", "j3"]
    ]


def test_a_step_engine_pipeline_takes_the_head_of_a_window_whose_prompts_fit_its_kv_blocks():
    # 20-token prompts take 2 blocks of 16 each (the prompt and its first token): 5 free blocks hold two.
    pending = [item(i, tokens=20) for i in range(4)]
    kv = {"m": (5, 16)}
    batches = plan(pending, inflight={"m": 1}, capacity={"m": 4}, limits=LIMITS, now=1.0, kv=kv)
    assert ids(batches) == [["j0", "j1"]]
    assert (
        plan(pending, inflight={"m": 1}, capacity={"m": 4}, limits=LIMITS, now=1.0, kv={"m": (1, 16)}) == []
    )
    # Without a KV bound (the batch engine) the whole window goes.
    assert ids(plan(pending, inflight={"m": 1}, capacity={"m": 4}, limits=LIMITS, now=1.0)) == [
        ["j0", "j1", "j2", "j3"]
    ]


def test_urgent_jobs_go_beyond_the_kv_blocks_and_what_they_take_counts():
    high = [item(0, tokens=40, priority=1)]
    normal = [item(1, tokens=20, arrived=0.0)]
    # No free block: the high job goes anyway (its replica preempts for it); the normal one waits.
    batches = plan(
        high + normal, inflight={"m": 1}, capacity={"m": 4}, limits=LIMITS, now=1.0, kv={"m": (0, 16)}
    )
    assert ids(batches) == [["j0"]]
    # 4 free blocks: the high job takes 3 of them, so the normal job (2 blocks) still waits.
    batches = plan(
        high + normal, inflight={"m": 1}, capacity={"m": 4}, limits=LIMITS, now=1.0, kv={"m": (4, 16)}
    )
    assert ids(batches) == [["j0"]]


def test_a_prompt_larger_than_the_free_cache_goes_alone_to_an_idle_pipeline_only():
    huge = [item(0, tokens=500), item(1, tokens=10)]
    # Idle: it goes (alone), and its replica refuses it with the reason; it never waits here forever.
    batches = plan(
        huge, inflight={}, capacity={"m": 4}, limits=LIMITS, now=1.0, kv={"m": (8, 16)}, running={}
    )
    assert ids(batches) == [["j0"]]
    # Busy: it waits for the blocks the running sequences hold; a job that fits goes past it.
    busy = plan(huge, inflight={"m": 1}, capacity={"m": 4}, limits=LIMITS, now=1.0, kv={"m": (8, 16)})
    assert ids(busy) == [["j1"]]


def test_a_step_engine_batch_is_bounded_by_kv_blocks_not_by_padded_prefill_positions():
    limits = Limits(8, 0.0, (64, 128, 256), max_prefill_tokens=16)
    pending = [Item(f"j{i}", "m", 40, 2, arrived=0.0) for i in range(4)]  # 3 blocks each
    assert ids(plan(pending, inflight={}, capacity={"m": 1}, limits=limits, now=1.0)) == [["j0"]]
    batches = plan(pending, inflight={}, capacity={"m": 1}, limits=limits, now=1.0, kv={"m": (9, 16)})
    assert ids(batches) == [["j0", "j1", "j2"]]
