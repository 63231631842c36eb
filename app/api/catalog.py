"""The models the API can accept jobs for: tokenizer, chat template and context length of each.

A model is named exactly: a CONVEYOR_MODELS entry or a directory in the model home, by its own name
(`find_model` in app/core/discovery.py), and, under `conveyor up`, one of the models it serves.
Anything else is 404 `model_not_found` before a file is read, so the catalog holds at most one entry
per known model: an alias (`name/`, `./name`, an absolute path) can neither load a second tokenizer
nor queue jobs for a pipeline no worker reads.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Final

from jinja2 import TemplateError
from redis.exceptions import RedisError
from transformers import AutoTokenizer

from app.api.toolformats import ToolFormat
from app.api.toolprompt import template_format, written_in
from app.core import modelstore, routing
from app.core.config import EMBEDDING_MODEL, CatalogSettings, Settings
from app.core.discovery import GENERATION, kind_of
from app.core.errors import InvalidRequest, ModelNotFound, UnsupportedModel
from app.core.keys import Keys
from app.core.sampling import SamplingParams
from app.partitions.loading import check_servable

log = logging.getLogger(__name__)

ROUTE: Final = "route"  # a name routed to one of two generation models (app/core/routing.py)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    tokenizer: Any
    context_length: int
    vocab_size: int | None = None  # the model's (config.json): token ids a request may name
    # generation_config.json's sampling values, for a request that leaves them out (vLLM's
    # `--generation-config auto`): those of SAMPLING_DEFAULTS that are there and usable.
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)

    def encode_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's `bad_words` as token sequences: each word alone and after a space (where that
        tokenizes to another sequence of the same length), without special tokens."""
        sequences: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer(word.lstrip(), add_special_tokens=False).input_ids)
            spaced = tuple(self.tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids)
            if bare and bare not in sequences:
                sequences.append(bare)
            if (
                bare
                and spaced
                and spaced[0] != bare[0]
                and len(spaced) == len(bare)
                and spaced not in sequences
            ):
                sequences.append(spaced)
        return tuple(sequences)

    @property
    def chat(self) -> bool:
        """Whether it takes chat messages (its tokenizer has a template): base models have none."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)

    @cached_property
    def message_tokens(self) -> int:
        """Tokens the chat template adds for each message at the least, whatever its content and role
        (at least 1): what one more empty message adds to a chat of one, for the role that adds
        the fewest; rendered once per model."""
        one = [{"role": "user", "content": ""}]
        added = []
        for role in ("user", "assistant", "system"):
            try:
                added.append(
                    len(self._render([*one, {"role": role, "content": ""}])) - len(self._render(one))
                )
            except Exception:  # a template that refuses such a chat (roles must alternate, ...)
                continue
        return max(1, min(added, default=1))

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    @cached_property
    def tool_format(self) -> tuple[ToolFormat, bool]:
        """The format its answers write tool calls in, and whether its template renders tools itself
        (app/api/toolprompt.py); read once per model."""
        return template_format(self.tokenizer)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat rendered by the model's template (vLLM's defaults: a generation prompt, no special
        tokens beyond the template's), then tokenized. `tools`, the assistant's calls and `tool`
        messages: by the template where it has a tools section, else written into the messages."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(
                f"model {self.name!r} has no chat template; send 'prompt' instead", model=self.name
            )
        kwargs = dict(template_kwargs or {})
        if self.tool_format[1]:
            if tools:
                kwargs["tools"] = tools
        elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = written_in(messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except (ValueError, TypeError, TemplateError) as exc:  # the request's doing (a message, a kwarg)
            raise InvalidRequest(f"the chat template could not render these messages: {exc}") from None
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


class Catalog:
    """Loads a model's tokenizer on first use and keeps it (weights are the workers' business).
    `settings`: `Settings.catalog`."""

    def __init__(self, settings: CatalogSettings) -> None:
        self.settings = settings
        self._models: dict[str, ModelInfo] = {}
        self._lock = threading.Lock()
        self._routes: dict[str, routing.Route] | None = None

    def routes(self) -> dict[str, routing.Route]:
        """The routes a request may name (CONVEYOR_ROUTES, and `auto` over two or more served models),
        resolved once: the API's lifespan calls it first, so a route naming a model that is not served
        stops the start (RouteConfigError) instead of failing requests."""
        if self._routes is None:
            served = [name for name in available(self.settings) if kind_of(name) == GENERATION]
            sizes = {name: parameter_count(self.settings.model_path(name)) for name in served}
            self._routes = routing.resolve(self.settings.routes, served, sizes)
        return self._routes

    def route(self, name: str) -> routing.Route | None:
        """The route called exactly `name`; None for a model's name (or an unknown one)."""
        return self.routes().get(name)

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
                # A model the stages cannot serve is 422 `model_unsupported` here, not a job that waits
                # for workers that refused it (checked again on every request until it can be served).
                config = check_servable(path)
                self._models[name] = ModelInfo(
                    name=name,
                    path=path,
                    tokenizer=AutoTokenizer.from_pretrained(path),
                    context_length=modelstore.context_length(config),
                    vocab_size=getattr(config, "vocab_size", None),
                    sampling_defaults=sampling_defaults(path),
                )
        return self._models[name]

    def problem(self, name: str) -> str | None:
        """Why the stages cannot serve a model (`check_servable`: its config and weights' headers,
        no weight read), None when they can, or it is loaded already. Who calls: /readyz, which
        does not wait for workers that refused their model."""
        path = self.settings.model_path(name)
        if name in self._models or path is None:
            return None
        try:
            check_servable(path)
        except UnsupportedModel as exc:
            return exc.message
        return None

    def __len__(self) -> int:
        return len(self._models)


# The generation_config.json fields a request's sampling values default to (vLLM reads these too).
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(path: Path) -> dict[str, Any]:
    """The model's default sampling values (generation_config.json), each kept only where a request
    could send it (app/core/sampling.py's bounds): a value no request may carry is not one to give
    a request that sent nothing (it is logged and left out)."""
    file = path / "generation_config.json"
    try:
        config = json.loads(file.read_text()) if file.exists() else {}
    except (OSError, ValueError):
        log.warning("%s: not readable as JSON; no sampling defaults taken from it", file)
        return {}
    usable = {}
    for name in SAMPLING_DEFAULTS:
        value = config.get(name)
        if value is None:
            continue
        try:
            fine = SamplingParams(**{name: value}).problem() is None
        except TypeError:
            fine = False
        if fine:
            usable[name] = value
        else:
            log.warning(
                "%s: %s=%r is not a value a request may send; not used as a default", file, name, value
            )
    return usable


def parameter_count(path: Path | None) -> int:
    """Parameters in a model directory's safetensors files, from their headers alone (a few KB read,
    no tensor). 0 when unknown (weights missing, or not safetensors): routing then orders models as
    served, and the model is refused when a job names it."""
    if path is None:
        return 0
    try:
        return modelstore.count_parameters(path)
    except (OSError, ValueError, KeyError, TypeError, UnsupportedModel):
        return 0


def available(settings: CatalogSettings) -> list[str]:
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
    kinds = {name: kind_of(name) for name in [*settings.model_names(), EMBEDDING_MODEL]}
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
