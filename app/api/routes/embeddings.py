"""/v1/embeddings: sentence embeddings from the graph-partitioned all-MiniLM-L6-v2 pipeline."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from app.api import audit
from app.api.auth import current_tenant
from app.api.deps import get_jobs, get_settings
from app.api.routes.jobs import BODY_ERRORS, ERRORS
from app.api.service import JobService
from app.core.config import Settings

router = APIRouter(tags=["embeddings"])


class EmbeddingsCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"input": ["a cat", "a dog"]}]})

    input: str | list[str] = Field(description="A text or a list of texts (each truncated at 256 tokens).")
    model: str | None = Field(default=None, description="all-MiniLM-L6-v2 (the only embeddings model).")

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class Embedding(BaseModel):
    object: str = "embedding"
    index: int
    embedding: list[float]


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsPublic(BaseModel):
    object: str = "list"
    model: str
    data: list[Embedding]
    usage: EmbeddingsUsage


# 429 rate_limited; 502 job_failed; 503 not_served where no embeddings pipeline runs, or unavailable;
# 504 when the job does not finish within sync_timeout_s.
@router.post(
    "/v1/embeddings",
    response_model=EmbeddingsPublic,
    responses={**BODY_ERRORS, **{status: ERRORS[404] for status in (429, 502, 503, 504)}},
)
async def embeddings(
    body: EmbeddingsCreate,
    request: Request,
    jobs: JobService = Depends(get_jobs),
    settings: Settings = Depends(get_settings),
    tenant: str = Depends(current_tenant),
) -> EmbeddingsPublic:
    """Unit-length 384-dimensional vectors, in the order of `input` (OpenAI's response shape)."""
    vectors, record = await jobs.embed(body.texts(), body.model, tenant=tenant)
    audit.note_job(request, record)
    tokens = int(record.get("prompt_tokens", 0))
    return EmbeddingsPublic(
        model=record["model"],
        data=[Embedding(index=i, embedding=v) for i, v in enumerate(vectors)],
        usage=EmbeddingsUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
