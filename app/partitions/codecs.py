"""Tensor codecs for stage messages: tensors travel as bytes with dtype and shape, never pickled.

A broker must not be able to run code in a worker, so the wire form is plain data that msgpack
carries: {"codec", "dtype", "shape", "data"}. `raw` is the default; other codecs register here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Wire = dict[str, Any]

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _encode_raw(tensor: torch.Tensor) -> bytes:
    # A uint8 view keeps every dtype (bfloat16 included) byte-exact without numpy's dtype table.
    return tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def _decode_raw(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


ENCODERS: dict[str, Callable[[torch.Tensor], bytes]] = {"raw": _encode_raw}
DECODERS: dict[str, Callable[[bytes, torch.dtype, list[int]], torch.Tensor]] = {"raw": _decode_raw}


def encode_tensor(tensor: torch.Tensor, codec: str = "raw") -> Wire:
    if codec not in ENCODERS:
        raise ValueError(f"unknown tensor codec {codec!r}; known: {sorted(ENCODERS)}")
    return {
        "codec": codec,
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "data": ENCODERS[codec](tensor),
    }


def decode_tensor(wire: Wire) -> torch.Tensor:
    codec, dtype = wire["codec"], wire["dtype"]
    if codec not in DECODERS:
        raise ValueError(f"unknown tensor codec {codec!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported tensor dtype {dtype!r}")
    return DECODERS[codec](wire["data"], _DTYPES[dtype], list(wire["shape"]))
