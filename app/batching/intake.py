"""Intake: one Redis Stream per priority class, read by the batcher's consumer group.

Why streams and not lists: `XREADGROUP COUNT n BLOCK t` takes a whole window in one round trip,
and an entry stays in the group's pending list until the batcher acknowledges it after dispatch,
so a batcher that dies mid-window loses nothing; a restarted one reads its pending entries again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from app.core.config import EMBEDDING_MAX_TOKENS
from app.core.keys import BATCHER_GROUP, PRIORITIES, Keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IntakeEntry:
    stream: str
    entry_id: str
    fields: dict[str, str]


def intake_fields(
    *,
    job_id: str,
    model: str,
    prompt_tokens: int,
    priority: str,
    deadline: float | None = None,
    tenant: str = "",
    max_tokens: int = 0,
    kind: str | None = None,
) -> dict[str, str]:
    """One intake entry. `deadline`: unix time by which the job must have started, else it expires;
    `tenant` and `max_tokens`: whose job it is and what it may generate, for fair share; `kind`: the
    job's (the record's), where it is not a generation (`app.core.discovery.EMBEDDING`)."""
    fields = {"job_id": job_id, "model": model, "prompt_tokens": str(prompt_tokens), "priority": priority}
    if deadline is not None:
        fields["deadline"] = repr(deadline)
    if tenant:
        fields["tenant"] = tenant
    if max_tokens:
        fields["max_tokens"] = str(max_tokens)
    if kind:
        fields["kind"] = kind
    return fields


def padded_positions(texts: Sequence[str], max_length: int = EMBEDDING_MAX_TOKENS) -> int:
    """What an embeddings job will cost, for its entry's `prompt_tokens`, before any tokenizer has
    read its texts: its rows times the longest one's tokens, estimated at a token per two bytes
    (English and Japanese run at three to four bytes a token, Cyrillic near two) plus the two special
    tokens, capped at `max_length`. An estimate, for the batcher to size batches of them as it sizes
    prompts (`max_prefill_tokens`): the stages bound the memory of any batch themselves."""
    longest = max((len(t.encode()) for t in texts), default=0)
    return len(texts) * min(max_length, -(-longest // 2) + 2)


BYTES_PER_POSITION = 2  # padded_positions' estimate of a token


def padded_bytes(texts: Sequence[str]) -> int:
    """What an embeddings request is charged on its tenant's `embedding_bytes_per_min`: the work a
    batch does for it, its padded token positions (`padded_positions`: every text as long as the
    longest) at BYTES_PER_POSITION bytes each, or its bytes if more (what it holds in Redis). 64
    one-byte texts beside one 500-byte text are 565 bytes but as much work as 64 long texts."""
    return max(sum(len(t.encode()) for t in texts), BYTES_PER_POSITION * padded_positions(texts))


def ensure_groups(client: redis.Redis, keys: Keys) -> None:
    for stream in [*(keys.intake(p) for p in PRIORITIES), keys.control()]:
        try:
            client.xgroup_create(stream, BATCHER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def read(
    client: redis.Redis, keys: Keys, consumer: str, *, count: int, block_ms: int | None, backlog: bool = False
) -> Iterator[IntakeEntry]:
    """Read new entries (or, with backlog=True, this consumer's unacknowledged ones)."""
    streams: dict[Any, Any] = {keys.intake(p): "0" if backlog else ">" for p in PRIORITIES}
    streams[keys.control()] = "0" if backlog else ">"
    reply: Any = client.xreadgroup(BATCHER_GROUP, consumer, streams, count=count, block=block_ms)
    for stream, entries in reply or []:
        name = stream.decode() if isinstance(stream, bytes) else stream
        for entry_id, fields in entries:
            if fields is None:  # entry trimmed away while pending
                continue
            yield IntakeEntry(
                stream=name,
                entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
                fields={_s(k): _s(v) for k, v in fields.items()},
            )


def ack(client: Any, keys: Keys, entries: list[tuple[str, str]]) -> None:
    by_stream: dict[str, list[str]] = {}
    for stream, entry_id in entries:
        by_stream.setdefault(stream, []).append(entry_id)
    pipe = client.pipeline(transaction=False)
    for stream, ids in by_stream.items():
        pipe.xack(stream, BATCHER_GROUP, *ids)
        pipe.xdel(stream, *ids)  # dispatched work lives on in the job record; keep the stream short
    pipe.execute()


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
