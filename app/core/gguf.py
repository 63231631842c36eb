"""GGUF files: the architecture from a file's first header entries, read with bounds (a damaged or
hostile header is a one-line error, not a `MemoryError` or a `struct.error`), and the conversion of a
GGUF model to a Hugging Face directory. `app/core/registry.py` (`conveyor model add`) and
`app/core/modelstore.py` (`pull_smollm2`) call them."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO


@dataclass(frozen=True)
class GGUFHeader:
    architecture: str  # general.architecture, llama.cpp's name (llama, gemma3, qwen3moe, ...)
    name: str | None  # general.name
    block_count: int | None


def read_gguf_header(path: Path) -> GGUFHeader:
    """The architecture of a GGUF file, read from its first metadata entries with the `gguf` package's
    constants. `gguf.GGUFReader` parses the whole vocabulary (tens of seconds for a 262k-token one);
    the architecture comes first, so this stops as soon as it has what it needs.

    Every length and count in the header is checked against the bytes the file has left before it is
    read or skipped: a damaged or hostile file is a `ValueError` naming the file, never a huge
    allocation, a `struct.error` or an endless loop."""
    from gguf import GGUF_MAGIC

    found: dict[str, object] = {}
    with path.open("rb") as f:
        reader = _GGUFReader(f, path.stat().st_size, path)
        magic, _version = reader.unpack("<II")
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        _tensors, entries = reader.unpack("<QQ")
        reader.check_count(entries, 12, "metadata entries")  # a key's length and a value's type at least
        for _ in range(entries):
            key = reader.string()
            value = reader.value(reader.value_type())
            if key in ("general.architecture", "general.name") or key.endswith(".block_count"):
                found[key] = value
            architecture = found.get("general.architecture")
            if architecture and "general.name" in found and f"{architecture}.block_count" in found:
                break
    architecture = found.get("general.architecture")
    if not isinstance(architecture, str):
        raise ValueError(f"{path} has no general.architecture")
    blocks = found.get(f"{architecture}.block_count")
    name = found.get("general.name")
    return GGUFHeader(
        architecture, name if isinstance(name, str) else None, blocks if isinstance(blocks, int) else None
    )


_SCALARS = {  # GGUFValueType name -> struct format
    "UINT8": "<B",
    "INT8": "<b",
    "UINT16": "<H",
    "INT16": "<h",
    "UINT32": "<I",
    "INT32": "<i",
    "FLOAT32": "<f",
    "BOOL": "<?",
    "UINT64": "<Q",
    "INT64": "<q",
    "FLOAT64": "<d",
}


class _GGUFReader:
    """Reads a GGUF header's values, each size checked against what is left of the file."""

    def __init__(self, f: BinaryIO, size: int, path: Path) -> None:
        self.f, self.size, self.path = f, size, path

    def left(self) -> int:
        return self.size - self.f.tell()

    def read(self, n: int) -> bytes:
        if n > self.left():
            raise ValueError(
                f"{self.path}: GGUF header truncated or damaged (needs {n} bytes, has {self.left()})"
            )
        return self.f.read(n)

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))

    def check_count(self, count: int, min_bytes: int, what: str) -> None:
        if count * min_bytes > self.left():
            raise ValueError(f"{self.path}: GGUF header damaged ({count} {what} in {self.left()} bytes)")

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        return self.read(length).decode("utf-8", errors="replace")

    def value_type(self) -> Any:
        from gguf import GGUFValueType

        (code,) = self.unpack("<I")
        try:
            return GGUFValueType(code)
        except ValueError:
            raise ValueError(f"{self.path}: GGUF header damaged (value type {code})") from None

    def value(self, kind: Any) -> object:
        from gguf import GGUFValueType

        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item = self.value_type()
            (count,) = self.unpack("<Q")
            if item.name in _SCALARS:  # skipped, not parsed: the vocabulary's scores are arrays
                size = struct.calcsize(_SCALARS[item.name])
                self.check_count(count, size, "array items")
                self.f.seek(count * size, 1)
                return None
            self.check_count(count, 8 if item == GGUFValueType.STRING else 4, "array items")
            for _ in range(count):
                self.value(item)
            return None
        if kind.name not in _SCALARS:
            raise ValueError(f"{self.path}: GGUF header damaged (value type {kind.name})")
        return self.unpack(_SCALARS[kind.name])[0]


def convert_gguf(directory: Path, gguf_file: str, out: Path) -> None:
    """Dequantize a GGUF file to fp32 and save it as a Hugging Face directory (safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_parse():
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        model: Any = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file)
    # The weights are already dequantized to fp32, but transformers refuses to save a model that
    # still names its GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _one_parse() -> Iterator[None]:
    """transformers opens a GGUF file three times (its config, its tokenizer, its weights), and
    `gguf.GGUFReader` walks the file as a `numpy.memmap`, whose slicing costs microseconds per item:
    a 262k-token vocabulary took about 20 s a parse. Inside this block each file is parsed once, over
    a plain array view of the same mapping (the same bytes, without the memmap subclass)."""
    import gguf
    import numpy as np

    upstream = gguf.GGUFReader
    parsed: dict[str, Any] = {}

    class Reader(upstream):  # type: ignore[misc, valid-type]
        @property
        def data(self) -> Any:
            return self.__dict__["data"]

        @data.setter
        def data(self, value: Any) -> None:
            self.__dict__["data"] = value.view(np.ndarray)

    def reader(path: Any, mode: str = "r") -> Any:
        key = f"{Path(path).resolve()}:{mode}"
        if key not in parsed:
            parsed[key] = Reader(path, mode)
        return parsed[key]

    gguf.GGUFReader = reader  # type: ignore[misc, assignment]  # transformers imports it per call
    try:
        yield
    finally:
        gguf.GGUFReader = upstream  # type: ignore[misc]
