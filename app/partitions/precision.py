"""Which dtype a stage serves in: `CONVEYOR_DTYPE` = auto | float32 | bfloat16 | float16.

`auto` picks bf16 on a GPU that supports it and fp16 on an older one. On a CPU it picks bf16
where the CPU computes bf16 natively (AVX512-BF16 or AMX), else fp32: without native support
PyTorch emulates bf16 through fp32 conversions and it is slower, not faster. The choice is read from
the CPU's flags, never timed: a timing taken at worker start beside the other processes of a
starting stack flipped between bf16 and fp32 from one start to the next on the same machine.
`bench/precision.py` (at commit 57abc94) measured both through the whole stack.

The weights are read straight into the chosen dtype, the KV cache takes the dtype of the keys,
and hidden states travel between stages in it; the planner's `--dtype` defaults to the same choice,
so a plan's memory figures are what the workers hold.
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHOICES = ("auto", *DTYPES)
_CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


CPUINFO = Path("/proc/cpuinfo")


def resolve_dtype(setting: str, device: str, *, cpuinfo: Path = CPUINFO) -> torch.dtype:
    """The dtype a stage on `device` ('cpu', 'cuda:N') serves in for this setting; on a CPU, `auto`
    follows the flags in `cpuinfo`."""
    if setting in DTYPES:
        return DTYPES[setting]
    if setting != "auto":
        raise ValueError(f"unknown dtype {setting!r}; choose one of {', '.join(CHOICES)}")
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_bf16_flags(cpuinfo) else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_bf16_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's native bf16 instruction sets (empty where there are none, or no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split()) & _CPU_BF16_FLAGS
    return set()
