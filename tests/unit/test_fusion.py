"""q/k/v and gate/up projections fused at load: the same numbers, the separate weights freed, only
where it pays unless asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from app.partitions import fusion, packing
from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad
from tests.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fusion") / "tiny", layers=2)


def steps(stage: StagePartition, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits of a prefill and three greedy decode steps."""
    ids, mask = left_pad(prompts, 0)
    state = BatchState(stage.config, [str(i) for i in range(len(prompts))], mask)
    out = [stage(state, ids)]
    for _ in range(3):
        state.extend(1)
        out.append(stage(state, out[-1].argmax(-1)[:, None]))
    return out


def linears(stage: StagePartition) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, m in stage.named_modules() if type(m) is nn.Linear})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_stage_computes_what_the_separate_one_does_with_the_same_bytes(
    tiny: Path, dtype: torch.dtype
) -> None:
    fused = StagePartition.load(tiny, dtype=dtype, fuse=True, pack=False)
    plain = StagePartition.load(tiny, dtype=dtype, fuse=False, pack=False)
    assert linears(plain) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "lm_head",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert linears(fused) == ["down_proj", "gate_up_proj", "linear", "lm_head", "o_proj"]  # linear: q/k/v
    assert [type(layer.mlp) for layer in fused.layers] == [fusion.GatedMLP] * 2
    assert fused.param_bytes() == plain.param_bytes()  # the separate weights are gone, not kept beside
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    for a, b in zip(steps(fused, prompts), steps(plain, prompts), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_bf16_on_a_cpu_fuses_by_default_with_the_same_numbers_and_fp32_does_not(tiny: Path) -> None:
    bf16 = StagePartition.load(tiny, dtype=torch.bfloat16)
    fp32 = StagePartition.load(tiny, LayerRange(0, 1), dtype=torch.float32)
    assert any(isinstance(m, fusion.Fused) for m in bf16.modules())
    assert not any(isinstance(m, fusion.Fused | fusion.GatedMLP) for m in fp32.modules())
    if packing.supported(torch.bfloat16, torch.device("cpu")):  # the fused weights are packed too
        assert isinstance(bf16.layers[0].self_attn.qkv_proj.linear, packing.PackedLinear)
        assert isinstance(bf16.layers[0].mlp.gate_up_proj, packing.PackedLinear)
    separate = StagePartition.load(tiny, dtype=torch.bfloat16, fuse=False)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    for a, b in zip(steps(bf16, prompts), steps(separate, prompts), strict=True):
        assert torch.equal(a, b)  # each output column is the same product over the same inputs


def test_a_member_called_with_another_input_runs_the_product_again() -> None:
    torch.manual_seed(0)
    q, k = nn.Linear(8, 4), nn.Linear(8, 2)
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = q, k, nn.Linear(8, 2)
    expected_q = q.weight.detach().clone(), q.bias.detach().clone()
    assert fusion.fuse(parent) == 1
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        first = parent.q_proj(x)
        other = parent.k_proj(y)  # not x: never a column of x's product
        torch.testing.assert_close(first, x @ expected_q[0].T + expected_q[1])
        torch.testing.assert_close(other, y @ k.weight.T + k.bias)
