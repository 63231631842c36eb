"""The memory-budget planner: fewest stages that fit, balanced by compute, pure and fast."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig

from app.partitions.planner import (
    MIB,
    ModelCosts,
    Plan,
    format_table,
    load_config,
    model_costs,
    parse_dtype,
    plan_decoder,
    rebalance,
)

A100 = 81920  # MiB: an 80 GiB device


def tiny_llama(layers: int = 4) -> LlamaConfig:
    """The shape tests/tiny.py makes (260 = 256 byte tokens + 4 specials)."""
    return LlamaConfig(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def gpt3() -> PretrainedConfig:
    return load_config("gpt3-175b")


@pytest.fixture(scope="module")
def smollm2() -> PretrainedConfig:
    return load_config("smollm2-135m")


def stage_compute(c: ModelCosts, cuts: list[int]) -> list[int]:
    """FLOPs per stage for cut points [0, ..., n], summed independently of the planner's DP."""
    n = len(c.layer_flops)
    return [
        sum(c.layer_flops[i:j]) + (c.first_flops if i == 0 else 0) + (c.last_flops if j == n else 0)
        for i, j in itertools.pairwise(cuts)
    ]


def assert_covers(plan: Plan) -> None:
    layers = [layer for start, stop in plan.ranges() for layer in range(start, stop)]
    assert layers == list(range(plan.num_layers))
    assert plan.stages[0].has_embedding and plan.stages[-1].has_head
    assert sum(s.has_embedding for s in plan.stages) == 1 and sum(s.has_head for s in plan.stages) == 1
    assert sum(s.compute_share for s in plan.stages) == pytest.approx(1.0)


def test_gpt3_175b_needs_five_80gib_devices_and_plans_fast(gpt3: PretrainedConfig) -> None:
    started = time.perf_counter()
    plan = plan_decoder(gpt3, dtype=torch.float16, max_mem_mb=A100, name="gpt3-175b")
    assert time.perf_counter() - started < 60  # seconds on a loaded machine; an exhaustive search takes hours
    # 174.6B parameters x 2 bytes = 325 GiB (+1.2 GiB for the tied head's copy on the last stage):
    # 23 layers of 3.4 GiB fit in 80 GiB, so 96 layers need 5 stages.
    assert len(plan.stages) == 5
    budget = A100 * MIB
    assert all(s.memory_bytes(0) <= budget for s in plan.stages)
    assert sum(s.param_bytes for s in plan.stages) > 4 * budget  # four devices cannot hold it at all
    head_copy = 50257 * 12288 * 2
    assert sum(s.param_bytes for s in plan.stages) == 2 * 174_604_259_328 + head_copy
    assert_covers(plan)
    assert sorted(stop - start for start, stop in plan.ranges()) == [19, 19, 19, 19, 20]
    assert plan.stages[0].activation_bytes_per_token == 12288 * 2
    assert plan.stages[0].kv_bytes_per_token == 2 * 19 * 96 * 128 * 2


def test_llama_3_70b_plans_with_and_without_a_kv_budget() -> None:
    config = load_config("llama-3-70b")
    plan = plan_decoder(config, max_mem_mb=A100)
    assert plan.ranges() == [(0, 41), (41, 80)]  # the untied LM head weighs 1.2 layers
    assert sum(s.param_bytes for s in plan.stages) == 2 * 70_553_706_496
    kv_per_layer = 2 * 8 * 128 * 2
    assert [s.kv_bytes_per_token for s in plan.stages] == [41 * kv_per_layer, 39 * kv_per_layer]
    with_kv = plan_decoder(config, max_mem_mb=A100, kv_budget_tokens=131072)  # +40 GiB of KV cache
    assert len(with_kv.stages) == 3
    assert all(s.memory_bytes(131072) <= A100 * MIB for s in with_kv.stages)
    assert_covers(with_kv)


def test_tiny_llama_splits_in_two_by_compute(tiny_model: Path) -> None:
    config = load_config(tiny_model)
    plan = plan_decoder(config, stages=2, dtype=torch.float32)
    assert plan.ranges() == [(0, 2), (2, 4)]  # the head (260 x 64) weighs under half a layer
    costs = model_costs(config)
    best = min(max(stage_compute(costs, [0, cut, 4])) for cut in range(1, 4))
    assert max(stage_compute(costs, [0, 2, 4])) == best


def test_smollm2_head_stage_gets_fewer_layers(smollm2: PretrainedConfig) -> None:
    costs = model_costs(smollm2)
    assert costs.last_flops == 8 * costs.layer_flops[0]  # the tied LM head: eight layers of compute
    plan = plan_decoder(smollm2, stages=2)
    assert plan.ranges() == [(0, 19), (19, 30)]  # the LM head weighs eight layers: 19/11 beats 15/15
    assert [s.compute_share for s in plan.stages] == pytest.approx([0.5, 0.5])


def test_three_stages_are_optimal_by_brute_force(smollm2: PretrainedConfig) -> None:
    plan = plan_decoder(smollm2, stages=3)
    cuts = [0, plan.ranges()[0][1], plan.ranges()[1][1], 30]
    costs = model_costs(smollm2)
    best = min(max(stage_compute(costs, [0, a, b, 30])) for a, b in itertools.combinations(range(1, 30), 2))
    assert max(stage_compute(costs, cuts)) == best


def test_tied_head_is_copied_only_when_the_embedding_lives_elsewhere(smollm2: PretrainedConfig) -> None:
    whole = plan_decoder(smollm2, stages=1)
    split = plan_decoder(smollm2, stages=2)
    head = 49152 * 576 * 2
    assert sum(s.param_bytes for s in split.stages) == whole.stages[0].param_bytes + head
    assert (
        whole.stages[0].activation_bytes_per_token == 0
        and split.stages[0].activation_bytes_per_token == 576 * 2
    )


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5, 7])
def test_ranges_cover_every_layer_once(stages: int) -> None:
    plan = plan_decoder(tiny_llama(layers=7), stages=stages)
    assert len(plan.stages) == stages
    assert_covers(plan)


def test_budget_finds_the_fewest_stages_that_fit(smollm2: PretrainedConfig) -> None:
    plan = plan_decoder(smollm2, dtype=torch.float32, max_mem_mb=200)
    assert len(plan.stages) == 4  # 517 MiB of fp32 weights and a 108 MiB head copy
    assert all(s.memory_bytes(0) <= 200 * MIB for s in plan.stages)
    assert_covers(plan)


def test_json_round_trip(smollm2: PretrainedConfig) -> None:
    plan = plan_decoder(smollm2, max_mem_mb=100, kv_budget_tokens=4096, name="smollm2")
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="plan file"):
        Plan.from_json('{"model": "x"}')


def test_plan_rejects_ranges_that_do_not_cover(smollm2: PretrainedConfig) -> None:
    plan = plan_decoder(smollm2, stages=2)
    with pytest.raises(ValueError, match="cover"):
        dataclasses.replace(plan, stages=plan.stages[:1])


def test_errors_state_the_numbers(smollm2: PretrainedConfig) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        plan_decoder(smollm2, max_mem_mb=100, stages=2)
    with pytest.raises(ValueError, match="exactly one"):
        plan_decoder(smollm2)
    with pytest.raises(ValueError, match="cannot cut 30 layers into 31 stages"):
        plan_decoder(smollm2, stages=31)
    with pytest.raises(
        ValueError, match=r"layer 0 with the embedding alone needs 60\.8 MiB .* budget of 50 MiB"
    ):
        plan_decoder(smollm2, max_mem_mb=50)
    # 768 bytes of KV cache per token per layer: 2M tokens are 1464.8 MiB
    with pytest.raises(
        ValueError, match=r"1464\.8 MiB KV cache for 2000000 tokens\), over the budget of 1000 MiB"
    ):
        plan_decoder(smollm2, max_mem_mb=1000, kv_budget_tokens=2_000_000)


def test_load_config_sources(tiny_model: Path) -> None:
    assert load_config(tiny_model / "config.json").num_hidden_layers == 4
    assert load_config("llama-3-70b").num_key_value_heads == 8
    with pytest.raises(ValueError, match="gpt3-175b"):
        load_config("no-such-model")


def test_parse_dtype() -> None:
    assert parse_dtype("fp16") is torch.float16 and parse_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("float17")


def test_rebalance_is_stable_for_equal_latencies(smollm2: PretrainedConfig, gpt3: PretrainedConfig) -> None:
    for config, plan in [
        (smollm2, plan_decoder(smollm2, stages=2)),
        (smollm2, plan_decoder(smollm2, stages=3)),
        (gpt3, plan_decoder(gpt3, max_mem_mb=A100)),
    ]:
        assert rebalance(plan, [0.05] * len(plan.stages), config).ranges() == plan.ranges()


def test_rebalance_moves_layers_to_the_faster_stage(smollm2: PretrainedConfig) -> None:
    plan = plan_decoder(smollm2, stages=2)
    slow_head = rebalance(plan, [0.010, 0.015], smollm2)
    assert slow_head.ranges() == [(0, 22), (22, 30)]
    slow_first = rebalance(plan, [0.015, 0.010], smollm2)
    assert slow_first.ranges()[0][1] < 19
    assert slow_head.stages[0].compute_share > 0.5  # shares stay the FLOPs model's prediction


def test_rebalance_keeps_the_budget(gpt3: PretrainedConfig) -> None:
    plan = plan_decoder(gpt3, max_mem_mb=A100)
    moved = rebalance(plan, [1.0, 1.0, 1.0, 1.0, 3.0], gpt3)
    assert len(moved.stages) == 5 and moved.ranges() != plan.ranges()
    assert all(s.memory_bytes(0) <= A100 * MIB for s in moved.stages)  # no stage above 23 layers
    assert moved.ranges()[-1][1] - moved.ranges()[-1][0] < 19
    with pytest.raises(ValueError, match="one positive latency per stage"):
        rebalance(plan, [1.0, 1.0], gpt3)


def test_format_table(gpt3: PretrainedConfig) -> None:
    table = format_table(plan_decoder(gpt3, max_mem_mb=A100, name="gpt3-175b"))
    lines = table.splitlines()
    assert lines[0].startswith("gpt3-175b: 96 layers, float16, 5 stages, 81920 MiB per device")
    assert len(lines) == 2 + 5
    assert "0-18+emb" in table and "77-95+head" in table and "/ 80.0 GiB" in table


def test_a_pipeline_started_without_a_plan_file_takes_the_planners_cut(tmp_path: Path) -> None:
    """A stage worker cuts SmolLM2 as `conveyor plan --stages 2` does (19/11: the head's stage gets
    fewer layers), not into even halves, whose head stage was the pipeline's slowest."""
    from app.core.config import Settings
    from app.workers.main import stage_layers

    load_config("smollm2-135m").save_pretrained(tmp_path)
    settings = Settings(plan_file=None)
    ranges = [stage_layers(settings, tmp_path, stage=s, num_stages=2) for s in range(2)]
    assert [(r.start, r.stop) for r in ranges] == [(0, 19), (19, 30)]
    assert [(r.start, r.stop) for r in [stage_layers(settings, tmp_path, stage=0, num_stages=1)]] == [(0, 30)]
