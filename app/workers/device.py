"""What a GPU stage worker reports about its device with each heartbeat (shown by /readyz).

NVML (the `nvidia-ml-py` package, imported as `pynvml`) gives memory, utilisation and temperature;
without it, torch still gives the memory. On the CPU there is nothing to report.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

# Where torch's oneDNN (CPU) backend reads the capacity of its kernel caches: a primitive cache and
# ideep's, one entry a matmul shape each, read from the environment once, at the first kernel.
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
# Kernels kept in each: one a matmul shape, about 0.6 MB together for a small model. At oneDNN's own
# 1,024 a CPU stage worker grows towards ~0.65 GB of them as new prompt shapes come, slowly; a decode
# step's shapes are a handful, so a smaller cache misses only on one-off prefill shapes.
KERNEL_CACHE_ENTRIES = 256


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Cap each of oneDNN's kernel caches at `entries`. A worker calls it before its first kernel
    runs; later calls change nothing."""
    for name in KERNEL_CACHES:
        os.environ[name] = str(entries)


def device_stats(device: str) -> dict[str, Any] | None:
    """Memory (MiB), utilisation (%) and temperature (°C) of `cuda:N`; None for the CPU."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    index = int(device.partition(":")[2] or 0)
    stats: dict[str, Any] = {"device": device, "name": torch.cuda.get_device_name(index), "at": time.time()}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        stats["memory_used_mib"] = memory.used / 2**20
        stats["memory_total_mib"] = memory.total / 2**20
        stats["utilization_pct"] = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        stats["temperature_c"] = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    except Exception:  # no NVML: torch still knows the memory
        free, total = torch.cuda.mem_get_info(index)
        stats["memory_used_mib"] = (total - free) / 2**20
        stats["memory_total_mib"] = total / 2**20
    return stats
