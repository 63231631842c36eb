"""Stages on CUDA: the same code path as on the CPU, checked against transformers on the same device.

Skipped without CUDA: run `pytest -m gpu tests/gpu` on a GPU machine. The real
models are used where they are in the project's model store (`.conveyor/models`, put there by
`conveyor model pull` / `conveyor model add`); every family's tiny model always runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, SMOLLM2
from families import CONFIGS
from transformers import AutoModelForCausalLM

from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad
from app.partitions.precision import resolve_dtype

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

GEMMA3 = "gemma-3-270m"
STEPS = 32


def devices(stages: int) -> list[str]:
    """Stage k on GPU k mod N, as `CONVEYOR_DEVICE=auto` places them."""
    return [f"cuda:{k % torch.cuda.device_count()}" for k in range(stages)]


def greedy(parts: list[StagePartition], prompt: list[int], steps: int) -> list[int]:
    x, mask = left_pad([prompt], pad_id=0)
    states = [BatchState(parts[0].config, ["a"], mask.clone()) for _ in parts]
    out: list[int] = []
    for step in range(steps):
        if step:
            for state in states:
                state.extend(1)
            x = torch.tensor([[out[-1]]])
        h = x
        for part, state in zip(parts, states, strict=True):
            h = part(state, h)
        out.append(int(h.argmax(-1)[0]))
    return out


def reference(path: Path, prompt: list[int], steps: int, dtype: torch.dtype) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda:0").eval()
    ids = torch.tensor([prompt], device="cuda:0")
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        eos_token_id=None,
    )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def load(path: Path, stages: int, dtype: torch.dtype, compile_setting: str = "off") -> list[StagePartition]:
    from transformers import AutoConfig

    count = int(AutoConfig.from_pretrained(path).num_hidden_layers)
    parts = [
        StagePartition.load(path, LayerRange.even_split(count, stages, s), dtype=dtype, device=device)
        for s, device in enumerate(devices(stages))
    ]
    for part in parts:
        part.use_static(compile_setting)
    return parts


def real_model(name: str) -> Path:
    path = ROOT / ".conveyor" / "models" / name
    if not (path / "config.json").exists():
        pytest.skip(f"{name} is not in {path.parent} (conveyor model add / pull it first)")
    return path


def test_auto_picks_bf16_or_fp16_on_a_gpu() -> None:
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert resolve_dtype("auto", "cuda:0") == expected


@pytest.mark.parametrize("compile_setting", ["off", "auto"])  # auto: decode steps as CUDA graphs
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_family_on_cuda_matches_generate_in_fp32(
    family_models: dict[str, tuple[Path, Any]], name: str, stages: int, compile_setting: str
) -> None:
    path, _ = family_models[name]
    prompt = [8, 9, 10, 11, 12, 13, 14, 15]
    parts = load(path, stages, torch.float32, compile_setting)
    assert greedy(parts, prompt, STEPS) == reference(path, prompt, STEPS, torch.float32)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("name", [SMOLLM2, GEMMA3])
def test_real_models_on_cuda_match_generate(name: str, stages: int) -> None:
    """Greedy through 1 and 2 stages (two GPUs where there are two) equals `generate` on the GPU, in
    the dtype `auto` picks there."""
    from transformers import AutoTokenizer

    path = real_model(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer("The capital of France is").input_ids
    dtype = resolve_dtype("auto", "cuda:0")
    parts = load(path, stages, dtype, "auto")
    assert all(p.device.type == "cuda" for p in parts)
    assert greedy(parts, prompt, STEPS) == reference(path, prompt, STEPS, dtype)


def test_a_two_stage_pipeline_hands_hidden_states_between_devices(
    family_models: dict[str, tuple[Path, Any]],
) -> None:
    """Stage 0 and stage 1 on different GPUs (or both on one): the KV cache lives on each stage's
    device, preallocated there, and the hand-off moves the hidden states."""
    path, _ = family_models["llama"]
    parts = load(path, 2, torch.float32)
    x, mask = left_pad([[5, 6, 7], [8, 9]], pad_id=0)
    states = [BatchState(parts[0].config, ["a", "b"], mask.clone()) for _ in parts]
    h = parts[0](states[0], x)
    assert h.device == parts[0].device
    logits = parts[1](states[1], h)
    assert logits.device == parts[1].device
    first = parts[1].range.start
    assert states[1].slabs[first].keys.device == parts[1].device
