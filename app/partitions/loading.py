"""Load one stage's partition and nothing else: memory proportional to the partition.

The model is built on the `meta` device (no weights allocated), the stage keeps only its own
modules, those are materialized on the target device in the serving dtype, and only their
tensors are read from the safetensors files (memory-mapped, one tensor at a time, converted to the
parameter's dtype as it is copied in: no full-precision copy of the model is ever held).

Checkpoints do not always store a parameter under the name the module has:
- the LM head is usually tied to the embedding and not stored, so a last stage that does not
  also hold the embedding reads the embedding tensor for its head;
- transformers fuses the experts of MoE families into 3-D tensors (`mlp.experts.gate_up_proj`
  [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) while checkpoints store each expert's matrices;
  they are stacked here, expert by expert, as the family table says (`Family.experts`);
- some checkpoints were saved from the base model, without its prefix (GPT-2's `h.0...`).
Non-persistent buffers are not in a checkpoint at all: they are rebuilt by `rebuild_buffers`,
and one without a rule refuses the model rather than run with garbage in it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from app.core import modelstore
from app.core.errors import UnsupportedModel
from app.partitions.families import Family, family_for

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")  # the two the stage builds masks for
_LAYER = re.compile(r"^(?P<prefix>.*\.\d+)\.(?P<tail>.+)$")


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (single file or sharded with an index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no safetensors weights in {path}")
    modelstore.safetensors_header(single)  # refuses a file that is not one (a git-lfs pointer...)
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_config(path: Path) -> Any:
    """The model's config, refused (before any weight is read) when its family is not supported."""
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:  # a model type this transformers does not know, a bad config
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedModel(f"transformers cannot read the config of {path}: {first}") from exc
    family_for(config)
    return config


def check_servable(path: Path) -> Any:
    """The model's config, once everything that can be known without reading a weight says the
    stages can serve it; else `UnsupportedModel` saying why: its family (the config), weight files
    that are all there and are safetensors (their headers), an LM head of its own or tied to the
    embedding. Who calls: a stage worker before it loads anything, and the API before it accepts a
    job for a model."""
    config = load_config(path)
    missing = modelstore.missing_weights(path)
    if missing:
        raise UnsupportedModel(f"{path} lacks its safetensors weights: {', '.join(missing)}")
    modelstore.check_head(path, config)
    return config


def build_on_meta(path: Path, dtype: torch.dtype) -> Any:
    config = load_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    implementation = model.config._attn_implementation
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise UnsupportedModel(f"attention implementation {implementation!r} is not supported")
    return model


class Checkpoint:
    """Reads named tensors from a model directory's safetensors files, one at a time."""

    def __init__(self, path: Path) -> None:
        self.files = checkpoint_files(Path(path))
        self._handles: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str) -> torch.Tensor:
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file].get_tensor(name)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._handles.clear()


@torch.no_grad()
def fill(
    param: torch.Tensor, name: str, checkpoint: Checkpoint, family: Family, *, fallbacks: list[str]
) -> None:
    """Copy the checkpoint's tensor for the full-model parameter `name` into `param`."""
    for candidate in (name, *fallbacks):
        if candidate in checkpoint:
            _copy(param, checkpoint.read(candidate), candidate)
            return
    match = _LAYER.match(name)
    if match is not None and _fill_legacy(param, match["prefix"], match["tail"], checkpoint, family):
        return
    raise UnsupportedModel(
        f"the checkpoint has no tensor for parameter {name!r} (nor {fallbacks}); "
        "it was not saved by a supported transformers model of this family"
    )


def _fill_legacy(param: torch.Tensor, prefix: str, tail: str, checkpoint: Checkpoint, family: Family) -> bool:
    for ours, theirs in family.renames:
        if tail == ours and f"{prefix}.{theirs}" in checkpoint:
            _copy(param, checkpoint.read(f"{prefix}.{theirs}"), f"{prefix}.{theirs}")
            return True
    if family.experts is None:
        return False
    gate, up, down = (f"{prefix}.{pattern}" for pattern in family.experts)
    if tail == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows then up rows, per expert
        for e in range(param.shape[0]):
            g, u = checkpoint.read(gate.format(e=e)), checkpoint.read(up.format(e=e))
            _copy(param[e], torch.cat([g, u], dim=0), gate.format(e=e))
        return True
    if tail == "mlp.experts.down_proj":  # [E, H, I]
        for e in range(param.shape[0]):
            _copy(param[e], checkpoint.read(down.format(e=e)), down.format(e=e))
        return True
    return False


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise UnsupportedModel(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    param.copy_(tensor.to(param.dtype))


def rebuild_buffers(stage: nn.Module, config: Any, device: torch.device, rotary_names: set[str]) -> None:
    """Give every non-persistent buffer its value: they are not in checkpoints, and `to_empty` left
    them as uninitialised memory (Gemma's `embed_scale` read as garbage made a worker emit token 0).

    Rotary tables are rebuilt by constructing their module again (their constructors compute them
    from the config); a scaled embedding's scale is set from the scalar it was built with. Any other
    non-persistent buffer has no rule, and the model is refused.
    """
    for module_name, module in list(stage.named_modules()):
        if module_name in rotary_names:
            continue
        for buffer in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            if buffer == "embed_scale" and hasattr(module, "scalar_embed_scale"):
                value = torch.tensor(float(module.scalar_embed_scale), device=device)
                module.register_buffer("embed_scale", value, persistent=False)
            else:
                raise UnsupportedModel(
                    f"{type(module).__name__}.{buffer} is a non-persistent buffer with no rebuild rule; "
                    "this model cannot be served exactly"
                )
    with torch.device(device):
        for name in rotary_names:
            owner, _, attribute = name.rpartition(".")
            parent = stage.get_submodule(owner) if owner else stage
            old = getattr(parent, attribute)
            setattr(parent, attribute, type(old)(config=config))


def check_materialized(stage: nn.Module) -> None:
    """Refuse to run with a tensor still on `meta` or a buffer that is not finite."""
    for name, tensor in [*stage.named_parameters(), *stage.named_buffers()]:
        if tensor.is_meta:
            raise UnsupportedModel(f"stage tensor {name!r} was never loaded (still on the meta device)")
    for name, buffer in stage.named_buffers():
        if buffer.is_floating_point() and not bool(torch.isfinite(buffer).all()):
            raise UnsupportedModel(f"stage buffer {name!r} holds non-finite values after loading")
