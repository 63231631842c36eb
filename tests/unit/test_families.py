"""Every supported family, cut into 1, 2 and 3 stages and loaded the way a worker loads it, decodes
exactly as the whole model's own `generate`: a left-padded batch of three prompts with a row joining
mid-way and a row leaving, greedy tokens and logits step by step; seeded sampling where the family
changes logits; and every other architecture refused before any weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from families import CONFIGS, VOCAB
from transformers import AutoModelForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from app.core.errors import UnsupportedModel
from app.partitions import fusion
from app.partitions.families import FAMILIES, family_for
from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad
from app.partitions.loading import rebuild_buffers
from app.workers.sampling import SamplingParams, sample

STEPS = 16
ALREADY_FUSED = ("phi3-window", "gpt2")  # their checkpoints hold q/k/v (and gate/up) as one weight
FUSED = (fusion.Fused, fusion.GatedMLP)
SAMPLED = ["cohere", "granite", "gemma2"]  # families whose outer forward changes the logits
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24]]
JOINER = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]


@pytest.fixture(scope="module")
def saved(family_models: dict[str, tuple[Path, Any]]) -> dict[str, tuple[Path, Any]]:
    return family_models


_REFERENCES: dict[tuple[int, tuple[int, ...], int], tuple[list[int], list[torch.Tensor]]] = {}


def reference(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """`generate` of one prompt alone (no padding): tokens and raw logits per step (kept per model)."""
    key = (id(model), tuple(prompt), steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = _generate(model, prompt, steps)
    return _REFERENCES[key]


def _generate(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt])
    result = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return result.sequences[0, len(prompt) :].tolist(), [step[0] for step in result.logits]


class Pipeline:
    """Stages loaded from the checkpoint as workers load them, driven as the stage runtime drives them."""

    def __init__(self, path: Path, stages: int, fuse: bool = False) -> None:
        self.parts = [
            StagePartition.load(path, LayerRange.even_split(6, stages, s), fuse=fuse) for s in range(stages)
        ]
        self.config = self.parts[0].config

    def start(self, prompts: list[list[int]], ids: list[str]) -> tuple[list[BatchState], torch.Tensor]:
        x, mask = left_pad(prompts, pad_id=0)
        states = [BatchState(self.config, ids, mask.clone()) for _ in self.parts]
        return states, self.run(states, x)

    def run(self, states: list[BatchState], x: torch.Tensor) -> torch.Tensor:
        h = x
        for part, state in zip(self.parts, states, strict=True):
            h = part(state, h)
        return h  # [B, V]

    def step(self, states: list[BatchState], tokens: torch.Tensor) -> torch.Tensor:
        for state in states:
            state.extend(1)
        return self.run(states, tokens[:, None])


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_stages_decode_exactly_as_generate(
    saved: dict[str, tuple[Path, Any]], name: str, stages: int, fuse: bool
) -> None:
    """Fused: q/k/v and gate/up projections as one product each (`app.partitions.fusion`; bf16 on a
    CPU fuses by default, fp32 only when asked), the same tokens and logits."""
    path, model = saved[name]
    pipeline = Pipeline(path, stages, fuse)
    fused = [m for part in pipeline.parts for m in part.modules() if isinstance(m, FUSED)]
    assert bool(fused) == (fuse and name not in ALREADY_FUSED)
    ids = ["a", "b", "c"]
    states, logits = pipeline.start(PROMPTS, ids)
    got: dict[str, list[torch.Tensor]] = {i: [row] for i, row in zip(ids, logits, strict=True)}
    for step in range(1, STEPS):
        if step == 5:  # a prefilled batch joins the running one, as the stage runtime's joins do
            joining, first = pipeline.start([JOINER], ["d"])
            got["d"] = [first[0]]
            for state, other in zip(states, joining, strict=True):
                state.absorb(other)
        if step == 9:  # b finished: its row leaves, the others close up
            for state in states:
                state.keep(["a", "c", "d"])
        tokens = torch.stack([got[i][-1] for i in states[0].seq_ids]).argmax(-1)
        logits = pipeline.step(states, tokens)
        for i, row in zip(states[0].seq_ids, logits, strict=True):
            got[i].append(row)
    for i, prompt in zip(["a", "b", "c", "d"], [*PROMPTS, JOINER], strict=True):
        mine = got[i]
        tokens, expected = reference(model, prompt, len(mine))
        assert [int(r.argmax()) for r in mine] == tokens, i
        for step, (ours, theirs) in enumerate(zip(mine, expected, strict=True)):
            torch.testing.assert_close(ours, theirs.float(), rtol=1e-4, atol=1e-4, msg=f"{i} step {step}")


@pytest.mark.parametrize("name", SAMPLED)
def test_seeded_sampling_equals_hf_sampling_with_the_same_processors(
    saved: dict[str, tuple[Path, Any]], name: str
) -> None:
    """The logits a family changes (scale, divisor, soft-cap) are the ones sampled: same draws as HF's."""
    path, model = saved[name]
    pipeline = Pipeline(path, 2)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    processors = LogitsProcessorList(
        [TemperatureLogitsWarper(0.8), TopKLogitsWarper(20), TopPLogitsWarper(0.9)]
    )
    ours_gen, theirs_gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    prompt = PROMPTS[1]
    states, logits = pipeline.start([prompt], ["a"])
    sequence = list(prompt)
    for _ in range(STEPS):
        with torch.no_grad():
            full = model(torch.tensor([sequence])).logits[:, -1, :].float()
        theirs = processors(torch.tensor([sequence]), full).softmax(-1)
        expected = int(torch.multinomial(theirs[0], 1, generator=theirs_gen)[0])
        token = int(sample(logits, [params], [ours_gen])[0])
        assert token == expected
        sequence.append(token)
        logits = pipeline.step(states, torch.tensor([token]))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_buffer_of_a_loaded_stage_equals_the_whole_models(
    saved: dict[str, tuple[Path, Any]], name: str
) -> None:
    """Non-persistent buffers (rotary tables, Gemma's embed_scale) are rebuilt, none left as garbage."""
    path, model = saved[name]
    whole = dict(model.named_buffers())
    family = family_for(model.config)
    for stage in range(2):
        part = StagePartition.load(path, LayerRange.even_split(6, 2, stage))
        for local, buffer in part.named_buffers():
            head, _, rest = local.partition(".")
            owner = {"embed_tokens": family.embed, "norm": family.norm, "rotary_emb": "rotary_emb"}.get(head)
            if head == "layers":
                index, _, tail = rest.partition(".")
                full = f"{family.body}.{family.layers}.{part.range.start + int(index)}.{tail}"
            else:
                full = f"{family.body}.{owner}.{rest}"
            torch.testing.assert_close(buffer, whole[full], rtol=0, atol=0, msg=f"{name} {local}")


@pytest.mark.parametrize(
    "config",
    [
        tf.T5Config(),
        tf.BartConfig(),
        tf.FalconConfig(),
        tf.PhiConfig(),
        tf.GPTNeoXConfig(),
        tf.OPTConfig(),
    ],
    ids=lambda c: c.model_type,
)
def test_other_architectures_are_refused_with_the_supported_list(config: Any) -> None:
    with pytest.raises(UnsupportedModel) as refused:
        family_for(config)
    assert config.model_type in refused.value.message
    assert "llama" in refused.value.message and refused.value.status == 422


def test_a_refused_model_reads_no_weight(tmp_path: Path) -> None:
    config = tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    config.save_pretrained(tmp_path)  # no weights at all: a refusal must come before looking for them
    with pytest.raises(UnsupportedModel, match="falcon"):
        StagePartition.load(tmp_path, LayerRange(0, 1))


def test_a_buffer_without_a_rebuild_rule_refuses_the_model(saved: dict[str, tuple[Path, Any]]) -> None:
    _, model = saved["llama"]
    stage = StagePartition(model, LayerRange(0, 6))
    stage.layers[0].register_buffer("stray", torch.empty(3), persistent=False)
    with pytest.raises(UnsupportedModel, match="stray"):
        rebuild_buffers(stage, model.config, torch.device("cpu"), {"rotary_emb"})
    del stage.layers[0].stray


def test_every_family_in_the_table_is_tested() -> None:
    tested = {family_for(config).name for config in CONFIGS.values()}
    assert tested == {family.name for family in FAMILIES}


@pytest.mark.parametrize("name", ["gemma3", "mistral-window", "qwen2-window"])
def test_sliding_layers_keep_only_their_window(saved: dict[str, tuple[Path, Any]], name: str) -> None:
    """After a long prefill and some decode steps a sliding layer's cache holds `window - 1` columns;
    a full-attention layer holds the whole history."""
    path, model = saved[name]
    pipeline = Pipeline(path, 2)
    states, logits = pipeline.start([list(range(5, 25)), [30, 31]], ["a", "b"])
    for _ in range(4):
        logits = pipeline.step(states, logits.argmax(-1))
    window = model.config.sliding_window
    kinds = [pipeline.parts[0].kinds, pipeline.parts[1].kinds]
    for part, state, part_kinds in zip(pipeline.parts, states, kinds, strict=True):
        for index, kind in enumerate(part_kinds):
            slab = state.slabs[part.range.start + index]
            expected = window - 1 if kind == "sliding_attention" else state.length
            assert slab.length == expected and slab.keys.shape[2] == expected


def test_a_tensor_left_on_meta_refuses_to_run(saved: dict[str, tuple[Path, Any]]) -> None:
    from app.partitions.loading import check_materialized

    _, model = saved["llama"]
    with torch.device("meta"):
        stage = StagePartition(AutoModelForCausalLM.from_config(model.config), LayerRange(0, 2))
    with pytest.raises(UnsupportedModel, match="meta"):
        check_materialized(stage)
