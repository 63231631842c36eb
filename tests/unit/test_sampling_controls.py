"""vLLM's sampling controls (`constrain`, min_p in `filter_logits`) against transformers' logits
processors, which define them: the same logits row by row, and rows without a control untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from app.core.sampling import SamplingParams
from app.workers.sampling import constrain, filter_logits

VOCAB = 50
PROMPT = [3, 4, 5, 3]
OUTPUT = [7, 8, 7, 7, 9]


class OutputPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens after the prompt (transformers has
    none): logit - frequency x count - presence x (count > 0)."""

    def __init__(self, prompt_len: int, *, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        for row, ids in enumerate(input_ids[:, self.prompt_len :]):
            counts[row].index_add_(0, ids, torch.ones(len(ids)))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def reference(processor: LogitsProcessor, scores: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return processor(torch.tensor([ids]), scores.clone())


def ours(params: SamplingParams, scores: torch.Tensor) -> torch.Tensor:
    return constrain(scores, [params], prompts=[PROMPT], outputs=[OUTPUT])


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers_over_prompt_and_output(penalty: float) -> None:
    scores = logits()
    want = reference(RepetitionPenaltyLogitsProcessor(penalty), scores, PROMPT + OUTPUT)
    assert torch.equal(ours(SamplingParams(repetition_penalty=penalty), scores), want)


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.4), (-1.0, 1.5)])
def test_presence_and_frequency_penalties_count_the_output_only(presence: float, frequency: float) -> None:
    scores = logits()
    want = reference(
        OutputPenalties(len(PROMPT), presence=presence, frequency=frequency), scores, PROMPT + OUTPUT
    )
    got = ours(SamplingParams(presence_penalty=presence, frequency_penalty=frequency), scores)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[0, PROMPT[:2]], scores[0, PROMPT[:2]]), "prompt tokens are not penalized"


def test_all_three_penalties_apply_in_vllms_order() -> None:
    scores = logits()
    want = reference(RepetitionPenaltyLogitsProcessor(1.2), scores, PROMPT + OUTPUT)
    want = reference(OutputPenalties(len(PROMPT), presence=0.3, frequency=0.2), want, PROMPT + OUTPUT)
    params = SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2)
    assert torch.allclose(ours(params, scores), want, atol=1e-6)


def test_logit_bias_is_transformers_sequence_bias_of_single_tokens() -> None:
    scores = logits()
    bias = ((2, 5.0), (11, -100.0), (49, 0.25))
    want = reference(SequenceBiasLogitsProcessor([[[t], b] for t, b in bias]), scores, PROMPT + OUTPUT)
    assert torch.allclose(ours(SamplingParams(logit_bias=bias), scores), want)


def test_allowed_token_ids_leave_only_those() -> None:
    scores = logits()
    allowed = (1, 6, 30)
    processor = PrefixConstrainedLogitsProcessor(lambda _batch, _ids: list(allowed), num_beams=1)
    got = ours(SamplingParams(allowed_token_ids=allowed), scores)
    assert torch.equal(got, reference(processor, scores, PROMPT + OUTPUT))
    assert int(got.argmax()) in allowed


def test_bad_words_ban_the_token_that_would_complete_one() -> None:
    scores = logits()
    # A one-token word is always banned; [7, 9, 12] ends the output with 7, 9: 12 is banned; [8, 13]
    # does not (the output ends with 9).
    words = ((4,), (7, 9, 12), (8, 13))
    processor = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=0)
    got = ours(SamplingParams(bad_words=words), scores)
    assert torch.equal(got, reference(processor, scores, OUTPUT))  # vLLM matches the output alone
    assert got[0, 4] == got[0, 12] == float("-inf") and got[0, 13] == scores[0, 13]


def test_min_p_is_transformers_min_p_warper() -> None:
    scores = logits(4, seed=3)
    for min_p in (0.05, 0.2, 0.9):
        want = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), scores.clone())
        got = filter_logits(
            scores,
            top_k=torch.zeros(4, dtype=torch.long),
            top_p=torch.ones(4),
            min_p=torch.full((4,), min_p),
        )
        assert torch.equal(got.isinf(), want.isinf()), min_p


def test_rows_without_a_control_are_untouched() -> None:
    scores = logits(3)
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5, logit_bias=((1, 3.0),)),
        SamplingParams(),
    ]
    outputs: list[list[int]] = [OUTPUT, OUTPUT, OUTPUT]
    got = constrain(scores, params, prompts=[PROMPT] * 3, outputs=outputs)
    assert torch.equal(got[0], scores[0]) and torch.equal(got[2], scores[2])
    assert torch.equal(got[1:2], ours(params[1], scores[1:2]))
    assert constrain(scores, [SamplingParams()] * 3, prompts=[[]] * 3, outputs=[[]] * 3) is scores
