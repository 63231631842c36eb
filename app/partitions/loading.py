"""Load one stage's partition and nothing else: memory proportional to the partition.

The model is built on the `meta` device (no weights allocated), the stage keeps only its own
modules, those are materialized on the target device, and only their tensors are read from the
safetensors files (memory-mapped, one tensor at a time). Two facts about Llama-family checkpoints
shape this (DESIGN.md §8): the LM head is usually tied to the embedding and not stored, so a last
stage that does not also hold the embedding reads the embedding tensor for its head; and the
rotary `inv_freq` buffer is not persistent, so it is rebuilt rather than loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

EMBEDDING = "model.embed_tokens.weight"


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (single file or sharded with an index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no safetensors weights in {path}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def checkpoint_name(local: str, *, start: int, tied_head: bool) -> str:
    """The checkpoint tensor behind one of a stage's own parameter names."""
    head, _, rest = local.partition(".")
    if head == "layers":
        index, _, tail = rest.partition(".")
        return f"model.layers.{start + int(index)}.{tail}"
    if head in ("embed_tokens", "norm"):
        return f"model.{local}"
    if head == "lm_head":
        return EMBEDDING if tied_head else local
    raise KeyError(f"unexpected stage parameter {local!r}")


def build_on_meta(path: Path, dtype: torch.dtype) -> Any:
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def materialize(
    stage: nn.Module, path: Path, *, start: int, device: torch.device, dtype: torch.dtype, tied_head: bool
) -> None:
    """Allocate the stage's own parameters on `device` and fill them from the checkpoint."""
    stage.to_empty(device=device)
    files = checkpoint_files(Path(path))
    handles: dict[Path, Any] = {}
    try:
        for local, param in stage.named_parameters():
            name = checkpoint_name(local, start=start, tied_head=tied_head)
            if name not in files and name == "lm_head.weight":
                name = EMBEDDING  # a head the checkpoint does not store is the tied embedding
            file = files[name]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt", device="cpu")
            with torch.no_grad():
                param.copy_(handles[file].get_tensor(name).to(dtype))
    finally:
        handles.clear()
