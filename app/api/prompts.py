"""A job's prompt as token ids, for the API (JobService.submit, after the tenant's rate limit).

Tokenizing is CPU work proportional to the prompt: a 1 MB prompt holds a tokenizer for about half a
second. So a prompt with more characters than its model's context could ever hold is refused before
it is read, and tokenizing runs on a pool of `Settings.tokenize_threads` threads of its own, never on
the event loop, where every other request (health checks included) would wait behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from app.api.catalog import ModelInfo
from app.api.schemas import JobCreate
from app.core.config import PromptEncoderSettings
from app.core.errors import ContextLengthExceeded, InvalidRequest

T = TypeVar("T")


class PromptEncoder:
    """One per API process (JobService.prompts); `close` at the API's shutdown. `settings`:
    `Settings.prompt_encoder`."""

    def __init__(self, settings: PromptEncoderSettings) -> None:
        self.chars_per_token = settings.max_prompt_chars_per_token
        self._pool = ThreadPoolExecutor(settings.tokenize_threads, thread_name_prefix="tokenize")

    async def encode(self, model: ModelInfo, request: JobCreate) -> list[int]:
        """The prompt's (or the rendered chat's) token ids; 422 for one too long or empty."""
        texts = (
            [m.content for m in request.messages] if request.messages is not None else [request.prompt or ""]
        )
        self.check_length(model, sum(len(text) for text in texts))
        loop = asyncio.get_running_loop()
        if request.messages is not None:
            messages = [m.model_dump() for m in request.messages]
            prompt_ids = await loop.run_in_executor(self._pool, model.encode_chat, messages)
        else:
            prompt_ids = await loop.run_in_executor(self._pool, model.encode_prompt, request.prompt or "")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        return prompt_ids

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizing threads (/tokenize, /detokenize)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def check_length(self, model: ModelInfo, chars: int) -> None:
        most = model.context_length * self.chars_per_token
        if chars > most:
            raise ContextLengthExceeded(
                f"the prompt is {chars} characters, more than a context of {model.context_length} tokens "
                f"can hold ({most} characters at {self.chars_per_token} a token)",
                limit=model.context_length,
                prompt_chars=chars,
                max_prompt_chars=most,
            )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
