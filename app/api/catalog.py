"""The models the API can accept jobs for: tokenizer, chat template and context length of each."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from app.core.config import Settings
from app.core.errors import InvalidRequest, ModelNotFound


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
        path = self.settings.model_path(name)
        if path is None:
            raise ModelNotFound(
                f"model {name!r} does not exist; available: {self.settings.model_names()}", model=name
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
