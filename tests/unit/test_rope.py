"""Ropes whose frequencies depend on the sequence's length: dynamic NTK and longrope (Phi-3.5,
Phi-4-mini). Each row's tables come from its own length, as `generate` of that prompt alone computes
them, whatever else the stage runs; a longrope row that grows past `original_max_position_embeddings`
is computed again whole with the long factors, as Phi-3's `generate` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from families import COMMON
from transformers import AutoModelForCausalLM

from app.core.errors import UnsupportedModel
from app.partitions.families import family_for
from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad
from app.partitions.prefix import Prefill, PrefixCache

LIMIT = 16  # max_position_embeddings (dynamic), original_max_position_embeddings (longrope)
HALF_HEAD = 8  # head_dim 16: 8 rotary frequencies
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(HALF_HEAD)],
    "long_factor": [2.0 + 0.5 * i for i in range(HALF_HEAD)],
    "original_max_position_embeddings": LIMIT,
}


def _save(config: Any, path: Path) -> Path:
    torch.manual_seed(0)
    config.initializer_range = 0.1
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tf.LlamaConfig(
        **{**COMMON, "max_position_embeddings": LIMIT},
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    )
    return _save(config, tmp_path_factory.mktemp("rope") / "dynamic")


@pytest.fixture(scope="module", params=["phi3.5", "phi4-mini", "llama"])
def longrope(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-3.5-mini's shape, Phi-4-mini's (partial rotary, tied embedding), tiny; and a Llama with a
    longrope, whose `generate` keeps its cache past the limit (Phi-3's computes the sequence again)."""
    common = {**COMMON, "max_position_embeddings": 4 * LIMIT}
    if request.param == "llama":
        config: Any = tf.LlamaConfig(**common, head_dim=16, rope_parameters=LONGROPE)
    elif request.param == "phi3.5":
        config = tf.Phi3Config(**common, original_max_position_embeddings=LIMIT, rope_parameters=LONGROPE)
    else:
        half = int(HALF_HEAD * 0.75)
        params = {
            **LONGROPE,
            "partial_rotary_factor": 0.75,
            "short_factor": LONGROPE["short_factor"][:half],
            "long_factor": LONGROPE["long_factor"][:half],
        }
        config = tf.Phi3Config(
            **common,
            original_max_position_embeddings=LIMIT,
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            rope_parameters=params,
        )
    return _save(config, tmp_path_factory.mktemp("rope") / request.param)


def generate_alone(path: Path, prompt: list[int], steps: int) -> list[int]:
    """`generate` of one prompt on a model just loaded: transformers keeps the last length's
    frequencies in the model, so a reference shares its model with nothing."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


class Batch:
    """One batch through a pipeline of stages: prefill, then greedy decode steps."""

    def __init__(self, parts: list[StagePartition], prompts: list[list[int]], first: int = 0) -> None:
        self.parts = parts
        x, mask = left_pad(prompts, pad_id=0)
        ids = [str(first + i) for i in range(len(prompts))]
        self.states = [BatchState(parts[0].config, ids, mask.clone()) for _ in parts]
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self._take(self._run(x))

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for part, state in zip(self.parts, self.states, strict=True):
            x = part(state, x)
        return x

    def _take(self, logits: torch.Tensor) -> None:
        for row, token in enumerate(logits.argmax(-1).tolist()):
            self.tokens[row].append(token)

    def step(self) -> None:
        for state in self.states:
            state.extend(1)
        self._take(self._run(torch.tensor([[t[-1]] for t in self.tokens])))


def stages(path: Path, count: int) -> list[StagePartition]:
    return [StagePartition.load(path, LayerRange.even_split(6, count, s)) for s in range(count)]


LONG = list(range(5, 27))  # 22 tokens: past the limit from its prefill
SHORT = [30, 31, 32, 33, 34, 35, 36, 37]  # 8 tokens: crosses the limit while it decodes


@pytest.mark.parametrize("count", [1, 2])
def test_dynamic_rope_rows_are_independent_of_what_else_the_stage_runs(dynamic: Path, count: int) -> None:
    """Two batches of different lengths interleaved on the same stages, a third holding both prompts:
    every row decodes exactly as `generate` of its prompt alone, across the length where the
    frequencies start to change."""
    parts = stages(dynamic, count)
    long, short, both = Batch(parts, [LONG]), Batch(parts, [SHORT]), Batch(parts, [SHORT, LONG])
    for _ in range(15):
        long.step()
        short.step()
        both.step()
    assert long.tokens[0] == generate_alone(dynamic, LONG, 16)
    assert short.tokens[0] == generate_alone(dynamic, SHORT, 16)
    assert both.tokens == [short.tokens[0], long.tokens[0]]


def test_dynamic_rope_prefixes_are_reused_only_within_the_configs_own_frequencies(dynamic: Path) -> None:
    """A cached prefix's keys were rotated for the prompt that stored them: past the limit, a
    longer prompt has other frequencies, and computes its prefix again."""
    part = stages(dynamic, 1)[0]
    cache = PrefixCache(2**24)
    for prompt in (LONG, [*LONG, 40, 41]):
        x, mask = left_pad([prompt], pad_id=0)
        prefill = Prefill(cache, part, ["a"], [prompt], mask)
        assert prefill.reused == 0
        state, x = prefill.start(x)
        prefill.finish(state, part(state, x))
    assert len(cache) == 0
    short = [*SHORT, *SHORT]  # 16 tokens, within the limit: stored
    x, mask = left_pad([short], pad_id=0)
    prefill = Prefill(cache, part, ["a"], [short], mask)
    state, x = prefill.start(x)
    prefill.finish(state, part(state, x))
    assert len(cache) == 1


@pytest.mark.parametrize("count", [1, 2, 3])
def test_longrope_decodes_exactly_as_generate_across_its_original_length(longrope: Path, count: int) -> None:
    """Rows grow past `original_max_position_embeddings` at different steps (Phi-3's `generate`
    computes such a row again whole with the long factors there), one prompt is past it from its
    prefill, one reaches it exactly, and a batch joins mid-way: every row as `generate` alone."""
    parts = stages(longrope, count)
    prompts = [SHORT, [40, 41, 42], LONG, list(range(50, 50 + LIMIT))]
    batch = Batch(parts, prompts)
    joiner = Batch(parts, [[60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]], first=len(prompts))
    for step in range(1, 20):
        if step == 4:  # a prefilled batch joins the running one, as the stage runtime's joins do
            for state, other in zip(batch.states, joiner.states, strict=True):
                state.absorb(other)
            batch.tokens.append(joiner.tokens[0])
            prompts.append([60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71])
        if step == 12:  # a row that already grew past the limit leaves
            keep = [s for s in batch.states[0].seq_ids if s != "3"]
            for state in batch.states:
                state.keep(keep)
            prompts.pop(3)
            batch.tokens.pop(3)
        batch.step()
    for prompt, tokens in zip(prompts, batch.tokens, strict=True):
        assert len(prompt) + len(tokens) > LIMIT + 1
        assert tokens == generate_alone(longrope, prompt, len(tokens)), prompt


def test_longrope_prefixes_are_reused_below_the_original_length_only(longrope: Path) -> None:
    """A prefix cached by a short prompt (short factors) serves a short prompt, never a long one."""
    part = stages(longrope, 1)[0]
    cache = PrefixCache(2**24)
    short = [*SHORT, *SHORT]  # 16 tokens: one block, stored
    reused = []
    for prompt in (short, [*short, 40, 41]):
        x, mask = left_pad([prompt], pad_id=0)
        prefill = Prefill(cache, part, ["a"], [prompt], mask)
        state, x = prefill.start(x)
        prefill.finish(state, part(state, x))
        reused.append(prefill.reused)
    assert reused == [0, 0] and len(cache) == 1


def test_a_rope_by_layer_type_that_depends_on_the_length_is_refused() -> None:
    config = tf.Gemma3TextConfig(
        **COMMON,
        head_dim=16,
        rope_parameters={
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    with pytest.raises(UnsupportedModel, match="sequence length"):
        family_for(config)


def test_a_crossing_step_hands_on_only_the_crossing_rows_history(longrope: Path) -> None:
    """Between stages a crossing step carries the step's row for each sequence and the crossing
    rows' whole history after them, not every row's history (64 rows of 4k tokens of Phi-3.5 in
    bf16 would be 1.6 GB)."""
    if longrope.name == "llama":
        pytest.skip("a Llama's generate keeps its cache past the limit: nothing is computed again")
    first, second = stages(longrope, 2)
    x, mask = left_pad([SHORT, [40, 41, 42], list(range(50, 50 + LIMIT))], pad_id=0)
    states = [BatchState(first.config, ["a", "b", "c"], mask.clone()) for _ in range(2)]
    tokens = second(states[1], first(states[0], x)).argmax(-1)
    for state in states:
        state.extend(1)
    hidden = first(states[0], tokens[:, None])  # row c grows to LIMIT + 1 tokens
    assert tuple(hidden.shape) == (3 + LIMIT + 1, 1, 64)
    assert tuple(second(states[1], hidden).shape) == (3, 96)
