"""The batch feeder: turns each open batch's lines into jobs as the `batch` class has room, collects
their results as they end, and writes the output and error files (OpenAI's Batch API, docs/batches.md).

It runs in every API process, because the submit path it feeds through (tokenizers, admission, the
job store's write) lives there; one at a time holds the lease (`Keys.batch_feeder`), and another
takes over within `LEASE_S` of the holder's death. A pass, every FEED_INTERVAL_S:

- `validating`: the input file is read and every line checked (JSON, `custom_id` unique, `method`,
  `url` equal to the batch's endpoint, a body the endpoint accepts, a known model); a batch with a
  bad line is `failed` with `errors`; otherwise its lines are stored and it is `in_progress`.
- `in_progress`: lines are submitted, in order, while the batch class holds fewer than its share
  (FEED_SHARE) of `queue_depth_limit` waiting jobs, at most `FEED_PER_PASS` a pass; a refusal
  of admission (429, 503) leaves the line for a later pass. A line's job id is derived from (batch
  id, line index) (`batchstore.line_job_id`) and the job store writes an id once, so a feeder that
  dies between writing a job and moving the batch's cursor (`fed`) past it writes no second job when
  the line is fed again. A line refused for good (4xx: a prompt over the context...) is collected as an error.
- every pass, the fed lines whose jobs have ended are collected (`BatchStore.collect`, once per
  line); when all are, the batch goes `finalizing`, then `completed` with its files.
- `cancelling` (POST /v1/batches/{id}/cancel) and a window that has passed: feeding stops, the jobs
  not ended are cancelled, and once every fed line is collected the batch ends `cancelled` or
  `expired` with the files of what was done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import suppress
from typing import Any

from pydantic import BaseModel

from app.api.batch_schemas import BatchPublic
from app.api.batchlines import EMBEDDINGS, SCHEMAS, LineError, error_line, output_line, parse_line
from app.api.chat_schemas import ChatCompletionCreate
from app.api.openai_schemas import OpenAIRequest
from app.api.routes.embeddings import (
    Embedding,
    EmbeddingsCreate,
    EmbeddingsPublic,
    EmbeddingsUsage,
    as_base64,
)
from app.api.routes.openai import ChatReply, CompletionReply, Reply, tool_format_of
from app.api.service import JobService
from app.api.toolformats import ToolFormat
from app.core import batchstore as bs
from app.core.batchstore import BatchStore, line_job_id, output_file_id
from app.core.config import EMBEDDING_MODEL, Settings
from app.core.discovery import EMBEDDING, kind_of
from app.core.errors import ConveyorError, JobFinished, JobNotFound, Refused
from app.core.jobrecord import JobRecord
from app.core.jobs import JobStatus
from app.core.keys import Keys
from app.core.scripts import HOLD_LEASE, RELEASE_IF_HELD, Script
from app.webhooks.events import batch_end_event
from app.webhooks.retries import RetryQueue

log = logging.getLogger(__name__)

LEASE_S = 10.0  # another API process takes over this long after the holder stops renewing
FEED_INTERVAL_S = 1.0  # how often the feeder looks for room, feeds lines, collects the results of ended jobs
# The part of the batch class's queue_depth_limit that batches' lines may fill: they are fed as it
# has room, and the other half is left to jobs submitted with priority `batch` directly.
FEED_SHARE = 0.5
MAX_ERRORS = 100  # validation errors kept on a failed batch
COLLECT_PER_PASS = 2000  # job records read per batch per pass
# Lines submitted per pass, over all batches: a submit's work (tokenizing, admission) runs in this API
# process, so a pass is kept short, and each submit yields to the requests it serves meanwhile.
FEED_PER_PASS = 64

REPLIES: dict[str, type[Reply]] = {"/v1/chat/completions": ChatReply, "/v1/completions": CompletionReply}


class BatchFeeder:
    """One per API process, started and stopped by the app's lifespan (`run` as a task)."""

    def __init__(self, settings: Settings, jobs: JobService, store: BatchStore) -> None:
        self.settings = settings
        self.jobs = jobs
        self.store = store
        self.redis = jobs.redis
        self.keys: Keys = jobs.keys
        self.owner = uuid.uuid4().hex
        self._lease = Script(self.redis, HOLD_LEASE)
        self._release = Script(self.redis, RELEASE_IF_HELD)
        self._stopping = asyncio.Event()
        self.retries = RetryQueue(self.redis, self.keys)

    async def run(self) -> None:
        """Pass after pass while this process holds the lease, until `stop`; never dies on one bad
        batch. On its way out it gives the lease up, so another process takes over at once."""
        try:
            while not self._stopping.is_set():
                try:
                    if await self._hold_lease():
                        await self.feed_pass()
                except Exception:
                    log.warning("batch feeder pass failed", exc_info=True)
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), FEED_INTERVAL_S)
        finally:
            with suppress(Exception):
                await asyncio.shield(
                    self._release(keys={"lease": self.keys.batch_feeder()}, args={"holder": self.owner})
                )

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Stop `task` (this feeder's `run`): at once if it waits, else at its next step. The flag
        holds even where a client library swallowed the cancellation (redis-py may, mid-command)."""
        self._stopping.set()
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task

    async def _hold_lease(self) -> bool:
        args = {"holder": self.owner, "ms": int(LEASE_S * 1000)}
        return bool(await self._lease(keys={"lease": self.keys.batch_feeder()}, args=args))

    async def feed_pass(self) -> None:
        """One pass over every open batch, oldest first (the lease's holder calls it; tests call it)."""
        await self.announce()
        room = min(await self._room(), FEED_PER_PASS)
        for batch_id in await self.store.open_ids():
            try:
                batch = await self.store.batch(batch_id, tenant=None)
            except ConveyorError:
                await self.store.forget(batch_id)  # its record expired
                continue
            try:
                room -= await self._step(batch, room)
            except Exception:
                log.warning("batch %s: pass failed; tried again next pass", batch_id, exc_info=True)

    async def announce(self) -> None:
        """Hand each ended batch with a callback to the webhook retry queue, due now (the dispatcher
        sends it on to the callbacks workers, which sign it with the tenant's secret and retry). A
        tenant whose retry queue is full keeps its event here until a later pass finds room."""
        for batch_id in await self.store.to_announce():
            try:
                record = await self.store.batch(batch_id, tenant=None)
            except ConveyorError:
                await self.store.announced(batch_id)  # its record expired: nothing left to say
                continue
            public = BatchPublic.of(record).model_dump(mode="json")
            now = time.time()
            event = batch_end_event(public, at=now)
            message = event.message(record["announce_url"], record["tenant"])
            if await self.retries.schedule_async(message, due=now):
                await self.store.announced(batch_id)
            else:
                log.warning("batch %s: its tenant's webhook retry queue is full; announced later", batch_id)

    async def _room(self) -> int:
        depth = int(await self.redis.xlen(self.keys.intake("batch")))
        return int(self.settings.queue_depth_limit * FEED_SHARE) - depth

    async def _step(self, batch: dict[str, str], room: int) -> int:
        """Advance one batch; the lines it fed."""
        status = batch["status"]
        if status == bs.VALIDATING:
            await self.validate(batch)
            return 0
        ending = status == bs.CANCELLING or (
            status == bs.IN_PROGRESS and time.time() >= int(batch["expires_at"])
        )
        fed = 0
        if status == bs.IN_PROGRESS and not ending:
            fed = await self._feed(batch, room)
        if status in (bs.IN_PROGRESS, bs.CANCELLING, bs.FINALIZING):
            batch = await self.store.batch(batch["id"], tenant=None)
            reason = None
            if ending:
                reason = "its batch was cancelled" if status == bs.CANCELLING else "its batch's window passed"
            done = await self._collect(batch, cancel=reason)
            total, now_fed = int(batch["total"]), int(batch["fed"])
            if ending and done:
                await self._finish(batch, bs.CANCELLED if status == bs.CANCELLING else bs.EXPIRED)
            elif done and now_fed == total:
                await self._finish(batch, bs.COMPLETED)
        return fed

    async def validate(self, batch: dict[str, str]) -> None:
        """Check every line of the input file: `in_progress` with its lines, or `failed` with errors."""
        errors: list[dict[str, Any]] = []
        lines: list[str] = []
        try:
            content = await self.store.content(batch["input_file_id"], tenant=batch["tenant"])
            text = content.decode()
        except ConveyorError:
            errors.append(
                {"code": "invalid_file", "message": "the input file does not exist (or has expired)"}
            )
        except UnicodeDecodeError:
            errors.append({"code": "invalid_file", "message": "the input file is not UTF-8"})
        else:
            lines, errors = await self._checked_lines(text, batch["endpoint"])
        if errors:
            await self.store.move(
                batch["id"], bs.FAILED, errors=json.dumps({"object": "list", "data": errors})
            )
            return
        await self.store.start(batch["id"], lines)

    async def _checked_lines(self, text: str, endpoint: str) -> tuple[list[str], list[dict[str, Any]]]:
        lines: list[str] = []
        errors: list[dict[str, Any]] = []
        seen: set[str] = set()
        models: dict[Any, bool] = {}
        numbered = [(n, t) for n, t in enumerate(text.splitlines(), 1) if t.strip()]
        if not numbered:
            return [], [{"code": "empty_file", "message": "the input file has no lines", "line": None}]
        if len(numbered) > bs.FILE_MAX_LINES:
            limit = bs.FILE_MAX_LINES
            return [], [{"code": "too_many_lines", "message": f"at most {limit} lines", "line": None}]
        for number, line in numbered:
            try:
                parsed = parse_line(line, number=number, endpoint=endpoint, seen=seen)
                model = parsed["body"].get("model") or self.settings.default_model
                if endpoint == EMBEDDINGS:
                    model = parsed["body"].get("model") or EMBEDDING_MODEL
                    models[model] = kind_of(model) == EMBEDDING
                elif model not in models:
                    models[model] = await self._known(model)
                if not models[model]:
                    raise LineError(
                        "model_not_found",
                        f"model {str(model)[:64]!r} does not exist",
                        line=number,
                        param="body.model",
                    )
                lines.append(json.dumps(parsed, ensure_ascii=False))
            except LineError as exc:
                if len(errors) < MAX_ERRORS:
                    errors.append(exc.entry)
        return lines, errors

    async def _known(self, model: Any) -> bool:
        if not isinstance(model, str):
            return False
        if self.jobs.catalog.route(model) is not None:
            return True
        with suppress(ConveyorError):
            await self.jobs.model(model)
            return True
        return False

    async def _feed(self, batch: dict[str, str], room: int) -> int:
        """Submit the batch's next lines, at most `room`; advance its cursor past those written."""
        batch_id, start, total = batch["id"], int(batch["fed"]), int(batch["total"])
        count = max(0, min(room, total - start))
        if count == 0:
            return 0
        index = start
        for line in await self.store.lines(batch_id, start, start + count):
            if not await self._submit(batch, index, json.loads(line)):
                break
            index += 1
            await asyncio.sleep(0)  # an interactive request waiting on this process goes first
        if index > start:
            await self.store.fed(batch_id, index)
        return index - start

    async def _submit(self, batch: dict[str, str], index: int, line: dict[str, Any]) -> bool:
        """Line `index` as its job; False when admission has no room now (fed again next pass)."""
        job_id = line_job_id(batch["id"], index)
        try:
            request = SCHEMAS[batch["endpoint"]].model_validate(line["body"])
            deadline = float(batch["expires_at"])
            if isinstance(request, EmbeddingsCreate):
                await self.jobs.submit_embedding_line(
                    request.texts(), request.model, tenant=batch["tenant"], job_id=job_id, deadline=deadline
                )
            else:
                assert isinstance(request, OpenAIRequest)
                if isinstance(request, ChatCompletionCreate):
                    made = request.to_job(await self._tool_format(request))
                else:
                    made = request.to_job()
                job = made.model_copy(update={"priority": "batch", "timeout_s": None})
                await self.jobs.submit_line(job, tenant=batch["tenant"], job_id=job_id, deadline=deadline)
        except Refused:
            return False
        except ConveyorError as exc:  # this line can never run: its answer is the refusal
            answer = output_line(job_id, line["custom_id"], status_code=exc.status, body=exc.body())
            await self.store.collect(batch["id"], index, answer, ok=False)
        return True

    async def _collect(self, batch: dict[str, str], *, cancel: str | None) -> bool:
        """Collect the fed lines whose jobs have ended (with `cancel`, a reason, cancel those that
        have not); True when every fed line is collected."""
        batch_id, fed = batch["id"], int(batch["fed"])
        collected = await self.store.collected(batch_id)
        uncollected = [i for i in range(fed) if i not in collected]
        waiting = uncollected[:COLLECT_PER_PASS]
        if not waiting:
            return True
        records = await self.jobs.store.get_many([line_job_id(batch_id, index) for index in waiting])
        lines = None
        left = len(waiting)
        for index, record in zip(waiting, records, strict=True):
            if record is not None and not record.status.is_finished:
                if cancel is not None:
                    with suppress(JobFinished, JobNotFound):
                        await self.jobs.cancel(record.id, tenant=None, reason=cancel)
                continue
            if lines is None:
                lines = await self._lines(batch_id, waiting)
            await self._collect_one(batch, index, lines[index], record)
            left -= 1
        return left == 0 and len(waiting) == len(uncollected)

    async def _lines(self, batch_id: str, indexes: list[int]) -> dict[int, dict[str, Any]]:
        lines = await self.store.lines(batch_id, min(indexes), max(indexes) + 1)
        first = min(indexes)
        return {i: json.loads(lines[i - first]) for i in indexes}

    async def _tool_format(
        self, request: ChatCompletionCreate, model: str | None = None
    ) -> ToolFormat | None:
        """The format of the model's tool calls, when the line asks for them to be read."""
        if request.tool_mode == "none":
            return None
        return await tool_format_of(self.jobs, model or request.model)

    async def _collect_one(
        self, batch: dict[str, str], index: int, line: dict[str, Any], record: JobRecord | None
    ) -> None:
        job_id, custom_id = line_job_id(batch["id"], index), line["custom_id"]
        if record is not None and record.status == JobStatus.SUCCEEDED:
            body: BaseModel
            if batch["endpoint"] == EMBEDDINGS:
                body = _embeddings(record, EmbeddingsCreate.model_validate(line["body"]))
            elif batch["endpoint"] == "/v1/chat/completions":  # its calls read in its model's format
                request = ChatCompletionCreate.model_validate(line["body"])
                tool_format = await self._tool_format(request, record.model)
                tools = request.tool_use(tool_format) if tool_format is not None else None
                body = ChatReply(record, tools=tools).whole(record)
            else:
                body = REPLIES[batch["endpoint"]](record).whole(record)
            answer = output_line(job_id, custom_id, status_code=200, body=_dump(body))
            await self.store.collect(batch["id"], index, answer, ok=True)
            if batch["endpoint"] == EMBEDDINGS:
                await self.jobs.store.forget_embedding(job_id)  # its vectors are in the line now
            return
        if record is None:
            code, message = "job_lost", f"job {job_id} expired before its result was collected"
        else:
            error = record.error or {}
            code = str(error.get("code") or record.status)
            message = f"job {job_id} ended {record.status}: {error.get('message', 'no reason recorded')}"
        await self.store.collect(
            batch["id"], index, error_line(job_id, custom_id, code=code, message=message), ok=False
        )

    async def _finish(self, batch: dict[str, str], final: str) -> None:
        """Write the output and error files from the collected lines, in input order, and end the batch."""
        batch_id = batch["id"]
        if final == bs.COMPLETED:
            moved, had = await self.store.move(batch_id, bs.FINALIZING)
            if not moved and had != bs.FINALIZING:
                return
        results = await self.store.results(batch_id)
        if final == bs.EXPIRED:  # lines never fed are answered too, as OpenAI answers them
            lines = await self.store.lines(batch_id, int(batch["fed"]), int(batch["total"]))
            for offset, line in enumerate(lines):
                index = int(batch["fed"]) + offset
                message = "the batch's completion window passed before this request was run"
                error = error_line(
                    line_job_id(batch_id, index),
                    json.loads(line)["custom_id"],
                    code="batch_expired",
                    message=message,
                )
                await self.store.collect(batch_id, index, error, ok=False)
            results = await self.store.results(batch_id)
        files: dict[str, str] = {}
        for kind, ok in (("output", True), ("error", False)):
            chosen = [line for _, is_ok, line in results if is_ok == ok]
            if chosen:
                stored = await self.store.put_file(
                    tenant=batch["tenant"],
                    filename=f"{batch_id}_{kind}.jsonl",
                    purpose="batch_output",
                    content=("\n".join(chosen) + "\n").encode(),
                    quota=None,
                    file_id=output_file_id(batch_id, kind),
                )
                files[f"{kind}_file_id"] = stored.id
        await self.store.move(batch_id, final, **files)
        log.info("batch %s ended %s: %d lines answered", batch_id, final, len(results))


def _embeddings(record: JobRecord, request: EmbeddingsCreate) -> EmbeddingsPublic:
    """What POST /v1/embeddings answers for the line's request (its `encoding_format` included)."""
    vectors = json.loads(record.embedding or "[]")
    tokens = record.prompt_tokens or 0
    encode = as_base64 if request.encoding_format == "base64" else list
    return EmbeddingsPublic(
        model=record.model,
        data=[Embedding(index=i, embedding=encode(v)) for i, v in enumerate(vectors)],
        usage=EmbeddingsUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


def _dump(body: BaseModel) -> dict[str, Any]:
    return body.model_dump(mode="json")
