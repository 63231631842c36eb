"""Tensor codecs for stage messages: tensors travel as bytes with dtype and shape, never pickled.

A broker must not be able to run code in a worker, so the wire form is plain data that msgpack
carries: {"codec", "dtype", "shape", "data"} plus the codec's own parameters. Codecs:

- `raw` (default): the tensor's bytes as they are; byte-exact for every dtype.
- `arrow`: an Arrow IPC stream of one record batch with one flat column; the shape and dtype ride
  in the schema metadata, so any Arrow reader can rebuild the tensor. Byte-exact. Arrow has no
  bfloat16: those travel as their raw 2-byte integers (uint16).
- `arrow+zstd`, `arrow+lz4`: the same stream with its buffers compressed by Arrow's IPC writer
  (zstd or lz4 frame). Byte-exact; fewer bytes when the tensor compresses (hidden states do a
  little: their float exponents repeat), at some CPU on both ends (bench/results/codecs.md).
- `zfp`: lossy floating-point compression (zfpy), opt-in, float32/float64 only, with either an
  absolute error bound (`tolerance`) or a fixed `rate` (bits per value) recorded in the wire dict.

`transport_dtype` narrows a floating tensor for the trip (e.g. float32 activations as float16 or
bfloat16); the wire dict keeps the tensor's own `dtype` and the `transport_dtype` of its bytes, and
`decode_tensor` restores the original dtype. Who calls: the stage runtime, once per tensor it sends
(`CodecSpec.encode`) and once per tensor it receives (`decode_tensor`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import zfpy

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
FLOATS = frozenset({"float32", "float16", "bfloat16", "float64"})
TRANSPORT_DTYPES = frozenset({"float16", "bfloat16", "float32"})
ZFP_DTYPES = frozenset({"float32", "float64"})
ZFP_MAX_DIMS = 4  # zfp compresses 1- to 4-dimensional arrays


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported tensor dtype {name!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[name]


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor; bfloat16 (unknown to numpy) as its uint16 bits."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy()
    return tensor.numpy()


def _from_numpy(array: np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor that owns its memory (the array may be a read-only view of a message buffer)."""
    tensor = torch.from_numpy(np.array(array, copy=True))
    return (tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor).reshape(shape)


# ---------------------------------------------------------------- raw


def _encode_raw(tensor: torch.Tensor, spec: CodecSpec) -> bytes:
    # A uint8 view keeps every dtype (bfloat16 included) byte-exact without numpy's dtype table.
    return _cpu(tensor).reshape(-1).view(torch.uint8).numpy().tobytes()


def _decode_raw(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


# ---------------------------------------------------------------- arrow


def _encode_arrow(tensor: torch.Tensor, spec: CodecSpec) -> bytes:
    return _arrow_stream(tensor, None)


def _encode_arrow_zstd(tensor: torch.Tensor, spec: CodecSpec) -> bytes:
    return _arrow_stream(tensor, "zstd")


def _encode_arrow_lz4(tensor: torch.Tensor, spec: CodecSpec) -> bytes:
    return _arrow_stream(tensor, "lz4")


def _arrow_stream(tensor: torch.Tensor, compression: str | None) -> bytes:
    """One record batch of one flat column; `compression` (zstd, lz4) compresses its buffers. A
    reader needs no option to read it back: the stream says how each buffer was compressed."""
    tensor = _cpu(tensor)
    column = pa.array(_numpy(tensor).reshape(-1))  # zero-copy for numeric dtypes; bool is bit-packed
    metadata = {"shape": json.dumps(list(tensor.shape)), "dtype": dtype_name(tensor.dtype)}
    schema = pa.schema([pa.field("tensor", column.type, nullable=False)], metadata=metadata)
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, schema, options=options) as writer:
        writer.write_batch(pa.record_batch([column], schema=schema))
    return sink.getvalue().to_pybytes()


def _decode_arrow(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    reader = pa.ipc.open_stream(pa.py_buffer(data))
    metadata = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    if metadata.get("dtype") != dtype_name(dtype) or json.loads(metadata.get("shape", "null")) != shape:
        raise ValueError(f"arrow tensor metadata {metadata} does not match the wire's {dtype}, {shape}")
    column = reader.read_all().column(0)
    return _from_numpy(column.to_numpy(zero_copy_only=False), dtype, shape)


# ---------------------------------------------------------------- zfp


def _encode_zfp(tensor: torch.Tensor, spec: CodecSpec) -> bytes:
    array = _numpy(_cpu(tensor))
    if not np.isfinite(array).all():
        raise ValueError("zfp cannot bound the error of NaN or infinite values; use codec 'raw' or 'arrow'")
    # zfp pads every dimension to blocks of 4: a decode step's [B, 1, D] would carry 4x its size.
    array = array.reshape([n for n in array.shape if n != 1] or [1])
    if array.ndim > ZFP_MAX_DIMS:  # [..., A, B, C] -> [N, A, B, C]: keep the innermost structure
        array = array.reshape(-1, *array.shape[-(ZFP_MAX_DIMS - 1) :])
    if spec.tolerance is not None:
        return bytes(zfpy.compress_numpy(array, tolerance=spec.tolerance))
    return bytes(zfpy.compress_numpy(array, rate=spec.rate))


def _decode_zfp(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    array = zfpy.decompress_numpy(data)
    if str(array.dtype) != dtype_name(dtype):
        raise ValueError(f"zfp stream holds {array.dtype}, the wire says {dtype}")
    return _from_numpy(array, dtype, shape)


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class Codec:
    encode: Callable[[torch.Tensor, CodecSpec], bytes]
    decode: Callable[[bytes, torch.dtype, list[int]], torch.Tensor]
    dtypes: frozenset[str]  # dtypes of the bytes it carries (after any transport narrowing)
    lossy: bool = False


CODECS: dict[str, Codec] = {
    "raw": Codec(_encode_raw, _decode_raw, frozenset(_DTYPES)),
    "arrow": Codec(_encode_arrow, _decode_arrow, frozenset(_DTYPES)),
    "arrow+zstd": Codec(_encode_arrow_zstd, _decode_arrow, frozenset(_DTYPES)),
    "arrow+lz4": Codec(_encode_arrow_lz4, _decode_arrow, frozenset(_DTYPES)),
    "zfp": Codec(_encode_zfp, _decode_zfp, ZFP_DTYPES, lossy=True),
}


def _codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown tensor codec {name!r}; known: {sorted(CODECS)}")
    return CODECS[name]


# A stage's absolute error bound with codec zfp: a max error of 0.0028 on SmolLM2's activations at
# 0.46 of raw's bytes (docs/benchmarks.md, "Stage messages and hops").
ZFP_TOLERANCE = 1e-2


@dataclass(frozen=True)
class CodecSpec:
    """How tensors are sent: a codec, its parameters, and an optional narrower transport dtype.

    Built once from the settings (so that a bad combination fails at start-up, not at the first
    step) and used for every tensor a stage sends.
    """

    # Stage workers send raw, the model's dtype: byte-exact and the fastest (bench/results/codecs.md).
    # arrow is exact too but slower, zfp and a narrower transport dtype are lossy: no deployment
    # setting chooses them.
    codec: str = "raw"
    transport_dtype: str | None = None  # float16 / bfloat16 / float32; None sends the tensor's dtype
    tolerance: float | None = None  # zfp: absolute error bound
    rate: float | None = None  # zfp: bits per value (no error bound)

    def __post_init__(self) -> None:
        _codec(self.codec)
        if self.transport_dtype is not None and self.transport_dtype not in TRANSPORT_DTYPES:
            raise ValueError(
                f"unsupported transport dtype {self.transport_dtype!r}; known: {sorted(TRANSPORT_DTYPES)}"
            )
        params = {k: v for k, v in (("tolerance", self.tolerance), ("rate", self.rate)) if v is not None}
        if self.codec != "zfp" and params:
            raise ValueError(f"{sorted(params)} only apply to codec 'zfp', not {self.codec!r}")
        if self.codec == "zfp" and len(params) != 1:
            raise ValueError("codec 'zfp' needs exactly one of tolerance (absolute error) or rate (bits)")
        if any(v <= 0 for v in params.values()):
            raise ValueError(f"zfp parameters must be positive, got {params}")

    def params(self) -> dict[str, float]:
        return {k: v for k, v in (("tolerance", self.tolerance), ("rate", self.rate)) if v is not None}

    def encode(self, tensor: torch.Tensor) -> Wire:
        sent = narrow(tensor, self.transport_dtype)
        codec, sent_dtype = _codec(self.codec), dtype_name(sent.dtype)
        if sent_dtype not in codec.dtypes:
            raise ValueError(
                f"codec {self.codec!r} carries {sorted(codec.dtypes)}, not {sent_dtype}"
                + ("; set transport_dtype=None to send float32" if self.transport_dtype else "")
            )
        wire: Wire = {
            "codec": self.codec,
            "dtype": dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "data": codec.encode(sent, self),
            **self.params(),
        }
        if sent.dtype != tensor.dtype:
            wire["transport_dtype"] = sent_dtype
        return wire


def narrow(tensor: torch.Tensor, transport_dtype: str | None) -> torch.Tensor:
    """The tensor in its transport dtype: only a wider floating tensor is narrowed."""
    if transport_dtype is None or dtype_name(tensor.dtype) == transport_dtype:
        return tensor
    target = _DTYPES[transport_dtype]
    if not tensor.is_floating_point() or tensor.element_size() <= target.itemsize:
        raise ValueError(f"transport dtype {transport_dtype} only narrows wider floats, not {tensor.dtype}")
    sent = tensor.to(target)
    if _overflows(tensor, sent):
        raise ValueError(
            f"values up to {float(tensor.abs().max()):.4g} overflow {transport_dtype}; "
            "use transport dtype bfloat16 (float32's range) or none"
        )
    return sent


def _overflows(tensor: torch.Tensor, sent: torch.Tensor) -> bool:
    """Did a finite value become infinite? One min/max pass; the exact mask only when one is out of range."""
    if tensor.numel() == 0:
        return False
    limit = torch.finfo(sent.dtype).max
    low, high = torch.aminmax(tensor)  # NaN compares false: it travels as NaN
    if not (float(high) > limit or float(low) < -limit):
        return False
    return bool((torch.isinf(sent) & torch.isfinite(tensor)).any())  # infinities in the input stay


def encode_tensor(
    tensor: torch.Tensor,
    codec: str = "raw",
    *,
    transport_dtype: str | None = None,
    tolerance: float | None = None,
    rate: float | None = None,
) -> Wire:
    """The wire form of one tensor (plain data for msgpack); see `CodecSpec`."""
    return CodecSpec(codec, transport_dtype, tolerance, rate).encode(tensor)


def decode_tensor(wire: Wire) -> torch.Tensor:
    """The tensor back, in its original dtype and shape (lossy codecs: within their bound)."""
    if "claim" in wire:
        raise ValueError(f"tensor data is claim-checked at {wire['claim']!r}; resolve it with ClaimCheck.get")
    codec = _codec(wire["codec"])
    dtype = _torch_dtype(wire["dtype"])
    sent = _torch_dtype(wire.get("transport_dtype") or wire["dtype"])
    if dtype_name(sent) not in codec.dtypes:
        raise ValueError(f"codec {wire['codec']!r} does not carry {sent}")
    tensor = codec.decode(wire["data"], sent, list(wire["shape"]))
    return tensor.to(dtype) if sent != dtype else tensor
