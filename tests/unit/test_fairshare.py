"""Fair share across tenants (app/batching/fairshare.py), through `windows.plan` as the batcher runs
it: settle the tenants' virtual times, plan, charge what went out, again."""

from collections import Counter

from app.batching import fairshare
from app.batching.windows import Item, Limits, plan

LIMITS = Limits(max_batch_size=8, max_wait_s=0.0, length_buckets=(64,))


def job(tenant: str, i: int, *, arrived: float, priority: int = 2, cost: int = 10) -> Item:
    return Item(f"{tenant}{i}", "m", cost, priority, arrived, tenant=tenant)


def serve(pending: list[Item], rounds: int, *, weights=None, batch_slots: int = 1) -> Counter[str]:  # type: ignore[no-untyped-def]
    """Run the batcher's loop for `rounds` rounds of one free slot each; tokens dispatched per tenant."""
    share: dict[str, float] = {}
    served: Counter[str] = Counter()
    pending = list(pending)
    for r in range(rounds):
        share = fairshare.settle(share, {it.tenant for it in pending})
        batches = plan(
            pending,
            inflight={"m": 0},
            capacity={"m": batch_slots},
            limits=LIMITS,
            now=100.0 + r,
            share=share,
            weights=weights,
        )
        for batch in batches:
            share = fairshare.charge(share, batch.items, weights or {})
            for it in batch.items:
                served[it.tenant] += it.cost
            taken = {id(it) for it in batch.items}
            pending = [it for it in pending if id(it) not in taken]
    return served


def test_two_backlogged_tenants_share_equally_whatever_their_backlogs():
    # heavy queued 128 jobs before light queued 8: in arrival order light would wait 16 batches
    heavy = [job("heavy", i, arrived=i * 0.01) for i in range(128)]
    light = [job("light", i, arrived=2.0 + i * 0.01) for i in range(8)]
    first = plan(heavy + light, inflight={}, capacity={"m": 1}, limits=LIMITS, now=3.0, share={})
    assert Counter(it.tenant for it in first[0].items) == {"heavy": 4, "light": 4}
    # light keeps 8 waiting (it tops up as it is served): over 20 batches each gets half, although
    # heavy's backlog is old enough to have aged three classes up (it ages as a class, not a tenant)
    served = serve_topped_up(rounds=20)
    assert served["heavy"] == served["light"]


def serve_topped_up(rounds: int, weights=None) -> Counter[str]:  # type: ignore[no-untyped-def]
    share: dict[str, float] = {}
    served: Counter[str] = Counter()
    pending = [job("heavy", i, arrived=i * 0.01) for i in range(128)]
    n = 0
    for r in range(rounds):
        while sum(it.tenant == "light" for it in pending) < 8:  # light is backlogged too
            pending.append(job("light", n, arrived=99.0 + r + n * 1e-3))
            n += 1
        share = fairshare.settle(share, {it.tenant for it in pending})
        for batch in plan(
            pending,
            inflight={},
            capacity={"m": 1},
            limits=LIMITS,
            now=100.0 + r,
            share=share,
            weights=weights,
        ):
            share = fairshare.charge(share, batch.items, weights or {})
            for it in batch.items:
                served[it.tenant] += it.cost
            taken = {id(it) for it in batch.items}
            pending = [it for it in pending if id(it) not in taken]
    return served


def test_weights_divide_the_pipeline_in_proportion():
    served = serve_topped_up(rounds=20, weights={"heavy": 3.0})
    assert served["heavy"] == 3 * served["light"]


def test_a_lone_tenant_gets_every_seat_in_arrival_order():
    alone = [job("a", i, arrived=i * 0.01) for i in range(20)]
    batches = plan(alone, inflight={}, capacity={"m": 2}, limits=LIMITS, now=1.0, share={"a": 5.0})
    assert [it.job_id for b in batches for it in b.items] == [f"a{i}" for i in range(16)]
    assert serve(alone, rounds=3) == {"a": 200}


def test_cost_counts_tokens_not_jobs():
    # big's jobs are four times small's: small gets four jobs for each of big's
    big = [job("big", i, arrived=i * 0.01, cost=40) for i in range(20)]
    small = [job("small", i, arrived=i * 0.01, cost=10) for i in range(40)]
    served = serve(big + small, rounds=4)
    assert abs(served["big"] - served["small"]) <= 40


def test_priority_classes_still_come_first():
    # a tenant that has been served a lot still gets its realtime job out before anyone's normal one
    urgent = job("busy", 99, arrived=5.0, priority=0)
    normal = [job("idle", i, arrived=0.0) for i in range(8)]
    share = fairshare.settle({"busy": 1e6, "idle": 0.0}, {"busy", "idle"})
    batches = plan([*normal, urgent], inflight={}, capacity={"m": 1}, limits=LIMITS, now=6.0, share=share)
    assert batches[0].items[0].job_id == "busy99"


def test_a_returning_tenant_banks_no_credit_for_its_idle_time():
    # away while busy was served 1000 units: it comes back level with busy, not 1000 units ahead
    share = fairshare.settle({"busy": 1000.0, "away": 0.0}, {"busy"})
    assert share == {"busy": 0.0}
    back = fairshare.settle(share, {"busy", "away"})
    assert back == {"busy": 0.0, "away": 0.0}


def test_a_tenant_served_ahead_keeps_its_debt_while_it_waits_for_nothing():
    share = fairshare.settle({"ahead": 50.0, "other": 10.0}, {"other"})
    assert share == {"other": 0.0, "ahead": 40.0}
    assert fairshare.settle(share, {"other", "ahead"}) == {"other": 0.0, "ahead": 40.0}


def test_aging_lifts_a_job_a_whole_class_at_a_time():
    limits = Limits(1, 0.0, (64,), aging_s=10.0)
    old = Item("old", "m", 1, 2, arrived=0.0, tenant="x")
    assert old.level(now=9.9, aging_s=10.0) == 2 and old.level(now=10.0, aging_s=10.0) == 1
    assert old.level(now=100.0, aging_s=10.0) == 0
    fresh_high = Item("high", "m", 1, 1, arrived=15.0, tenant="y")
    # at t=15 both rank as class 1: their tenants' turns decide, then arrival (old first)
    batches = plan([fresh_high, old], inflight={}, capacity={"m": 1}, limits=limits, now=15.0, share={})
    assert batches[0].items[0].job_id == "old"
