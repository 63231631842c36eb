"""The in-flight budget follows the live stage replicas: pure rules, no services."""

from __future__ import annotations

from app.batching.budget import MIN_REPLICAS, REPLICA_BATCHES, Share, budget, pipeline_replicas

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
