"""A job's prompt as token ids, for the API (JobService.submit, after the tenant's rate limit).

Tokenizing is CPU work proportional to the prompt: a 1 MB prompt holds a tokenizer for about half a
second, and a chat's template renders each message. So a prompt with more characters than its
model's context could ever hold, or a chat whose messages' template tokens alone overflow it, is
refused before it is rendered or read, and rendering and tokenizing run on a pool of
TOKENIZE_THREADS threads of its own, never on the event loop, where every other request
(health checks included) would wait behind it. (The number of messages is capped before the rate
limit: `JobService.check_messages`.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from app.api.catalog import ModelInfo
from app.api.schemas import JobCreate
from app.core.errors import ContextLengthExceeded, InvalidRequest

T = TypeVar("T")
# A prompt of more than context length x this many characters is refused (422) before it is
# tokenized: text averages about 4 characters a token, and even runs of spaces stay under 16, so
# nothing refused would have fit; a 1 MB prompt would hold a tokenizer thread for half a second.
MAX_PROMPT_CHARS_PER_TOKEN = 16
TOKENIZE_THREADS = 4  # prompts past them wait their turn, off the event loop


class PromptEncoder:
    """One per API process (JobService.prompts); `close` at the API's shutdown."""

    def __init__(self) -> None:
        self.chars_per_token = MAX_PROMPT_CHARS_PER_TOKEN
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")

    async def encode(self, model: ModelInfo, request: JobCreate) -> list[int]:
        """The prompt's (or the rendered chat's) token ids, only the last `truncate_prompt_tokens`
        when asked; 422 for one too long or empty."""
        if request.prompt_token_ids is not None:
            return self._given_ids(model, request.prompt_token_ids, request.truncate_prompt_tokens)
        texts = (
            [m.content for m in request.messages] if request.messages is not None else [request.prompt or ""]
        )
        extra = len(json.dumps(request.chat_template_kwargs)) if request.chat_template_kwargs else 0
        tools = [t.for_template() for t in request.tools] if request.tools else None
        extra += len(json.dumps(tools)) if tools else 0
        extra += sum(len(c.function.arguments) for m in request.messages or () for c in m.tool_calls or ())
        self.check_length(model, sum(len(text) for text in texts) + extra)
        loop = asyncio.get_running_loop()
        if request.messages is not None:
            per_message = await loop.run_in_executor(self._pool, lambda: model.message_tokens)  # once a model
            self.check_messages(model, len(request.messages), per_message)
            chat = request.messages

            def encode_chat() -> list[int]:  # the messages' conversion too runs off the event loop
                return model.encode_chat(
                    [m.for_template() for m in chat],
                    add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                    template_kwargs=request.chat_template_kwargs,
                    add_special_tokens=bool(request.add_special_tokens),
                    tools=tools,
                )

            encode: Callable[[], list[int]] = encode_chat
        else:
            add_special_tokens = request.add_special_tokens is not False
            encode = partial(model.encode_prompt, request.prompt or "", add_special_tokens=add_special_tokens)
        prompt_ids = await loop.run_in_executor(self._pool, encode)
        if request.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-request.truncate_prompt_tokens :]
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        return prompt_ids

    def _given_ids(self, model: ModelInfo, ids: list[int], truncate: int | None) -> list[int]:
        """A prompt given as token ids: each inside the model's vocabulary, only the last `truncate`."""
        vocab = model.vocab_size if model.vocab_size is not None else 2**31
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise InvalidRequest(
                f"prompt_token_ids holds token id {outside[0]}, outside the vocabulary (0 to {vocab - 1})"
            )
        return list(ids[-truncate:] if truncate is not None else ids)

    async def encode_words(self, model: ModelInfo, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """`bad_words` as token sequences (ModelInfo.encode_words), on the tokenizing threads."""
        if not words:
            return ()
        return await self.run(model.encode_words, words)

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

    def check_messages(self, model: ModelInfo, count: int, per_message: int) -> None:
        """A chat whose template tokens alone (`per_message`: `ModelInfo.message_tokens`) overflow the
        context: 422 before anything is rendered."""
        template = count * per_message
        if template > model.context_length:
            raise ContextLengthExceeded(
                f"the chat's {count} messages take at least {template} tokens of chat template, more "
                f"than the context of {model.context_length} tokens",
                limit=model.context_length,
                messages=count,
                template_tokens=template,
            )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
