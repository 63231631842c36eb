"""Precision: what `auto` picks, bf16 stages that agree with HF's bf16 `generate`, and memory plans
that hold what the workers hold."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from families import CONFIGS
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from app.partitions import planner
from app.partitions.layers import BatchState, LayerRange, StagePartition, left_pad
from app.partitions.precision import cpu_bf16_flags, resolve_dtype

STEPS = 32  # per prompt: 128 teacher-forced steps a family, positions well past every window


def test_explicit_dtypes_are_taken_as_given_and_unknown_ones_refused() -> None:
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cuda:0") == torch.float16
    with pytest.raises(ValueError, match="auto, float32"):
        resolve_dtype("int8", "cpu")


def test_auto_on_a_cpu_follows_its_native_bf16_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 avx512f\n")
    assert cpu_bf16_flags(cpuinfo) == set()
    assert resolve_dtype("auto", "cpu", cpuinfo=cpuinfo) == torch.float32
    cpuinfo.write_text("processor : 0\nflags : fpu avx512f avx512_bf16 amx_bf16\n")
    assert cpu_bf16_flags(cpuinfo) == {"avx512_bf16", "amx_bf16"}
    assert resolve_dtype("auto", "cpu", cpuinfo=cpuinfo) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", cpuinfo=tmp_path / "absent") == torch.float32


def test_auto_is_the_same_at_every_start_on_a_busy_machine() -> None:
    """Fresh processes decide while every core is kept busy: the choice never turns (a timed choice
    picked bf16 at one start and fp32 at the next beside a starting stack)."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)
    ]
    probe = "from app.partitions.precision import resolve_dtype as r; print(r('auto', 'cpu'))"
    try:  # three starts at once, beside the burners: each the busier for the others
        starts = [
            subprocess.Popen(
                [sys.executable, "-c", probe],
                stdout=subprocess.PIPE,
                text=True,
                cwd=Path(__file__).resolve().parents[2],
            )
            for _ in range(3)
        ]
        choices = {start.communicate()[0].strip() for start in starts}
        assert [start.returncode for start in starts] == [0, 0, 0]
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    expected = "torch.bfloat16" if cpu_bf16_flags() else "torch.float32"
    assert choices == {expected}


PROMPTS = [
    [8, 9, 10, 11, 12, 13, 14, 15],
    [20, 21, 22],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
    [60, 61, 62],
]


def _agreement(path: Path) -> float:
    """Teacher-forced along HF's own bf16 greedy path, STEPS per prompt: the share of steps where
    the bf16 stages pick HF's token. The reference is loaded as a user loads a bf16 model
    (`from_pretrained(dtype=bfloat16)`: rotary tables stay fp32; casting a loaded fp32 model with
    `.to(bfloat16)` would round them and flip ~1% of near-tied steps of its own)."""
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    parts = [
        StagePartition.load(path, LayerRange.even_split(6, 2, s), dtype=torch.bfloat16) for s in range(2)
    ]
    agree = total = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        path_tokens = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
        x, mask = left_pad([prompt], pad_id=0)
        states = [BatchState(parts[0].config, ["a"], mask.clone()) for _ in parts]
        for step, expected in enumerate(path_tokens):
            if step:
                for state in states:
                    state.extend(1)
                x = torch.tensor([[path_tokens[step - 1]]])
            h = x
            for part, state in zip(parts, states, strict=True):
                h = part(state, h)
            agree += int(h.argmax(-1)[0]) == expected
            total += 1
    return agree / total


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_stages_agree_with_hf_bf16_generate(
    family_models: dict[str, tuple[Path, Any]], name: str
) -> None:
    path, _ = family_models[name]
    assert _agreement(path) >= 0.99


def test_bf16_stage_holds_about_half_the_fp32_parameter_bytes(tiny_model: Path) -> None:
    fp32 = StagePartition.load(tiny_model, LayerRange(0, 2), dtype=torch.float32)
    bf16 = StagePartition.load(tiny_model, LayerRange(0, 2), dtype=torch.bfloat16)
    assert bf16.param_bytes() <= 0.52 * fp32.param_bytes()
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}


@pytest.mark.slow
def test_plan_in_bf16_matches_what_the_workers_hold(smollm2_dir: Path, tmp_path: Path) -> None:
    """`conveyor plan --dtype bfloat16` for SmolLM2 in 2 stages vs the loaded stages' parameter bytes."""
    from app.cli import cli

    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli, ["plan", "--model", str(smollm2_dir), "--stages", "2", "--dtype", "bfloat16", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    plan = planner.Plan.from_json(out.read_text())
    for stage, (start, stop) in zip(plan.stages, plan.ranges(), strict=True):
        part = StagePartition.load(smollm2_dir, LayerRange(start, stop), dtype=torch.bfloat16)
        assert abs(part.param_bytes() - stage.param_bytes) <= 0.02 * part.param_bytes()


def test_plan_refuses_an_unsupported_architecture(tmp_path: Path) -> None:
    from transformers import FalconConfig

    from app.cli import cli

    FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4).save_pretrained(tmp_path)
    result = CliRunner().invoke(cli, ["plan", "--model", str(tmp_path), "--stages", "1"])
    assert result.exit_code == 2
    assert "falcon" in result.output and "supported model types" in result.output


@pytest.mark.slow
def test_the_smollm2_bf16_stages_answer_the_france_question(smollm2_dir: Path) -> None:
    """SmolLM2 in bf16, two stages as workers load them: greedy says Paris."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    parts = [
        StagePartition.load(smollm2_dir, LayerRange.even_split(30, 2, s), dtype=torch.bfloat16)
        for s in range(2)
    ]
    x, mask = left_pad([prompt], pad_id=0)
    states = [BatchState(parts[0].config, ["a"], mask.clone()) for _ in parts]
    out: list[int] = []
    for step in range(12):
        if step:
            for state in states:
                state.extend(1)
            x = torch.tensor([[out[-1]]])
        h = x
        for part, state in zip(parts, states, strict=True):
            h = part(state, h)
        out.append(int(h.argmax(-1)[0]))
    assert "Paris" in tokenizer.decode(out)
