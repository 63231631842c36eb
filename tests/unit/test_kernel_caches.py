"""A CPU worker's oneDNN kernel caches stay bounded: one compiled kernel a matmul shape, each new
prompt shape adds one, and at oneDNN's own default (1,024 each) a stage worker grew towards ~0.65 GB."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch

from app.partitions.packing import supported

SHAPES = 400
PROBE = f"""
import ctypes, torch
from app.partitions.packing import PackedLinear
from app.workers.device import bound_kernel_caches

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "a b c d e f g used free keep".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
bound_kernel_caches(32)
torch.set_num_threads(1)
linear = PackedLinear(torch.nn.Linear(64, 128).to(torch.bfloat16))  # a bf16 stage's linear layers
with torch.inference_mode():
    linear(torch.ones(1, 64, dtype=torch.bfloat16))
    before = libc.mallinfo2().used
    for rows in range(2, {SHAPES}):  # a new shape each: what prefills of new prompt lengths bring
        linear(torch.ones(rows, 64, dtype=torch.bfloat16))
print((libc.mallinfo2().used - before) / 2**20)
"""


def has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(
    not has_mallinfo2() or not supported(torch.bfloat16, torch.device("cpu")), reason="glibc, oneDNN bf16"
)
def test_kernels_of_new_shapes_do_not_grow_the_heap_past_the_cap() -> None:
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    grown_mib = float(probe.stdout)
    # 32 kernels a cache (a few tens of MiB); unbounded, the 400 shapes kept ~225 MiB.
    assert grown_mib < 64, f"{SHAPES} matmul shapes grew the heap by {grown_mib:.0f} MiB"
