"""Linear weights packed for oneDNN: the same numbers bit for bit, only where supported, counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from app.partitions import packing
from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad
from tests.tiny import make_tiny_model

BF16 = packing.supported(torch.bfloat16, torch.device("cpu"))
needs_bf16 = pytest.mark.skipif(not BF16, reason="this CPU's oneDNN has no bf16 linear kernels")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("packing") / "tiny", layers=2)


def steps(stage: StagePartition, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits of a prefill and three greedy decode steps."""
    ids, mask = left_pad(prompts, 0)
    state = BatchState(stage.config, [str(i) for i in range(len(prompts))], mask)
    out = [stage(state, ids)]
    for _ in range(3):
        state.extend(1)
        out.append(stage(state, out[-1].argmax(-1)[:, None]))
    return out


@needs_bf16
def test_a_packed_stage_computes_exactly_what_the_unpacked_one_does(tiny: Path) -> None:
    packed = StagePartition.load(tiny, dtype=torch.bfloat16)
    plain = StagePartition.load(tiny, dtype=torch.bfloat16, pack=False)
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert isinstance(packed.lm_head, packing.PackedLinear)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    for a, b in zip(steps(packed, prompts), steps(plain, prompts), strict=True):
        assert torch.equal(a, b)


@needs_bf16
def test_a_middle_stage_packs_too_and_its_weights_are_counted(tiny: Path) -> None:
    first = StagePartition.load(tiny, LayerRange(0, 1), dtype=torch.bfloat16)
    plain = StagePartition.load(tiny, LayerRange(0, 1), dtype=torch.bfloat16, pack=False)
    assert packing.packed_bytes(first) > 0
    assert first.param_bytes() == plain.param_bytes()  # the packed weights replace the plain ones
    # A head tied to the embedding gets its own packed copy, and it is counted.
    whole = StagePartition.load(tiny, dtype=torch.bfloat16)
    whole_plain = StagePartition.load(tiny, dtype=torch.bfloat16, pack=False)
    head = whole_plain.lm_head.weight  # type: ignore[union-attr]
    assert whole.param_bytes() == whole_plain.param_bytes() + head.numel() * head.element_size()


def test_fp32_and_other_devices_are_left_as_they_are(tiny: Path) -> None:
    assert not packing.supported(torch.float32, torch.device("cpu"))
    assert not packing.supported(torch.bfloat16, torch.device("meta"))
    stage = StagePartition.load(tiny)
    assert packing.packed_bytes(stage) == 0
    assert isinstance(stage.lm_head, nn.Linear)
