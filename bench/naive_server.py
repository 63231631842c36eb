"""The "monolith" baseline: one process loads the model once and serves one request at a time.

`POST /generate` takes {"messages" | "prompt", "max_tokens", "ignore_eos"} and answers with the whole text
when generation ends (no streaming). One thread runs every `model.generate`, one request at a time in
arrival order; waiting requests queue in the event loop (a `def` endpoint with a lock would hold the
thread pool's 40 tokens, and finished answers would wait behind the queue). Greedy, fp32, prompts
rendered with the model's chat template as Conveyor's api renders them.

Run (the benchmark does this for you):

    BENCH_MODEL_PATH=.conveyor/models/SmolLM2-135M-Instruct \\
        .venv/bin/python -m uvicorn --factory bench.naive_server:app_from_env --host 127.0.0.1 --port 8100
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.prompts import chat_ids

MODEL_PATH_ENV = "BENCH_MODEL_PATH"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    max_tokens: int = Field(default=128, ge=1, le=1024)
    ignore_eos: bool = Field(default=False, description="Generate exactly max_tokens.")

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class GenerateResponse(BaseModel):
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    generate_s: float


def generate_rows(
    model: Any, rows: Sequence[list[int]], pad_id: int, max_tokens: int, *, exact: bool, streamer: Any = None
) -> torch.Tensor:
    """One greedy `generate` call over token id rows, left-padded to one width: the new tokens
    [B, <= max_tokens], exactly `max_tokens` when `exact` (EOS ignored). The naive server's requests (a
    row each), raw `generate` (bench/suite.py) and Ray Serve's batches (bench/rayserve_app.py) call it."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, S]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, S]
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    with torch.inference_mode():
        output = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            streamer=streamer,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens if exact else None,
            pad_token_id=pad_id,
        )
    return output[:, width:]  # type: ignore[no-any-return]


class Engine:
    """The model, its tokenizer and the one thread that runs them, a request at a time."""

    def __init__(self, model_path: Path) -> None:
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")

    def encode(self, body: GenerateRequest) -> list[int]:
        if body.messages is not None:
            return chat_ids(self.tokenizer, [m.model_dump() for m in body.messages])
        return list(self.tokenizer(body.prompt).input_ids)

    def generate(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool) -> tuple[list[int], float]:
        """The generated token ids and the seconds spent generating (not waiting for the runner)."""
        started, pad_id = time.perf_counter(), self.tokenizer.pad_token_id
        new = generate_rows(self.model, [prompt_ids], pad_id, max_tokens, exact=ignore_eos)  # [1, <= n]
        return [int(t) for t in new[0]], time.perf_counter() - started


def create_app(model_path: Path) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = Engine(model_path)  # uvicorn accepts connections only after this
        yield
        app.state.engine.runner.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="naive server (benchmark baseline)", lifespan=lifespan)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
        engine: Engine = request.app.state.engine
        prompt_ids = engine.encode(body)  # about a millisecond: on the event loop
        if not prompt_ids:
            raise HTTPException(status_code=422, detail="empty prompt")
        token_ids, elapsed = await asyncio.get_running_loop().run_in_executor(
            engine.runner, engine.generate, prompt_ids, body.max_tokens, body.ignore_eos
        )
        return GenerateResponse(
            text=engine.tokenizer.decode(token_ids, skip_special_tokens=True),
            token_ids=token_ids,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(token_ids),
            generate_s=elapsed,
        )

    return app


def app_from_env() -> FastAPI:
    """uvicorn factory: the model directory comes from $BENCH_MODEL_PATH."""
    return create_app(Path(os.environ[MODEL_PATH_ENV]))
