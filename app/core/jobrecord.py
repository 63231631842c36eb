"""The job record (`job:{id}`) and the request it holds, typed: what `app/core/jobstore.py` writes and
its readers read, field by field, with each field's encoding in the hash.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.core.grammar import Grammar
from app.core.jobs import TIMESTAMP_FIELD, JobStatus, decode_record, encode_field
from app.core.sampling import SamplingParams


@dataclass(frozen=True)
class JobRequest:
    """What a generation job asked for: its sampling and stopping rules (the record's `request`).
    Stored flat; a field at its default is left out, so a request that asks for nothing new is
    the JSON the record has always held."""

    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Structured outputs: the text is constrained to this grammar (app.workers.grammar).
    grammar: Grammar | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True  # as vLLM's: special tokens are left out of the text

    def to_json(self) -> str:
        value: dict[str, Any] = {"max_tokens": self.max_tokens, **self.sampling.to_dict()}
        if self.grammar is not None:
            value["grammar"] = self.grammar.to_dict()
        value |= {"stop": list(self.stop), "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens}
        if not self.skip_special_tokens:
            value["skip_special_tokens"] = False
        return json.dumps(value)

    @classmethod
    def from_json(cls, text: str) -> JobRequest:
        """A stored request; fields added after it was written take their defaults."""
        value = json.loads(text)
        return cls(
            max_tokens=int(value["max_tokens"]),
            sampling=SamplingParams.from_dict(value),
            grammar=Grammar.from_dict(value["grammar"]) if value.get("grammar") else None,
            stop=tuple(value.get("stop") or ()),
            ignore_eos=bool(value.get("ignore_eos")),
            min_tokens=int(value.get("min_tokens") or 0),
            skip_special_tokens=bool(value.get("skip_special_tokens", True)),
        )


def _float(text: str) -> float:
    return float(text)


def _json_list(text: str) -> tuple[Any, ...]:
    return tuple(json.loads(text))


def _dumps_list(value: Iterable[Any]) -> str:
    return json.dumps(list(value))


# field -> (text -> value, value -> text), for the fields that are not plain text. The encodings
# are the ones the record has always had: a rolling upgrade reads and writes the same hash.
_CODECS: dict[str, tuple[Any, Any]] = {
    "status": (JobStatus, str),
    "created_at": (_float, repr),
    "deadline": (_float, repr),
    "request": (JobRequest.from_json, JobRequest.to_json),
    "prompt_ids": (_json_list, _dumps_list),
    "prompt_tokens": (int, str),
    "completion_tokens": (int, str),
    "attempts": (int, str),
    "callback_events": (_json_list, _dumps_list),
    "input": (_json_list, _dumps_list),
    "batch_size": (int, str),
    "error": (json.loads, encode_field),
    **{name: (_float, encode_field) for name in set(TIMESTAMP_FIELD.values()) | {"first_token_at"}},
}


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    """The job hash (`job:{id}`), typed. A field that is None is absent from the hash. Fields are
    in the order they are written at submit; those after `input` are written as the job moves."""

    id: str
    status: JobStatus
    model: str
    tenant: str
    # The job's kind (`app.core.discovery.kind_of` of its model) where it is not a generation:
    # EMBEDDING. The batcher sends a batch by its jobs' kind, never by a model's name.
    kind: str | None = None
    priority: str
    created_at: float
    request: JobRequest | None = None
    prompt_ids: tuple[int, ...] | None = None  # dropped once the job has ended
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str | None = None
    attempts: int | None = None
    route: str | None = None  # the route that chose `model`, and why
    route_reason: str | None = None
    deadline: float | None = None  # unix time by which it must have started
    callback_url: str | None = None
    callback_events: tuple[str, ...] | None = None
    input: tuple[str, ...] | None = None  # an embeddings job's texts, dropped once it has ended
    queued_at: float | None = None
    batch_id: str | None = None
    batch_size: int | None = None
    scheduled_at: float | None = None
    started_at: float | None = None
    recovered_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    embedding: str | None = None  # JSON vectors, until the API hands them over
    # Fields this version does not know (written by a newer one): kept as they are.
    other: Mapping[str, str] = field(default_factory=dict)

    def to_hash(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = _CODECS[name][1](value) if name in _CODECS else value
        return {**out, **self.other}

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> JobRecord:
        record = decode_record(raw)
        known: dict[str, Any] = {
            k: (_CODECS[k][0](v) if k in _CODECS else v) for k, v in record.items() if k in _FIELDS
        }
        other = {k: v for k, v in record.items() if k not in _FIELDS}
        return cls(**known, other=other)


_FIELDS = tuple(name for name in JobRecord.__dataclass_fields__ if name != "other")


# What a job may weigh in Redis, for its tenant's retained-bytes quota: its record with its texts, an
# event stream's first node (Redis allocates it whole, ~4.7 KB) and ~80 bytes an event, measured
# on Redis 7 (docs/operations.md, "Sizing"); while it waits, its prompt's token ids too.
RECORD_BYTES = 7_000
BYTES_PER_TOKEN_EVENT = 80
BYTES_PER_PROMPT_TOKEN = 4


def retained_bytes(record: JobRecord) -> int:
    """An upper estimate of what `record`'s job holds in Redis at its largest: every token it may
    generate streamed, its prompt (or embeddings input) still held."""
    tokens = record.request.max_tokens if record.request is not None else 0
    held = BYTES_PER_PROMPT_TOKEN * len(record.prompt_ids or ()) + sum(
        len(t.encode()) for t in record.input or ()
    )
    return RECORD_BYTES + BYTES_PER_TOKEN_EVENT * tokens + held
