"""Tensor codecs: every codec and dtype round-trips through msgpack; lossy ones stay within bounds."""

import msgpack
import pytest
import torch

from app.partitions.codecs import CODECS, CodecSpec, decode_tensor, encode_tensor

ALL_DTYPES = [
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
]
SHAPES = [(8, 1, 576), (2, 3, 5), (7,), (), (0, 4), (2, 1, 2, 3, 4)]


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 100
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.uint8:
        return x.abs().clamp(max=255).to(dtype)
    return x.to(dtype)


def trip(wire: dict) -> torch.Tensor:
    """What the next stage decodes: the wire dict after msgpack, as Celery carries it."""
    return decode_tensor(msgpack.unpackb(msgpack.packb(wire)))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


LOSSLESS = ["raw", "arrow", "arrow+zstd", "arrow+lz4"]


@pytest.mark.parametrize("codec", LOSSLESS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_lossless_codecs_are_byte_exact(codec, dtype, shape):
    x = sample(shape, dtype)
    wire = encode_tensor(x, codec)
    assert wire["codec"] == codec and wire["dtype"] == str(dtype)[6:] and wire["shape"] == list(shape)
    assert "transport_dtype" not in wire
    assert same_bytes(trip(wire), x)


@pytest.mark.parametrize("codec", LOSSLESS)
def test_lossless_codecs_keep_nan_and_inf_bit_patterns(codec):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40])
    assert same_bytes(trip(encode_tensor(x, codec)), x)


def test_arrow_carries_an_ipc_stream_any_arrow_reader_can_rebuild():
    import json

    import pyarrow as pa

    x = sample((2, 3), torch.bfloat16)
    reader = pa.ipc.open_stream(encode_tensor(x, "arrow")["data"])
    assert json.loads(reader.schema.metadata[b"shape"]) == [2, 3]
    assert reader.schema.metadata[b"dtype"] == b"bfloat16"
    assert reader.schema.field("tensor").type == pa.uint16()  # bfloat16's raw 2-byte integers
    assert reader.read_all().num_rows == 6


@pytest.mark.parametrize("codec", ["arrow+zstd", "arrow+lz4"])
def test_compressed_arrow_is_a_compressed_ipc_stream_and_shrinks_what_compresses(codec):
    import pyarrow as pa

    # Activations in a narrow range share their exponent bits, and in bfloat16 (8 bits of mantissa)
    # many whole values repeat: even lz4, which only finds repeats, shrinks them.
    x = (torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(1)) * 0.01 + 1.0).bfloat16()
    plain, packed = encode_tensor(x, "arrow"), encode_tensor(x, codec)
    assert len(packed["data"]) < 0.9 * len(plain["data"])
    assert same_bytes(trip(packed), x)
    # Any Arrow reader reads it with no option: the stream says how its buffers are compressed.
    table = pa.ipc.open_stream(packed["data"]).read_all()
    assert table.num_rows == x.numel()
    zeros = torch.zeros(4096, dtype=torch.int64)
    assert len(encode_tensor(zeros, codec)["data"]) < zeros.numel() * 8 // 20


@pytest.mark.parametrize("codec", ["arrow+zstd", "arrow+lz4"])
def test_compressed_arrow_is_byte_exact_on_random_bits(codec):
    # Incompressible bytes (every bit pattern of the dtype, NaNs and subnormals included) round-trip.
    bits = torch.randint(-(2**15), 2**15, (4, 1, 576), generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float16, torch.bfloat16):
        x = bits.to(torch.int16).view(dtype)
        assert same_bytes(trip(encode_tensor(x, codec)), x)
    wide = torch.randint(-(2**31), 2**31, (4, 1, 576), generator=torch.Generator().manual_seed(3))
    floats = wide.to(torch.int32).view(torch.float32)
    assert same_bytes(trip(encode_tensor(floats, codec)), floats)
    assert same_bytes(trip(encode_tensor(wide, codec)), wide)


def test_decoded_tensors_own_writable_memory():
    for codec in CODECS:
        spec = {"tolerance": 1e-3} if codec == "zfp" else {}
        y = trip(encode_tensor(torch.ones(4), codec, **spec))
        y += 1  # a read-only view of the message buffer would fail or warn here
        assert torch.equal(y, torch.full((4,), 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tolerance", [1e-1, 1e-3])
@pytest.mark.parametrize("shape", [(8, 1, 576), (8, 16, 64), (5,), (), (2, 1, 2, 3, 4)], ids=str)
def test_zfp_stays_within_its_tolerance(dtype, tolerance, shape):
    x = sample(shape, dtype) / 100
    wire = encode_tensor(x, "zfp", tolerance=tolerance)
    assert wire["tolerance"] == tolerance and "rate" not in wire
    y = trip(wire)
    assert y.dtype == dtype and y.shape == x.shape
    assert (y - x).abs().max() <= tolerance


def test_zfp_fixed_rate_sets_the_size():
    x = sample((8, 16, 64), torch.float32) / 100
    wire = encode_tensor(x, "zfp", rate=8)
    assert wire["rate"] == 8 and "tolerance" not in wire
    assert len(wire["data"]) <= x.numel() + 64  # 8 bits a value plus zfp's header
    y = trip(wire)
    assert y.shape == x.shape and (y - x).abs().max() < 0.1


def test_zfp_smooth_data_compresses():
    x = torch.linspace(0, 1, 8 * 128 * 64).reshape(8, 128, 64)
    wire = encode_tensor(x, "zfp", tolerance=1e-4)
    assert len(wire["data"]) < x.numel() * 4 / 4
    assert (trip(wire) - x).abs().max() <= 1e-4


@pytest.mark.parametrize("transport", ["float16", "bfloat16"])
@pytest.mark.parametrize("codec", LOSSLESS)
def test_transport_dtype_narrows_then_restores_dtype_and_shape(transport, codec):
    x = sample((8, 4, 576), torch.float32) / 10
    wire = encode_tensor(x, codec, transport_dtype=transport)
    assert wire["dtype"] == "float32" and wire["transport_dtype"] == transport
    narrowed = getattr(torch, transport)
    assert len(wire["data"]) <= x.numel() * 2 + (1024 if codec.startswith("arrow") else 0)
    y = trip(wire)
    assert y.dtype == torch.float32 and y.shape == x.shape
    # Exactly what one rounding to the narrower dtype gives, so within its precision.
    assert torch.equal(y, x.to(narrowed).to(torch.float32))
    eps = torch.finfo(narrowed).eps
    assert ((y - x).abs() <= x.abs() * eps / 2 + torch.finfo(narrowed).tiny).all()


def test_transport_dtype_of_the_tensors_own_dtype_is_a_no_op():
    x = sample((3, 4), torch.float16)
    wire = encode_tensor(x, transport_dtype="float16")
    assert "transport_dtype" not in wire and same_bytes(trip(wire), x)


def test_float64_may_travel_as_float32():
    x = sample((3, 4), torch.float64)
    y = trip(encode_tensor(x, transport_dtype="float32"))
    assert y.dtype == torch.float64 and torch.equal(y, x.float().double())


def test_transport_dtype_keeps_infinities_nan_and_empty_tensors():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.5])
    y = trip(encode_tensor(x, transport_dtype="float16"))
    assert y.dtype == torch.float32 and torch.equal(y[:2], x[:2]) and y[2].isnan() and y[3] == 1.5
    empty = torch.zeros(0, 576)
    assert same_bytes(trip(encode_tensor(empty, transport_dtype="bfloat16")), empty)


def test_transport_dtype_refuses_overflow_and_non_floats():
    with pytest.raises(ValueError, match="overflow float16"):
        encode_tensor(torch.tensor([1.0, 70_000.0]), transport_dtype="float16")
    with pytest.raises(ValueError, match="overflow float16"):
        encode_tensor(torch.tensor([float("inf"), -70_000.0]), transport_dtype="float16")
    big = torch.tensor([1.0, 70_000.0])
    assert torch.equal(trip(encode_tensor(big, transport_dtype="bfloat16")), big.bfloat16().float())
    with pytest.raises(ValueError, match="only narrows wider floats"):
        encode_tensor(torch.ones(3, dtype=torch.int64), transport_dtype="float16")
    with pytest.raises(ValueError, match="only narrows wider floats"):
        encode_tensor(torch.ones(3, dtype=torch.bfloat16), transport_dtype="float16")
    with pytest.raises(ValueError, match="unsupported transport dtype"):
        encode_tensor(torch.ones(3), transport_dtype="int8")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool])
def test_zfp_refuses_other_dtypes(dtype):
    with pytest.raises(ValueError, match=r"codec 'zfp' carries \['float32', 'float64'\]"):
        encode_tensor(sample((4, 4), dtype), "zfp", tolerance=1e-3)


def test_zfp_refuses_fp16_transport_and_non_finite_values():
    with pytest.raises(ValueError, match="transport_dtype=None"):
        encode_tensor(torch.ones(4), "zfp", tolerance=1e-3, transport_dtype="float16")
    with pytest.raises(ValueError, match="NaN or infinite"):
        encode_tensor(torch.tensor([1.0, float("nan")]), "zfp", tolerance=1e-3)


def test_zfp_parameters_are_checked():
    with pytest.raises(ValueError, match="exactly one of tolerance"):
        CodecSpec("zfp")
    with pytest.raises(ValueError, match="exactly one of tolerance"):
        CodecSpec("zfp", tolerance=1e-3, rate=8)
    with pytest.raises(ValueError, match="positive"):
        CodecSpec("zfp", tolerance=0.0)
    with pytest.raises(ValueError, match="only apply to codec 'zfp'"):
        CodecSpec("raw", tolerance=1e-3)


def test_unknown_codec_lists_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown tensor codec 'pickle'; known: \['arrow', 'arrow\+lz4', 'arrow\+zstd', 'raw', 'zfp'\]",
    ):
        encode_tensor(torch.zeros(1), codec="pickle")
    wire = encode_tensor(torch.zeros(1))
    with pytest.raises(ValueError, match="known: "):
        decode_tensor({**wire, "codec": "pickle"})


def test_bad_wire_dicts_are_refused():
    wire = encode_tensor(torch.zeros(2, 3), "arrow")
    with pytest.raises(ValueError, match="unsupported tensor dtype"):
        decode_tensor({**wire, "dtype": "object"})
    with pytest.raises(ValueError, match="does not match"):
        decode_tensor({**wire, "shape": [3, 2]})
    with pytest.raises(ValueError, match="does not carry"):
        decode_tensor({**encode_tensor(torch.zeros(2), "zfp", tolerance=0.1), "transport_dtype": "float16"})
    with pytest.raises(ValueError, match="claim-checked"):
        decode_tensor({k: v for k, v in wire.items() if k != "data"} | {"claim": "ns:claim:x"})


def test_spec_encodes_like_encode_tensor():
    x = sample((2, 8), torch.float32)
    spec = CodecSpec("arrow", transport_dtype="bfloat16")
    assert spec.encode(x) == encode_tensor(x, "arrow", transport_dtype="bfloat16")
