"""The decode attention path: the same attention as SDPA, through the packed-heads kernel, and only
where it applies (half precision, one query, a CPU); fp32 and prefills are untouched, bit for bit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from app.partitions import attention
from app.partitions.layers import BatchState, StagePartition, left_pad
from tests.tiny import make_tiny_model

MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True)


def qkv(batch: int, queries: int, keys: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 9, queries, 16, generator=g).to(dtype)
    k = torch.randn(batch, 3, keys, 16, generator=g).to(dtype)
    v = torch.randn(batch, 3, keys, 16, generator=g).to(dtype)
    return q, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """fp32 attention with the key/value heads repeated: [B, S, H, D]."""
    repeat = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.float(),
        k.float().repeat_interleave(repeat, 1),
        v.float().repeat_interleave(repeat, 1),
        attn_mask=mask,
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("padded", [False, True])
def test_a_bf16_decode_step_is_sdpa_attention(padded: bool) -> None:
    q, k, v = qkv(4, 1, 20, torch.bfloat16)
    mask = None
    if padded:
        mask = torch.ones(4, 1, 1, 20, dtype=torch.bool)
        mask[1, ..., :7] = False  # a shorter row, left-padded
    assert attention.handles(q, k, mask, 0.0, {})
    out, weights = attention.grouped_attention(MODULE, q, k, v, mask, scaling=16**-0.5)
    assert weights is None
    assert out.shape == (4, 1, 9, 16) and out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out.float(), reference(q, k, v, mask), atol=2e-2, rtol=2e-2)
    if padded:  # the masked keys play no part: changing them changes nothing
        k2, v2 = k.clone(), v.clone()
        k2[1, :, :7], v2[1, :, :7] = 100.0, -100.0
        again, _ = attention.grouped_attention(MODULE, q, k2, v2, mask, scaling=16**-0.5)
        assert torch.equal(again, out)


def test_with_a_mask_it_gives_what_transformers_sdpa_gives() -> None:
    q, k, v = qkv(3, 1, 12, torch.bfloat16)
    mask = torch.ones(3, 1, 1, 12, dtype=torch.bool)
    mask[0, ..., :5] = False
    ours, _ = attention.grouped_attention(MODULE, q, k, v, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(MODULE, q, k, v, mask, scaling=0.25)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    ("dtype", "queries", "extra"),
    [
        (torch.float32, 1, {}),  # fp32: transformers' path, unchanged
        (torch.bfloat16, 5, {}),  # a prefill
        (torch.bfloat16, 1, {"softcap": 30.0}),  # an extra only the other paths know
    ],
)
def test_everything_else_goes_to_transformers_sdpa(dtype: torch.dtype, queries: int, extra: dict) -> None:
    q, k, v = qkv(2, queries, 8, dtype)
    assert not attention.handles(q, k, None, 0.0, extra)
    if extra:
        with pytest.raises(ValueError, match="softcap"):  # SDPA refuses it loudly, and so do we
            attention.grouped_attention(MODULE, q, k, v, None, **extra)
        return
    ours, _ = attention.grouped_attention(MODULE, q, k, v, None, scaling=0.25)
    theirs, _ = sdpa_attention_forward(MODULE, q, k, v, None, scaling=0.25)
    assert torch.equal(ours, theirs)


def test_a_mask_not_over_exactly_the_keys_is_not_taken() -> None:
    q, k, _ = qkv(2, 1, 8, torch.bfloat16)
    assert not attention.handles(q, k, torch.ones(2, 1, 1, 7, dtype=torch.bool), 0.0, {})
    assert not attention.handles(q, k, torch.zeros(2, 1, 1, 8), 0.0, {})  # an additive float mask


def test_only_sdpa_models_are_switched() -> None:
    sdpa, eager = LlamaConfig(), LlamaConfig()
    sdpa._attn_implementation, eager._attn_implementation = "sdpa", "eager"
    attention.use_for(sdpa)
    attention.use_for(eager)
    assert sdpa._attn_implementation == attention.IMPLEMENTATION
    assert eager._attn_implementation == "eager"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("attention") / "tiny", layers=2)


def decode_logits(stage: StagePartition, implementation: str, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill, then three decode steps of the greedy tokens: the last step's logits [B, V]."""
    stage.config._attn_implementation = implementation
    ids, mask = left_pad(prompts, 0)
    state = BatchState(stage.config, [str(i) for i in range(len(prompts))], mask)
    logits = stage(state, ids)
    for _ in range(3):
        state.extend(1)
        logits = stage(state, logits.argmax(-1)[:, None])
    return logits


@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8], [9, 10, 11, 12]], [[5, 6, 7, 8], [9, 10]]])
def test_a_stage_decodes_the_same_through_either_path(tiny: Path, prompts: list[list[int]]) -> None:
    fp32 = StagePartition.load(tiny)
    assert fp32.config._attn_implementation == attention.IMPLEMENTATION  # switched on load
    assert torch.equal(
        decode_logits(fp32, attention.IMPLEMENTATION, prompts), decode_logits(fp32, "sdpa", prompts)
    )
    bf16 = StagePartition.load(tiny, dtype=torch.bfloat16)
    torch.testing.assert_close(
        decode_logits(bf16, attention.IMPLEMENTATION, prompts),
        decode_logits(bf16, "sdpa", prompts),
        atol=5e-2,
        rtol=5e-2,
    )


def test_contiguous_keys_of_enough_rows_go_through_two_matrix_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a wide decode step hands the attention: every column of the cache's buffers (contiguous),
    the ones outside the history masked. Same attention, the masked columns play no part."""
    q, k, v = qkv(attention.WIDE_MIN_ROWS, 1, 24, torch.bfloat16)
    mask = torch.zeros(attention.WIDE_MIN_ROWS, 1, 1, 24, dtype=torch.bool)
    mask[..., 3:17] = True  # the history sits in columns 3..16 of the buffer
    mask[0, ..., 3:9] = False  # a shorter row
    calls = []
    matmul = attention._matmul_attention
    monkeypatch.setattr(attention, "_matmul_attention", lambda *a: calls.append(1) or matmul(*a))
    out, _ = attention.grouped_attention(MODULE, q, k, v, mask, scaling=16**-0.5)
    assert calls == [1]
    torch.testing.assert_close(out.float(), reference(q, k, v, mask), atol=2e-2, rtol=2e-2)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :3], v2[:, :, :3], k2[:, :, 17:], v2[:, :, 17:] = 100.0, -100.0, -100.0, 100.0
    again, _ = attention.grouped_attention(MODULE, q, k2, v2, mask, scaling=16**-0.5)
    assert torch.equal(again, out)
    attention.grouped_attention(MODULE, q[:1], k[:1], v[:1], mask[:1], scaling=16**-0.5)
    assert calls == [1, 1]  # one row: SDPA, faster there


def test_a_wide_decode_step_is_as_close_to_transformers_eager_attention_as_sdpa(tiny: Path) -> None:
    """bf16 decode steps over the cache's whole buffers, past a reallocation, a finished row and a
    joining batch. bf16 attention has no one right answer; the model's own reference is
    transformers' eager attention over the live columns (bf16 scores, fp32 softmax, as the two
    matrix products compute). At every step the wide path is at least as close to it as SDPA over
    the live columns is (what served before; within one bf16 step at these logits, 1/16)."""
    wide = StagePartition.load(tiny, dtype=torch.bfloat16)
    live = StagePartition.load(tiny, dtype=torch.bfloat16)
    live.wide_decode = False
    eager = StagePartition.load(tiny, dtype=torch.bfloat16)
    eager.config._attn_implementation, eager.eager = "eager", True
    stages = (wide, live, eager)
    prompts = [[5, 6, 7, 8, 9], [9, 10], [11, 12, 13], [14], [15, 16, 17, 18, 19, 20]]

    def start(seed: int, rows: list[list[int]]) -> tuple[list[BatchState], torch.Tensor]:
        ids, mask = left_pad(rows, 0)
        states = [BatchState(s.config, [f"{seed}-{i}" for i in range(len(rows))], mask) for s in stages]
        logits = [s(state, ids) for s, state in zip(stages, states, strict=True)]
        return states, logits[2].argmax(-1)

    states, tokens = start(0, prompts)
    widened = 0
    closer = []

    def step() -> None:
        nonlocal tokens, widened
        for state in states:
            state.extend(1)
        widened += bool(wide._wide_slabs(states[0], 1))
        got = wide(states[0], tokens[:, None])
        before = live(states[1], tokens[:, None])
        reference = eager(states[2], tokens[:, None])
        off, off_before = float((got - reference).abs().max()), float((before - reference).abs().max())
        assert off <= off_before + 1 / 16
        closer.append(off < off_before)
        tokens = reference.argmax(-1)

    for _ in range(70):  # past the first buffer's 64 spare columns
        step()
    keep = [states[0].seq_ids[r] for r in (0, 2, 3, 4)]
    for state in states:
        state.keep(keep)
    tokens = tokens[[0, 2, 3, 4]]
    step()
    joining, more = start(1, [[21, 22], [23, 24, 25]])
    for state, other in zip(states, joining, strict=True):
        state.absorb(other)
    tokens = torch.cat([tokens, more])
    for _ in range(3):
        step()
    assert widened == 74
    assert sum(closer) > len(closer) // 2  # mostly strictly closer
