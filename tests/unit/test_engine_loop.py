"""The engine loop (`app.workers.engine.loop`) on every supported family, cut into 1, 2 and 3 stages
and loaded the way a worker loads them, in fp32: ragged steps over a paged cache give the tokens and
logits of the whole model's own `generate`, through chunked prefills (a token budget smaller than
the prompts), a sequence joining while others decode, sequences leaving at different lengths, and a
pool too small for all of them at once (a preemption, resumed from its cached blocks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from families import CONFIGS
from unit.test_families import reference

from app.core.config import Settings
from app.core.errors import UnsupportedModel
from app.partitions import paged, ragged
from app.partitions.layers import LayerRange, StagePartition
from app.workers.engine.loop import EngineLoop, greedy, layout
from app.workers.engine.scheduler import SchedulerConfig, Seq
from app.workers.main import engine_of

# (prompt, max_tokens, the step it arrives at)
SEQUENCES = {
    "a": ([5, 6, 7], 12, 0),
    "b": ([8, 9, 10, 11, 12, 13, 14, 15, 16, 17], 5, 0),  # leaves early
    "c": ([18, 19, 20, 21, 22, 23, 24], 12, 0),
    "d": ([30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], 9, 4),  # joins running sequences
}
# 4 positions a block, 8 tokens a step: every prompt over 8 tokens is prefilled in chunks; the four
# sequences need 19 blocks at their longest, the pool has 12: one at least is preempted
CONFIG = SchedulerConfig(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)


def load(path: Path, stages: int) -> list[StagePartition]:
    return [StagePartition.load(path, LayerRange.even_split(6, stages, s)) for s in range(stages)]


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ragged_steps_decode_exactly_as_generate(
    family_models: dict[str, tuple[Path, Any]], name: str, stages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, model = family_models[name]
    # decode rows read the slab from 2 rows on (one row reads its blocks): both paths, and the slab
    # built, appended to, left and built again as sequences join, leave and are preempted
    monkeypatch.setattr(paged, "SLAB_MIN_ROWS", 2)
    slabbed = 0
    prepare = paged.PagedCache.prepare

    def counted(cache: paged.PagedCache, step: paged.Ragged, group: int = 0) -> Any:
        nonlocal slabbed
        at = prepare(cache, step, group)
        slabbed += at is not None
        return at

    monkeypatch.setattr(paged.PagedCache, "prepare", counted)
    loop = EngineLoop(load(path, stages), CONFIG)
    seqs = {k: Seq(k, tuple(p), n) for k, (p, n, _) in SEQUENCES.items()}
    got: dict[str, list[torch.Tensor]] = {k: [] for k in seqs}
    mixed = 0  # steps with decode rows and a prefill chunk together
    for step in range(200):
        for k, (_, _, at) in SEQUENCES.items():
            if at == step:
                loop.add(seqs[k])
        if not loop.has_work:
            break
        result = loop.step()
        mixed += bool(result.plan.decodes and result.plan.chunks)
        for seq_id, logits in result.logits.items():
            got[seq_id].append(logits)
    assert not loop.has_work
    assert sum(s.preemptions for s in seqs.values()) >= 1
    assert slabbed >= 8 * stages  # every stage read its slab on several steps
    assert mixed >= 1
    for k, seq in seqs.items():
        prompt, n, _ = SEQUENCES[k]
        tokens, expected = reference(model, prompt, n)
        assert seq.output == tokens, k
        assert len(got[k]) == n
        for i, (ours, theirs) in enumerate(zip(got[k], expected, strict=True)):
            torch.testing.assert_close(ours, theirs.float(), rtol=1e-4, atol=1e-4, msg=f"{k} step {i}")


def pipelined(loop: EngineLoop, arrivals: dict[str, tuple[Seq, int]]) -> dict[str, list[torch.Tensor]]:
    """Run `loop`'s stages as a pipeline of as many workers: a plan a tick enters stage 0 while the
    plans before it move one stage on (each in its micro-batch's slab), the oldest is sampled and
    updated when it leaves the last stage. Each sequence's logits, step after step."""
    depth = len(loop.stages)
    got: dict[str, list[torch.Tensor]] = {k: [] for k in arrivals}
    flights: list[dict[str, Any]] = []  # oldest first: plan, layout, tensor, next stage, group
    for tick in range(1000):
        for seq, at in arrivals.values():
            if at == tick:
                loop.add(seq)
        if not loop.has_work and not flights:
            return got
        for flight in flights:  # each moves one stage on, as each worker runs its next message
            step, x, sample = flight["layout"]
            flight["x"] = loop.run_stage(flight["stage"], step, flight["x"], sample, group=flight["group"])
            flight["stage"] += 1
        held = loop.scheduler.idle_sequences + sum(len(f["plan"]) for f in flights)
        if loop.scheduler.in_flight < depth and loop.scheduler.idle_sequences:  # stage 0 meanwhile
            plan = loop.scheduler.schedule(max_seqs=-(-held // depth))
            if plan.rows:
                group = min(set(range(depth)) - {f["group"] for f in flights})
                step, ids, sample = layout(plan)
                x = loop.run_stage(0, step, ids, sample, group=group)
                flight = {"plan": plan, "layout": (step, ids, sample), "x": x, "stage": 1, "group": group}
                flights.append(flight)
        if flights and flights[0]["stage"] == depth:  # the oldest left the last stage: sampled
            done = flights.pop(0)
            sampling = [r.seq_id for r in done["plan"].rows if r.samples]
            for seq_id, logits in zip(sampling, done["x"], strict=True):
                got[seq_id].append(logits)
            loop.scheduler.update(done["plan"], dict(zip(sampling, greedy(sampling, done["x"]), strict=True)))
    raise AssertionError("the pipeline did not drain")


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_pipeline_with_a_plan_in_flight_per_stage_decodes_exactly_as_generate(
    family_models: dict[str, tuple[Path, Any]], name: str, stages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage k runs step n while stage k + 1 runs step n - 1: the running sequences split into a
    micro-batch per stage, and the tokens and logits are still `generate`'s."""
    path, model = family_models[name]
    monkeypatch.setattr(paged, "SLAB_MIN_ROWS", 1)  # every micro-batch's decode rows on its own slab
    config = SchedulerConfig(
        num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_in_flight=stages
    )
    loop = EngineLoop(load(path, stages), config)
    seqs = {k: (Seq(k, tuple(p), n), at) for k, (p, n, at) in SEQUENCES.items()}
    got = pipelined(loop, seqs)
    assert not loop.has_work and loop.scheduler.in_flight == 0
    assert len(loop.caches[-1].slabs) == stages  # as many micro-batches as stages ran at once
    for k, (seq, _) in seqs.items():
        prompt, n, _ = SEQUENCES[k]
        tokens, expected = reference(model, prompt, n)
        assert seq.output == tokens, k
        for i, (ours, theirs) in enumerate(zip(got[k], expected, strict=True)):
            torch.testing.assert_close(ours, theirs.float(), rtol=1e-4, atol=1e-4, msg=f"{k} step {i}")


def test_a_step_never_exceeds_its_token_budget(family_models: dict[str, tuple[Path, Any]]) -> None:
    path, _ = family_models["llama"]
    loop = EngineLoop(load(path, 1), CONFIG)
    for k, (p, n, _) in SEQUENCES.items():
        loop.add(Seq(k, tuple(p), n))
    sizes = []
    while loop.has_work:
        sizes.append(loop.step().plan.num_tokens)
    assert max(sizes) <= CONFIG.max_num_batched_tokens
    assert max(sizes) == CONFIG.max_num_batched_tokens  # the budget is used when prompts wait


def test_a_length_dependent_rope_is_refused(tmp_path: Path) -> None:
    import transformers as tf
    from families import COMMON
    from transformers import AutoModelForCausalLM

    config = tf.LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    stage = StagePartition.load(tmp_path)
    with pytest.raises(UnsupportedModel, match="per row"):
        ragged.check(stage)
    assert engine_of(Settings(engine="auto"), 1, stage) == "batch"  # the default serves it anyway


def test_the_default_engine_is_the_step_engine_where_it_serves_the_pipeline(
    family_models: dict[str, tuple[Path, Any]],
) -> None:
    path, _ = family_models["llama"]
    whole = StagePartition.load(path)
    assert engine_of(Settings(engine="auto"), 1, whole) == "step"  # one stage on a CPU
    assert engine_of(Settings(engine="auto"), 2, whole) == "step"  # several stages too
    assert engine_of(Settings(engine="batch"), 1, whole) == "batch"  # a choice is kept
    assert Settings.model_fields["engine"].default == "auto"
