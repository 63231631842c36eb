"""Attention for a decode step on a CPU in bf16 or fp16: one query per key/value head's group.

A decode step has one query per row against the row's whole history. With grouped-query heads,
transformers hands PyTorch's CPU `scaled_dot_product_attention` the heads as they are and
`enable_gqa=True` when there is no mask (an unpadded batch), and in half precision that path is
slow: ~10 ms a layer for SmolLM2 at batch 64 over 135 keys, against ~1 ms for the same attention
with the query heads of each key/value head packed as that head's queries ([B, H, 1, D] ->
[B, Hkv, G, D], what transformers itself does when a mask is given). At batch 1 it is 0.14 ms
against 0.03 ms a layer. (One thread, the two SDPA calls timed alone; `bench/engine.py` at
commit dc23406 timed whole steps: unpadded at batch 64, 262 ms before against 110 ms with this and
packed weights.)

`grouped_attention` always packs a half-precision decode step on a CPU, mask or no mask, so the
numbers are the ones the masked path has always given. Everything else (a prefill, fp32, a GPU,
softcapping, attention sinks) goes to transformers' SDPA function unchanged: fp32 outputs are bit
for bit what they were.

It is registered with transformers' `AttentionInterface` under `IMPLEMENTATION`; a stage switches a
model from "sdpa" to it (`use_for`), and every attention module of the model dispatches through it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

IMPLEMENTATION = "conveyor_decode"
HALF = (torch.bfloat16, torch.float16)
# A decode step of at least this many rows attends over its cache's whole buffers (`SlabLayer.wide_views`)
# with two matrix products; fewer rows stay with SDPA over the live columns, faster there (one
# thread, SmolLM2's heads, 190 keys in a 256-column buffer: 0.07 against 0.08 ms at 4 rows, 0.54
# against 1.23 ms at 64; 0.044 against 0.025 ms at 1).
WIDE_MIN_ROWS = 4
_NOT_HANDLED = ("softcap", "position_bias", "s_aux", "sinks")  # extras only SDPA (or eager) knows


def prefer_plan_free_kernels(device: torch.device) -> None:
    """On a GPU, leave cuDNN's attention out of SDPA's choices (process-wide; a stage worker's
    process runs stages only). torch picks it first for half precision on recent GPUs, and it builds
    an execution plan for every new shape: about 1.1 ms of host time per call, and a decode step's
    key length is new every step. SmolLM2 on an H200 in bf16: 54 ms an eager step, 34 of them in
    those plans, against under 4 ms of kernels. Flash and memory-efficient attention take any length
    without a plan."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def use_for(config: Any) -> None:
    """Serve `config`'s model through `grouped_attention` where it would have used SDPA."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return  # eager (additive masks), flash kernels on a GPU, ...: left as chosen
    if IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPLEMENTATION, grouped_attention)
    config._attn_implementation = IMPLEMENTATION


def handles(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, extra: dict
) -> bool:
    """A one-query step in half precision on a CPU, with a boolean (or no) mask over exactly the keys."""
    batch, heads, length, _ = query.shape
    if length != 1 or query.device.type != "cpu" or query.dtype not in HALF or dropout:
        return False
    if any(extra.get(name) is not None for name in _NOT_HANDLED):
        return False
    if key.shape[0] != batch or heads % key.shape[1]:
        return False
    if attention_mask is None:
        return True
    return attention_mask.dtype == torch.bool and attention_mask.shape == (batch, 1, 1, key.shape[2])


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([B, S, H, D], None) like SDPA's."""
    if not handles(query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    # query [B, H, 1, D]; key, value [B, Hkv, T, D]; mask [B, 1, 1, T] (True: attend) or None (all keys)
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    packed = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # [B, Hkv, G, D]: G queries a head
    if batch >= WIDE_MIN_ROWS and key.is_contiguous() and value.is_contiguous():
        out = _matmul_attention(packed, key, value, attention_mask, scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            packed, key, value, attn_mask=attention_mask, scale=scaling
        )  # [B, Hkv, G, D]
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None  # [B, 1, H, D]


def _matmul_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v as two batched matrix products: the scores come out of the product
    in the model's dtype, then are scaled, masked and softmaxed in fp32 (transformers' eager
    attention also multiplies in the model's dtype and takes the softmax in fp32). Over contiguous
    keys and values this is about twice as fast as the CPU's SDPA kernel for a decode step."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)).float().mul_(scale)  # [B, Hkv, G, T]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(weights, value)
