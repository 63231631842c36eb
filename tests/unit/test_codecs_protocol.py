import msgpack
import pytest
import torch

from app.core.protocol import StepMessage
from app.partitions.codecs import decode_tensor, encode_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8])
def test_raw_codec_is_byte_exact(dtype):
    x = (torch.randn(2, 3, 5) * 100).to(dtype)
    y = decode_tensor(encode_tensor(x))
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(x, y)


def test_unknown_codec_or_dtype_is_refused():
    with pytest.raises(ValueError):
        encode_tensor(torch.zeros(1), codec="pickle")
    wire = encode_tensor(torch.zeros(1))
    with pytest.raises(ValueError):
        decode_tensor({**wire, "dtype": "object"})


def test_step_message_survives_msgpack():
    hidden = torch.randn(2, 4, 8)
    msg = StepMessage(
        batch_id="b",
        model="m",
        stage=1,
        num_stages=2,
        kind="prefill",
        step=0,
        seq_ids=["a", "b"],
        tensors={"hidden": encode_tensor(hidden)},
        routes=["q0", None],
    )
    back = StepMessage.from_wire(msgpack.unpackb(msgpack.packb(msg.to_wire())))
    assert back.seq_ids == ["a", "b"] and back.routes == ["q0", None] and back.stage == 1
    assert torch.equal(decode_tensor(back.tensors["hidden"]), hidden)


def test_other_protocol_versions_are_refused():
    wire = StepMessage("b", "m", 0, 1, "decode", 1, ["a"]).to_wire()
    with pytest.raises(ValueError):
        StepMessage.from_wire({**wire, "v": 99})
