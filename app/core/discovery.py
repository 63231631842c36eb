"""Model discovery: which models a request may name and where each lives: an entry of
CONVEYOR_MODELS, or a directory with a config.json under the model home (`conveyor model add`,
`conveyor model pull`). `Settings.model_path` / `model_names` and the API's catalog ask here."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"  # /v1/embeddings' one model (app/workers/embedding.py)
# A model's kind: what its jobs are (the job record's `kind`), which endpoints take it and which
# pipeline runs it. `kind_of` is the one place that tells a model's kind.
GENERATION: Final = "generation"
EMBEDDING: Final = "embedding"
# Its texts are truncated at this many tokens: sentence-transformers' max_seq_length for it
# (sentence_bert_config.json).
EMBEDDING_MAX_TOKENS = 256
# A model's name: a directory name under the model home and a Redis key part, never a path.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def kind_of(model: str) -> str:
    """`model`'s kind: EMBEDDING for the embeddings model (its own endpoint, its own pipeline of
    torch.fx graph pieces, `embedding_stages` long), GENERATION for every other."""
    return EMBEDDING if model == EMBEDDING_MODEL else GENERATION


def valid_model_name(name: str) -> bool:
    """Whether `name` can name a model: no separators, no `..`, no leading dot (hidden, partial)."""
    return MODEL_NAME.fullmatch(name) is not None and ".." not in name


def find_model(name: str, *, models: Mapping[str, Path], model_home: Path) -> Path | None:
    """Where the model called exactly `name` lives: an entry of `models` (CONVEYOR_MODELS), or a
    directory of that name with a config.json in the model home; None otherwise. A name that cannot
    name a model (a path, `..`, a trailing slash) is refused without touching the disk, and a
    directory must be listed under that exact name (no case folding, no aliases)."""
    if name in models:
        return Path(models[name])
    if not valid_model_name(name) or name not in _home_entries(model_home):
        return None
    candidate = model_home / name
    return candidate if (candidate / "config.json").is_file() else None


def known_models(*, models: Mapping[str, Path], model_home: Path) -> list[str]:
    """Every model a request may name: configured (`models`), and added (or pulled) into the model
    home."""
    names = set(models)
    names.update(
        name
        for name in _home_entries(model_home)
        if valid_model_name(name) and (model_home / name / "config.json").is_file()
    )
    return sorted(names)


def _home_entries(model_home: Path) -> list[str]:
    try:
        return os.listdir(model_home)
    except OSError:  # no model home yet
        return []
