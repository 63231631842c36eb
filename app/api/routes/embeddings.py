"""/v1/embeddings: sentence embeddings from the graph-partitioned all-MiniLM-L6-v2 pipeline."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.api import audit
from app.api.auth import current_tenant
from app.api.deps import get_jobs, get_settings
from app.api.routes.jobs import BODY_ERRORS, ERRORS
from app.api.service import JobService
from app.core.config import Settings

router = APIRouter(tags=["embeddings"])

DIMENSIONS = 384  # all-MiniLM-L6-v2's hidden size: the one size its vectors come in


class EmbeddingsCreate(BaseModel):
    # Unknown fields are accepted and ignored, as on the other OpenAI endpoints (docs/openai.md).
    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [{"input": ["a cat", "a dog"]}]})

    input: str | list[str] = Field(description="A text or a list of texts (each truncated at 256 tokens).")
    model: str | None = Field(default=None, description="all-MiniLM-L6-v2 (the only embeddings model).")
    encoding_format: Literal["float", "base64"] = Field(
        default="float",
        description="`float`: lists of numbers; `base64`: each vector as little-endian float32 bytes, "
        "base64-encoded (what the official OpenAI client asks for unless told otherwise).",
    )
    # The schema states the rule; _native_size enforces it with its own message.
    dimensions: int | None = Field(
        default=None,
        description=f"Only {DIMENSIONS}, the model's own size: vectors are not shortened.",
        json_schema_extra={"minimum": DIMENSIONS, "maximum": DIMENSIONS},
    )
    user: str | None = Field(default=None, description="Accepted and ignored.")

    @field_validator("dimensions")
    @classmethod
    def _native_size(cls, dimensions: int | None) -> int | None:
        if dimensions not in (None, DIMENSIONS):
            raise ValueError(
                f"dimensions is {dimensions}, but all-MiniLM-L6-v2 makes {DIMENSIONS}-dimensional "
                f"vectors and does not shorten them; leave dimensions out or set it to {DIMENSIONS}"
            )
        return dimensions

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class Embedding(BaseModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | str = Field(description="The vector, or its base64 float32 bytes.")


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsPublic(BaseModel):
    object: str = "list"
    model: str
    data: list[Embedding]
    usage: EmbeddingsUsage


# 429 rate_limited; 502 job_failed; 503 not_served where no embeddings pipeline runs, or unavailable;
# 504 when the job does not finish within the sync timeout (app/api/service.py, SYNC_TIMEOUT_S).
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
    tokens = record.prompt_tokens or 0
    encode = as_base64 if body.encoding_format == "base64" else list
    return EmbeddingsPublic(
        model=record.model,
        data=[Embedding(index=i, embedding=encode(v)) for i, v in enumerate(vectors)],
        usage=EmbeddingsUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


def as_base64(vector: list[float]) -> str:
    """A vector as OpenAI's `base64` encoding sends it: little-endian float32 bytes, base64-encoded
    (the official client decodes it with numpy.frombuffer(..., dtype="float32"))."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
