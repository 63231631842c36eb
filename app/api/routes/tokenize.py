"""/tokenize and /detokenize as vLLM serves them: a model's tokenizer (and chat template) without a job.

The text is tokenized on the prompt encoder's threads (app/api/prompts.py), never on the event loop,
and a text longer than the model's context could hold is refused before it is read.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from app.api.auth import current_tenant
from app.api.catalog import ModelInfo
from app.api.deps import get_jobs
from app.api.routes.jobs import BODY_ERRORS
from app.api.service import JobService
from app.api.tokenize_schemas import DetokenizeCreate, DetokenizeResult, TokenizeCreate, TokenizeResult
from app.core.errors import InvalidRequest

router = APIRouter(tags=["tokenize"])


@router.post("/tokenize", response_model=TokenizeResult, responses=BODY_ERRORS)
async def tokenize(
    body: TokenizeCreate, jobs: JobService = Depends(get_jobs), _: str = Depends(current_tenant)
) -> TokenizeResult:
    """The token ids of a prompt, or of chat messages rendered with the model's template."""
    model = await jobs.model(body.model)
    if body.messages is not None:
        jobs.prompts.check_length(model, sum(len(m.content) for m in body.messages))
        messages = [m.for_template() for m in body.messages]
        special = bool(body.add_special_tokens)
        ids = await jobs.prompts.run(_chat_ids, model, messages, body.add_generation_prompt, special)
    else:
        text = body.prompt or ""
        jobs.prompts.check_length(model, len(text))
        special = body.add_special_tokens is not False
        ids = await jobs.prompts.run(_prompt_ids, model, text, special)
    return TokenizeResult(count=len(ids), max_model_len=model.context_length, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResult, responses=BODY_ERRORS)
async def detokenize(
    body: DetokenizeCreate, jobs: JobService = Depends(get_jobs), _: str = Depends(current_tenant)
) -> DetokenizeResult:
    """The text of token ids; an id outside the model's vocabulary is 422 invalid_request."""
    model = await jobs.model(body.model)
    vocab = len(model.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"token ids must be 0 to {vocab - 1} (the vocabulary of {model.name}); got {bad[:8]}",
            limit=vocab,
            invalid=bad[:8],
        )
    prompt = await jobs.prompts.run(model.tokenizer.decode, body.tokens)
    return DetokenizeResult(prompt=prompt)


def _prompt_ids(model: ModelInfo, text: str, special: bool) -> list[int]:
    return list(model.tokenizer(text, add_special_tokens=special).input_ids)


def _chat_ids(model: ModelInfo, messages: list[dict[str, Any]], generation: bool, special: bool) -> list[int]:
    if not model.chat:
        raise InvalidRequest(
            f"model {model.name!r} has no chat template; send 'prompt' instead", model=model.name
        )
    return model.encode_chat(messages, add_generation_prompt=generation, add_special_tokens=special)
