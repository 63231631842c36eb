"""The models the API can accept jobs for: tokenizer, chat template and context length of each.

A model is named exactly: a CONVEYOR_MODELS entry or a directory in the model home, by its own name
(`Settings.model_path`), and, under `conveyor up`, one of the models it serves. Anything else is 404
`model_not_found` before a file is read, so the catalog holds at most one entry per known model: an
alias (`name/`, `./name`, an absolute path) can neither load a second tokenizer nor queue jobs for
a pipeline no worker reads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from redis.exceptions import RedisError
from transformers import AutoConfig, AutoTokenizer

from app.core.config import EMBEDDING_MODEL, Settings
from app.core.errors import InvalidRequest, ModelNotFound
from app.core.keys import Keys

GENERATION: Final = "generation"
EMBEDDING: Final = "embedding"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    tokenizer: Any
    context_length: int

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(
                f"model {self.name!r} has no chat template; send 'prompt' instead", model=self.name
            )
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


class Catalog:
    """Loads a model's tokenizer on first use and keeps it (weights are the workers' business)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._models: dict[str, ModelInfo] = {}
        self._lock = threading.Lock()

    def cached(self, name: str) -> ModelInfo | None:
        """The model if its tokenizer is already loaded (no I/O): the request path's fast case."""
        return self._models.get(name)

    def get(self, name: str) -> ModelInfo:
        if name in self._models:
            return self._models[name]
        served = self.settings.served_models
        path = self.settings.model_path(name) if not served or name in served else None
        if path is None:
            raise ModelNotFound(
                f"model {name[:128]!r} does not exist; available: {available(self.settings)}",
                model=name[:128],
            )
        with self._lock:
            if name not in self._models:
                config = AutoConfig.from_pretrained(path)
                self._models[name] = ModelInfo(
                    name=name,
                    path=path,
                    tokenizer=AutoTokenizer.from_pretrained(path),
                    context_length=int(getattr(config, "max_position_embeddings", 2048)),
                )
        return self._models[name]

    def __len__(self) -> int:
        return len(self._models)


def available(settings: Settings) -> list[str]:
    """The generation models a request may name: those served under `conveyor up`, else every known one."""
    known = settings.model_names()
    if settings.served_models:
        return [name for name in settings.served_models if name in known]
    return known


async def serving(settings: Settings, redis: Any) -> dict[str, str]:
    """Model name -> kind (`generation`, `embedding`) of every model with workers, for /v1/models.

    Under `conveyor up` (`served_models` set) these are the models it started workers for, listed while
    their workers still load. Otherwise, those of the known models (configured, added, the embeddings
    model) whose workers' heartbeats are live: one ZCOUNT per model and stage, never a key scan.
    """
    kinds = dict.fromkeys(settings.model_names(), GENERATION)
    kinds[EMBEDDING_MODEL] = EMBEDDING
    if settings.served_models:
        return {name: kinds[name] for name in settings.served_models if name in kinds}
    keys = Keys(settings.namespace)
    stages = max(settings.stages, settings.embedding_stages, 1)
    since = time.time() - settings.heartbeat_ttl_s
    names = list(kinds)
    try:
        pipe = redis.pipeline(transaction=False)
        for name in names:
            for stage in range(stages):
                pipe.zcount(keys.workers(name, stage), since, "+inf")
        counts = await pipe.execute()
    except RedisError:
        return {}  # Redis away: no worker can be seen to live
    return {name: kinds[name] for i, name in enumerate(names) if any(counts[i * stages : (i + 1) * stages])}
