"""Projections that read the same input computed as one matrix product: q/k/v, and gate/up.

A layer of a decoder multiplies its normed input by three attention projections and, in a gated
MLP, by two more; five reads of the activations and five kernel calls where two would do. At load,
`fuse` concatenates the weights of each such set once into one linear layer ([Nq + Nk + Nv, D],
[2I, D]; the biases likewise, Qwen2's q/k/v included) and frees the separate ones.

The family's own attention code still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)`: each is now a
`Slice` of the `Fused` product, and the first call with a given input runs it; the others with the
same input take their columns of it (views, no copy), and the product is let go once every member
has its part. A gated MLP (gate, up, down and an activation) becomes a `GatedMLP`: the same
operations in the same order on the fused product's two halves.

Families whose checkpoints already fuse them (Phi-3's `qkv_proj` and `gate_up_proj`, GPT-2's
`c_attn`) have nothing to fuse; MoE experts keep their own (3-D) weights. The layer that results is
an `nn.Linear`, so `app.partitions.packing` packs it like any other where that pays.

Only the argument's identity ties the calls together: a member called with another tensor runs the
product again (never a stale result); the steps of one stage never interleave inside a layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

QKV = ("q_proj", "k_proj", "v_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")


class Fused(nn.Module):
    """One linear layer standing for several that read the same input; its `Slice`s hand out
    their columns of its output."""

    def __init__(self, linear: nn.Linear, bounds: list[tuple[int, int]]) -> None:
        super().__init__()
        self.linear = linear  # [sum N_i, D]: the members' weights one after the other
        self.bounds = bounds
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._taken = 0

    def take(self, x: torch.Tensor, member: int) -> torch.Tensor:
        """Member `member`'s output for x [..., D] -> [..., N_member] (a view of the fused product)."""
        if x is not self._input or self._output is None:
            self._input, self._output, self._taken = x, self.linear(x), 0
        start, stop = self.bounds[member]
        out = self._output[..., start:stop]
        self._taken += 1
        if self._taken == len(self.bounds):  # every member has its part: let go of the product
            self._input = self._output = None
        return out


class Slice:
    """What stands where one of the fused linear layers was: a plain callable (not a module: the
    family's code calls it once a layer a step, and a module's call costs more than the product
    saves at batch 1)."""

    def __init__(self, fused: Fused, member: int) -> None:
        self.fused, self.member = fused, member

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.take(x, self.member)

    def __repr__(self) -> str:
        return f"Slice(columns {self.fused.bounds[self.member]} of a fused projection)"


class GatedMLP(nn.Module):
    """down(act(x Wg^T) * (x Wu^T)) with gate and up one product: what a gated MLP's forward
    computes (Llama's, Gemma's, ...: the same operations in the same order, so the same numbers)."""

    def __init__(self, mlp: Any, gate_up: nn.Linear) -> None:
        super().__init__()
        self.gate_up_proj = gate_up  # [2I, D]: gate rows, then up rows
        self.down_proj: nn.Module = mlp.down_proj
        self.act_fn: nn.Module = mlp.act_fn
        self.intermediate: int = mlp.gate_proj.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., D] -> [..., D]
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [..., I] each
        return self.down_proj(self.act_fn(gate) * up)  # type: ignore[no-any-return]


def pays(dtype: torch.dtype, device: torch.device) -> bool:
    """Where fusing measured faster: bf16 on a CPU. One thread, SmolLM2's shapes, CPU time of the
    five products of a layer with packed weights: 0.29 -> 0.23 ms at batch 1, 0.48 -> 0.38 at 64;
    whole decode steps 1.02-1.05x (`bench/engine.py` at commit dc23406). fp32 gains under 5% on the products
    and nothing on whole steps: it stays as it is. Not measured on a GPU: left as it is."""
    return device.type == "cpu" and dtype == torch.bfloat16


@torch.no_grad()
def fuse(module: nn.Module) -> int:
    """Fuse the q/k/v projections and the gated MLPs under `module`: the number of sets fused.
    Each set's separate weights are freed (the fused weight replaces them)."""
    fused = 0
    for parent in list(module.modules()):
        linears = [getattr(parent, name, None) for name in QKV]
        if _fusable(linears):
            group = Fused(_concatenated(linears), _bounds(linears))  # type: ignore[arg-type]
            parent.add_module("qkv_proj", group)
            for member, name in enumerate(QKV):
                del parent._modules[name]  # the separate layer and its weight go
                setattr(parent, name, Slice(group, member))
            fused += 1
        for name, child in list(parent.named_children()):
            if _gated_mlp(child):
                gate_up = [child.gate_proj, child.up_proj]
                setattr(parent, name, GatedMLP(child, _concatenated(gate_up)))  # type: ignore[arg-type]
                fused += 1
    return fused


def _gated_mlp(module: nn.Module) -> bool:
    """A gated MLP of exactly gate, up, down and an activation (MoE blocks and others are not)."""
    names = {name for name, _ in module.named_children()}
    return (
        names <= set(GATED_MLP)
        and all(hasattr(module, n) for n in GATED_MLP)
        and _fusable([module.gate_proj, module.up_proj])
    )


def _fusable(members: list[object]) -> bool:
    linears = [m for m in members if type(m) is nn.Linear]
    if len(linears) != len(members):
        return False
    first = linears[0]
    return all(
        m.in_features == first.in_features
        and (m.bias is None) == (first.bias is None)
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        for m in linears
    )


def _concatenated(linears: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([m.weight.detach() for m in linears])  # [sum N_i, D]
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])  # type: ignore[union-attr]
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


def _bounds(linears: list[nn.Linear]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for m in linears:
        bounds.append((start, start + m.out_features))
        start += m.out_features
    return bounds
