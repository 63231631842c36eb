"""Token sampling: greedy, temperature, top-k, top-p, reproducible per sequence with a seed.

Pure functions of logits, parameters and per-sequence generators; unit-tested without services.
`sample` never raises for a row's values: out-of-range parameters are brought inside the bounds of
app/core/sampling.py, and a row whose probabilities are not a distribution (non-finite logits)
takes its greedy token. The stage refuses a job with such values before it gets here
(`SamplingParams.problem`); the clamps are what holds if one slips through.
"""

from __future__ import annotations

import torch

from app.core.sampling import SamplingParams

__all__ = ["SamplingParams", "ban_tokens", "filter_logits", "make_generator", "sample", "token_seed"]


def make_generator(params: SamplingParams) -> torch.Generator:
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(token_seed(params.seed, 0))
    return generator


MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """The generator seed of token `index` of a seeded job: SplitMix64 of (seed, index).

    Each token's draw depends on the job's seed and the token's position only, never on how many
    draws the generator made before. So a job recovered on another worker after n tokens, whose
    generator starts afresh, draws token n exactly as the uninterrupted run would have.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)  # torch seeds are taken as signed 64-bit


def filter_logits(logits: torch.Tensor, *, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask out tokens outside each row's top-k and nucleus (top-p) set.

    logits: [B, V]; top_k: [B] (0 = off); top_p: [B] in (0, 1]. Returns logits with -inf holes.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = rank >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p; the first always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    """Next token per row. logits: [B, V] -> token ids [B]. Raises for no row's values."""
    params = [p.bounded(logits.shape[-1]) for p in params]
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    index = torch.tensor(rows)
    temperature = torch.tensor([params[i].temperature for i in rows], dtype=logits.dtype)
    scaled = logits[index].float() / temperature[:, None]  # [R, V]
    filtered = filter_logits(
        scaled,
        top_k=torch.tensor([params[i].top_k for i in rows]),
        top_p=torch.tensor([params[i].top_p for i in rows], dtype=torch.float32),
    )
    probs = filtered.softmax(dim=-1)  # [R, V]
    # NaN or infinite logits make no distribution (multinomial would raise): such a row stays greedy.
    usable = (probs.isfinite().all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
    for j, row in enumerate(rows):
        if usable[j]:
            tokens[row] = torch.multinomial(probs[j], 1, generator=generators[row])[0]
    return tokens


def ban_tokens(logits: torch.Tensor, banned: list[frozenset[int]]) -> torch.Tensor:
    """Logits with each row's banned token ids at -inf, so no rule of `sample` can pick them (the last
    stage bans end-of-sequence ids until a job has its `min_tokens`). logits: [B, V]; one set per row.
    Ids outside the vocabulary are skipped."""
    vocab = logits.shape[-1]
    cells = [(row, t) for row, ids in enumerate(banned) for t in ids if 0 <= t < vocab]
    if not cells:
        return logits
    rows, cols = zip(*cells, strict=True)
    out = logits.clone()
    out[list(rows), list(cols)] = float("-inf")
    return out
