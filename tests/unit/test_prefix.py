"""Prefix caching (app/partitions/prefix.py): a prompt prefix one batch computed is reused by later
batches, stage by stage, and what they decode is what they decode without it: every family, one and
two stages, rows with and without a hit in one batch, a stage that misses behind one that hits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from families import CONFIGS, VOCAB

from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad
from app.partitions.loading import load_config
from app.partitions.prefix import BLOCK, Hit, Prefill, PrefixCache, digests, plan

SYSTEM = [(i * 7) % (VOCAB - 3) + 3 for i in range(2 * BLOCK + 5)]  # 37 tokens: two whole blocks
WARM = [SYSTEM + [11, 12, 13, 14]]
BATCH = [
    SYSTEM + [21, 22, 23],  # shares 32 tokens with WARM
    SYSTEM + [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42],  # a longer tail
    [5, 6, 7, 8, 9],  # no hit, shorter than the step
    SYSTEM + [11, 12, 13, 14],  # WARM again
]
STEPS = 6


def _layers(count: int = 2, heads: int = 2, length: int = 48, dim: int = 4) -> list[torch.Tensor]:
    return [torch.randn(heads, length, dim) for _ in range(count)]


def test_the_longest_cached_prefix_is_found_and_one_token_is_always_left_to_compute() -> None:
    cache = PrefixCache(2**20)
    prompt = list(range(3, 3 + 3 * BLOCK))  # three whole blocks
    entry = cache.store(prompt, _layers(), _layers(), None)
    assert entry is not None and entry.length == 3 * BLOCK
    hit = cache.lookup(prompt[: 2 * BLOCK + 3])
    assert hit is not None and hit.entry is entry and hit.length == 2 * BLOCK
    assert cache.lookup(prompt).length == 2 * BLOCK  # type: ignore[union-attr]  # the last token is computed
    assert cache.lookup(prompt + [1]).length == 3 * BLOCK  # type: ignore[union-attr]
    assert cache.lookup([9] + prompt) is None  # a prefix, not any substring
    assert cache.lookup(prompt[:BLOCK]) is None  # nothing left to compute after the block


def test_a_digest_that_names_other_tokens_is_a_miss() -> None:
    cache = PrefixCache(2**20)
    stored = list(range(3, 3 + BLOCK))
    entry = cache.store(stored, _layers(length=BLOCK), _layers(length=BLOCK), None)
    assert entry is not None
    other = list(range(100, 100 + BLOCK)) + [1]
    cache._names[digests(other, 1)[0]] = entry  # as if two prefixes had the same digest
    assert cache.lookup(other) is None


def test_entries_are_evicted_least_recently_used_under_the_budget() -> None:
    one = 2 * 2 * (2 * 2 * BLOCK * 4 * 4)  # keys and values of two layers, [2, 32, 4] fp32
    cache = PrefixCache(2 * one)
    prompts = [[k] * (2 * BLOCK) for k in (3, 4, 5)]
    for prompt in prompts[:2]:
        cache.store(prompt, _layers(length=2 * BLOCK), _layers(length=2 * BLOCK), None)
    assert cache.lookup(prompts[0] + [1]) is not None  # 3 is now the most recently used
    cache.store(prompts[2], _layers(length=2 * BLOCK), _layers(length=2 * BLOCK), None)
    assert len(cache) == 2 and cache.nbytes == 2 * one
    assert cache.lookup(prompts[1] + [1]) is None  # the least recently used went
    assert cache.lookup(prompts[0] + [1]) is not None and cache.lookup(prompts[2] + [1]) is not None
    assert cache.store([6] * BLOCK * 8, _layers(length=8 * BLOCK), _layers(length=8 * BLOCK), None) is None


def test_a_longer_prompt_takes_over_the_blocks_of_a_shorter_one_which_is_freed() -> None:
    cache = PrefixCache(2**20)
    short = list(range(3, 3 + BLOCK))
    first = cache.store(short, _layers(length=BLOCK), _layers(length=BLOCK), None)
    again = cache.store(short + [1], _layers(length=BLOCK), _layers(length=BLOCK), None)
    assert again is first and len(cache) == 1  # already held: nothing copied
    longer = cache.store(short + list(range(50, 50 + BLOCK)), _layers(length=32), _layers(length=32), None)
    assert longer is not None and len(cache) == 1 and cache.nbytes == longer.nbytes
    assert cache.lookup(short + [1]).entry is longer  # type: ignore[union-attr]


def test_the_plan_gives_every_row_one_step_width_and_never_more_than_its_hit() -> None:
    entry = PrefixCache(2**20).store(list(range(3, 3 + 2 * BLOCK)), _layers(), _layers(), None)
    assert entry is not None
    hits: list[Hit | None] = [Hit(entry, 32), Hit(entry, 16), None]
    chosen = plan([40, 30, 5], hits)
    assert chosen.step == 14  # the second row's 30 - 16 tokens
    assert chosen.reused == [26, 16, 0] and chosen.cached == 26
    assert chosen.hits[2] is None
    assert not plan([40, 50], [Hit(entry, 32), None]).saves  # a row with no hit is longest: no reuse
    assert plan([], []).step == 0


def _prefill(
    parts: list[StagePartition], caches: list[PrefixCache | None], prompts: list[list[int]], tag: str = "r"
) -> tuple[list[BatchState], torch.Tensor, list[int]]:
    """A prefill through every stage as the stage runtime runs it; the tokens each stage reused."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    x, mask = left_pad(prompts, pad_id=0)
    states, reused = [], []
    for part, cache in zip(parts, caches, strict=True):
        prefill = Prefill(cache, part, ids, prompts, mask)
        state, step = prefill.start(x)
        x = prefill.finish(state, part(state, step))
        states.append(state)
        reused.append(prefill.reused)
    return states, x, reused


def _decode(
    parts: list[StagePartition], states: list[BatchState], logits: torch.Tensor
) -> list[torch.Tensor]:
    out = [logits]
    for _ in range(STEPS):
        h = out[-1].argmax(-1)[:, None]
        for part, state in zip(parts, states, strict=True):
            state.extend(1)
            h = part(state, h)
        out.append(h)
    return out


def _parts(model: Any, stages: int) -> list[StagePartition]:
    """Stages over a model of the test's own (a stage changes its model's attention setting)."""
    layers = model.config.num_hidden_layers
    return [StagePartition(model, LayerRange.even_split(layers, stages, s)).eval() for s in range(stages)]


def _loaded(path: Path, stages: int) -> list[StagePartition]:
    """Stages loaded from a saved model, as a worker loads them."""
    layers = load_config(path).num_hidden_layers
    return [StagePartition.load(path, LayerRange.even_split(layers, stages, s)) for s in range(stages)]


def _sliding(config: Any) -> bool:
    return bool(getattr(config, "sliding_window", None)) and (
        getattr(config, "use_sliding_window", True) or "sliding_attention" in (config.layer_types or [])
    )


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("name", [*CONFIGS, "gemma3-wide-window"])
def test_a_batch_that_reuses_prefixes_decodes_as_it_does_without_them(
    family_models: dict[str, tuple[Path, Any]], name: str, stages: int
) -> None:
    if name == "gemma3-wide-window":  # sliding layers whose window holds the prompts: they reuse too
        config = tf.Gemma3TextConfig(**{**CONFIGS["gemma3"].to_dict(), "sliding_window": 64})
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config).eval()
        parts = _parts(model, stages)
    else:
        parts = _loaded(family_models[name][0], stages)
        model = parts[0]
    _, expected_first, _ = _prefill(parts, [None] * stages, BATCH)
    expected = _decode(parts, _prefill(parts, [None] * stages, BATCH)[0], expected_first)

    caches: list[PrefixCache | None] = [PrefixCache(2**26) for _ in parts]
    _prefill(parts, caches, WARM)
    states, first, reused = _prefill(parts, caches, BATCH)
    got = _decode(parts, states, first)

    window = getattr(model.config, "sliding_window", None)
    if _sliding(model.config) and window < len(SYSTEM):
        assert reused == [0] * stages  # a sliding layer no longer holds the prompt whole: no entry
    else:
        # rows 0, 1 and 3 hit 32 tokens; every row computes the longest remainder, row 1's 17
        assert reused == [sum(max(0, len(p) - 17) for p in BATCH)] * stages
    for step, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist(), f"step {step}"
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4, msg=f"step {step}")


def test_a_stage_that_misses_computes_from_the_whole_prompt_the_stage_before_it_reused(
    family_models: dict[str, tuple[Path, Any]],
) -> None:
    """Stage 0 hits, stage 1 (restarted: an empty cache) does not: stage 0 sends the reused tokens'
    hidden states from its entry, and stage 1 computes them as if nothing had been reused."""
    parts = _loaded(family_models["llama"][0], 2)
    expected_states, expected_first, _ = _prefill(parts, [None, None], BATCH)
    expected = _decode(parts, expected_states, expected_first)
    warm = PrefixCache(2**26)
    _prefill(parts, [warm, PrefixCache(2**26)], WARM)
    states, first, reused = _prefill(parts, [warm, PrefixCache(2**26)], BATCH)
    assert reused[0] > 0 and reused[1] == 0
    for ours, theirs in zip(_decode(parts, states, first), expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_batch_that_reused_a_prefix_joins_and_leaves_like_any_other(
    family_models: dict[str, tuple[Path, Any]],
) -> None:
    """A reusing batch's cache is narrower than a whole prefill's (its leading padding is never
    made): joining a running batch and losing a row still decodes as the uncached batch does."""
    parts = _loaded(family_models["llama"][0], 1)
    cache = PrefixCache(2**26)
    _prefill(parts, [cache], WARM)
    results = []
    for caches in ([None], [cache]):
        host, logits, _ = _prefill(parts, [None], [[5, 6, 7]], tag="h")
        joiner, first, _ = _prefill(parts, caches, BATCH[:2], tag="j")
        host[0].absorb(joiner[0])
        host[0].keep(["h0", "j1"])
        results.append(_decode(parts, host, torch.cat([logits, first])[[0, 2]]))
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
