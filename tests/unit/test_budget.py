"""The in-flight budget follows the live stage replicas: pure rules, no services."""

from __future__ import annotations

from app.batching.budget import MIN_REPLICAS, REPLICA_BATCHES, Ledger, Room, Share, budget, pipeline_replicas
from app.core.credit import ReplicaCredit

SHARE = Share(batches=REPLICA_BATCHES, sequences=64)


def test_a_pipeline_is_as_wide_as_its_thinnest_stage():
    assert pipeline_replicas([3, 1]) == 1
    assert pipeline_replicas([2, 2]) == 2
    assert pipeline_replicas([4]) == 4


def test_adding_a_replica_raises_the_budget_and_losing_one_lowers_it():
    one, two = budget([1, 1], SHARE), budget([2, 2], SHARE)
    assert (one.batches, one.sequences) == (16, 64)
    assert (two.batches, two.sequences) == (32, 128)
    # A second replica of one stage only: the other stage still bounds the pipeline.
    assert budget([2, 1], SHARE) == one
    assert budget([3, 2], SHARE) == two


def test_a_pipeline_whose_heartbeats_lapse_keeps_one_replicas_budget():
    assert MIN_REPLICAS == 1
    for live in ([0, 0], [0, 3], [], [0]):
        lapsed = budget(live, SHARE)
        assert (lapsed.replicas, lapsed.batches, lapsed.sequences) == (1, 16, 64), live


def test_request_level_batching_has_no_sequence_bound():
    assert budget([2], Share(batches=16, sequences=None)).sequences is None


def test_every_stage_keeps_a_batch_circulating_whatever_the_share():
    # Four stages need four batches in flight (and one more to fill the first again) per replica.
    assert budget([1, 1, 1, 1], Share(batches=2, sequences=64)).batches == 5
    assert budget([2, 2, 2, 2], Share(batches=2, sequences=64)).batches == 10


def test_a_step_engine_pipeline_s_room_is_its_replicas_credit_less_what_is_on_its_way():
    ledger = Ledger(horizon_s=10.0)
    credits = [ReplicaCredit(4, 20, 16, 8), ReplicaCredit(2, 10, 16, 8)]
    assert ledger.room("m", credits, now=0.0) == Room(sequences=6, blocks=30, block_size=16, max_sequences=16)
    ledger.sent("m", "b1", [20, 40], now=1.0)  # 2 + 3 blocks
    ledger.sent("other", "b2", [20], now=1.0)  # another model's batch is not this one's
    assert ledger.room("m", credits, now=2.0) == Room(sequences=4, blocks=25, block_size=16, max_sequences=16)
    # A replica reports receiving b1: its credit counts its jobs from then, the ledger no longer does.
    received = [ReplicaCredit(2, 15, 16, 8, received=("b0", "b1")), credits[1]]
    assert ledger.room("m", received, now=2.0) == Room(
        sequences=4, blocks=25, block_size=16, max_sequences=16
    )
    assert ledger.room("m", credits, now=2.0).sequences == 6  # b1 is forgotten for good


def test_a_batch_no_replica_reports_is_forgotten_after_the_horizon():
    ledger = Ledger(horizon_s=10.0)
    credits = [ReplicaCredit(4, 20, 16, 8)]
    ledger.sent("m", "lost", [20], now=0.0)
    assert ledger.room("m", credits, now=10.0).sequences == 3
    assert ledger.room("m", credits, now=10.5).sequences == 4  # the monitor recovers its jobs
    ledger.sent("m", "b", [1000] * 5, now=11.0)  # more than the credit: nothing below zero
    assert ledger.room("m", credits, now=11.0) == Room(sequences=0, blocks=0, block_size=16, max_sequences=8)
