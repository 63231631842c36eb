"""Which dtype a stage serves in: `CONVEYOR_DTYPE` = auto | float32 | bfloat16 | float16.

`auto` picks bf16 on a GPU that supports it and fp16 on an older one. On a CPU it picks bf16 only
where the CPU computes bf16 natively (AVX512-BF16 or AMX) *and* a bf16 matrix product of a decode
step's shape measures faster than fp32 here; else fp32. Without native support PyTorch emulates
bf16 through fp32 conversions and it is slower, not faster. On this project's 2-core AVX512-BF16 test
machine a SmolLM2 decode step at batch 64 took 115 ms in bf16 against 310 ms in fp32
(`bench/precision.py` measures it through the whole stack).

The weights are read straight into the chosen dtype, the KV cache takes the dtype of the keys,
and hidden states travel between stages in it; the planner's `--dtype` defaults to the same choice,
so a plan's memory figures are what the workers hold.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHOICES = ("auto", *DTYPES)
_CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def resolve_dtype(setting: str, device: str) -> torch.dtype:
    """The dtype a stage on `device` ('cpu', 'cuda:N') serves in for this setting."""
    if setting in DTYPES:
        return DTYPES[setting]
    if setting != "auto":
        raise ValueError(f"unknown dtype {setting!r}; choose one of {', '.join(CHOICES)}")
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_bf16_is_faster() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's native bf16 instruction sets (empty where there are none, or no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split()) & _CPU_BF16_FLAGS
    return set()


@functools.cache
def cpu_bf16_is_faster() -> bool:
    """Native bf16, and a [64, 1024] x [1024, 4096] product (a decode step's MLP) faster in bf16."""
    if not cpu_bf16_flags():
        return False
    return _matmul_s(torch.bfloat16) < 0.8 * _matmul_s(torch.float32)


def _matmul_s(dtype: torch.dtype, repeats: int = 8) -> float:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 1024, generator=generator).to(dtype)
    b = torch.randn(1024, 4096, generator=generator).to(dtype)
    torch.mm(a, b)  # the first call pays for the kernel's set-up
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        timings.append(time.perf_counter() - started)
    return sorted(timings)[len(timings) // 2]
