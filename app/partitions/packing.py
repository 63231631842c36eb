"""bf16 linear layers on a CPU with their weights packed once, at load, into oneDNN's layout.

`nn.Linear` hands a plain row-major weight to the matrix product at every call, and on a CPU the
product re-blocks it each time; a decode step of a small batch is one read of every weight, so
that overhead is most of the step. oneDNN can block a weight once (`_reorder_linear_weight`) and
multiply by the blocked copy from then on (`_linear_pointwise`): the same kernel, so the same
numbers, bit for bit (the tests check it), and faster — one thread, SmolLM2's shapes, bf16:
1.8x at batch 1 (the 49152 x 576 head: 3.3 -> 1.4 ms), 1.1x at batch 64 (`bench/engine.py`
at commit dc23406 timed whole steps). This is what PyTorch's own compiler does to linear layers when
it freezes a model for a CPU; here it is done without compiling.

Only where it pays and is supported: bf16 on a CPU whose oneDNN has bf16 kernels. fp32 gains
nothing measurable (0.050 against 0.051 ms) and stays as it is. A packed weight replaces the
layer's own; a language-model head tied to the embedding gets a packed copy (the embedding keeps
its table), which `packed_bytes` counts.
"""

from __future__ import annotations

import torch
from torch import nn


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN bf16 linear kernels on this CPU."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and bool(ops._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """A linear layer whose weight is held blocked for oneDNN; y = x W^T + b, as `nn.Linear`."""

    packed: torch.Tensor  # [out, in], oneDNN's blocked layout

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # [out, in] blocked; the batch-size hint only picks a layout, any batch runs against it
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, 1), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


@torch.inference_mode()
def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear`; the number replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child))
            replaced += 1
        else:
            replaced += pack_linears(child)
    return replaced


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the packed weights under `module` (buffers that `parameters()` does not list)."""
    total = 0
    for m in module.modules():
        if isinstance(m, PackedLinear):
            total += m.packed.numel() * m.packed.element_size()
    return total
