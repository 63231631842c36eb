"""Token sampling: the controls that change the logits (`constrain`: allowed ids, bad words, logit
bias, penalties), then greedy or temperature, min-p, top-k, top-p, reproducible per sequence with a
seed. The order is vLLM's.

Pure functions of logits, parameters and per-sequence generators; unit-tested without services.
`sample` never raises for a row's values: out-of-range parameters are brought inside the bounds of
app/core/sampling.py, and a row whose probabilities are not a distribution (non-finite logits)
takes its greedy token. The stage refuses a job with such values before it gets here
(`SamplingParams.problem`); the clamps are what holds if one slips through.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from app.core.sampling import SamplingParams

__all__ = [
    "SamplingParams",
    "ban_tokens",
    "constrain",
    "draw",
    "filter_logits",
    "make_generator",
    "sample",
    "token_logprobs",
    "token_seed",
]


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


def filter_logits(
    logits: torch.Tensor, *, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None
) -> torch.Tensor:
    """Mask out tokens below each row's min-p floor, and outside its top-k and nucleus (top-p) set.

    logits: [B, V]; top_k: [B] (0 = off); top_p: [B] in (0, 1]; min_p: [B] in [0, 1] (0 = off).
    Returns logits with -inf holes. min_p keeps a token at least min_p times as likely as the most
    likely one (the same set before or after the other cuts, which never drop the top token).

    Only a nucleus needs the rows sorted (a sort of the vocabulary is most of a sampled step's
    cost: 56 ms for 16 rows of 49,152 on one core); without one, top-k is a threshold at each row's
    k-th largest logit (ties with it kept, as vLLM's) and min-p one at its share of the largest.
    """
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    if not bool((top_p < 1).any()):
        kept = logits
        if min_p is not None and bool((min_p > 0).any()):
            probs = logits.softmax(dim=-1)
            kept = kept.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
        if bool((k < vocab).any()):
            largest = logits.topk(int(k.max()), dim=-1).values  # [B, max k], descending
            kept = kept.masked_fill(logits < largest.gather(-1, (k - 1)[:, None]), float("-inf"))
        return kept
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    drop = rank >= k[:, None]
    if min_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        drop |= probs < min_p[:, None] * probs[:, :1]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p; the first always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    """Next token per row. logits: [B, V] -> token ids [B]. Raises for no row's values.

    Each pass over [B, V] counts (64 rows of 49,152 on one core: a pass is 0.2-3 ms): the greedy
    rows' argmax is taken over those rows only, the rows that sample are copied out only when some
    do not, and the scaled logits are the temperature's one product."""
    params = [p.bounded(logits.shape[-1]) for p in params]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return logits.argmax(dim=-1)
    tokens = torch.zeros(len(params), dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    every = len(rows) == len(params)
    temperature = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32)
    scaled = (logits if every else logits[rows]) / temperature[:, None]  # [R, V], fp32
    min_p = [params[i].min_p for i in rows]
    filtered = filter_logits(
        scaled,
        top_k=torch.tensor([params[i].top_k for i in rows]),
        top_p=torch.tensor([params[i].top_p for i in rows], dtype=torch.float32),
        min_p=torch.tensor(min_p, dtype=torch.float32) if any(min_p) else None,
    )
    probs = filtered.softmax(dim=-1)  # [R, V]
    # NaN or infinite logits make no distribution: such a row stays greedy.
    total = probs.sum(dim=-1)  # NaN or infinite where any of the row is
    usable = (total.isfinite() & (total > 0)).tolist()
    unusable = [row for j, row in enumerate(rows) if not usable[j]]
    if unusable:
        tokens[unusable] = logits[unusable].argmax(dim=-1)
    unseeded = [j for j, row in enumerate(rows) if usable[j] and params[row].seed is None]
    if unseeded:
        picked = probs if len(unseeded) == len(rows) else probs[unseeded]
        tokens[[rows[j] for j in unseeded]] = draw(picked, [generators[rows[j]] for j in unseeded])
    for j, row in enumerate(rows):  # a seeded row: transformers' draw from its generator, seed for seed
        if usable[j] and params[row].seed is not None:
            tokens[row] = torch.multinomial(probs[j], 1, generator=generators[row])[0]
    return tokens


DRAW_BLOCK = 1024  # tokens of the vocabulary a draw's second level walks


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [R, V] (each a distribution), by inverting the row's cumulative
    distribution at a uniform from the row's generator: a token of probability zero is never drawn.
    For rows without a seed: torch.multinomial's draw, which a seeded row keeps (the draws
    transformers makes), takes a random number per token of the vocabulary, 1 ms a row for 49,152;
    this takes one.

    In two levels, in float64 where it sums: the row's blocks of `DRAW_BLOCK` tokens (their sums),
    then the tokens of the block the uniform falls in. A cumulative sum in float64 of the whole
    vocabulary was most of a sampled step's cost (13 ms of 64 rows of 49,152 on one core)."""
    rows, vocab = probs.shape
    blocks = -(-vocab // DRAW_BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * DRAW_BLOCK - vocab)) if vocab % DRAW_BLOCK else probs
    tiles = padded.contiguous().view(rows, blocks, DRAW_BLOCK)
    ends = tiles.sum(dim=-1).double().cumsum(dim=-1)  # [R, blocks]: the mass up to each block's end
    uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    target = (uniform * ends[:, -1]).unsqueeze(-1)  # [R, 1], below each row's total
    block = torch.searchsorted(ends, target, right=True).clamp_(max=blocks - 1)  # [R, 1]
    before = torch.where(block > 0, ends.gather(-1, (block - 1).clamp(min=0)), torch.zeros_like(target))
    tile = tiles[torch.arange(rows), block.squeeze(-1)]  # [R, DRAW_BLOCK]: the block it falls in
    within = torch.searchsorted(tile.double().cumsum(dim=-1), target - before, right=True).squeeze(-1)
    # The block's own sum and its tokens' running sum may round apart: past its end, the block's last
    # token of nonzero probability (one exists, or the uniform would not have fallen in it).
    last = DRAW_BLOCK - 1 - (tile.flip(-1) > 0).int().argmax(dim=-1)
    token = block.squeeze(-1) * DRAW_BLOCK + torch.minimum(within, last)
    return token.clamp_(max=vocab - 1)


def constrain(
    logits: torch.Tensor,
    params: list[SamplingParams],
    *,
    prompts: list[Sequence[int]],
    outputs: list[Sequence[int]],
) -> torch.Tensor:
    """The logits each row's controls leave, in vLLM's order: outside `allowed_token_ids` and the
    last token of a `bad_words` sequence the output would complete at -inf, `logit_bias` added,
    then `repetition_penalty` over the tokens of the prompt and output, `frequency_penalty` and
    `presence_penalty` over the output's. Rows without a control are left as they are.

    logits: [B, V] float32; prompts / outputs: each row's token ids (a prompt is read only for
    repetition_penalty). Ids outside the vocabulary are skipped.
    """
    if not any(p.constrained for p in params):
        return logits
    vocab = logits.shape[-1]
    out = logits.clone()
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed:
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool)
        rows, cols = _cells([(j, params[i].allowed_token_ids or ()) for j, i in enumerate(allowed)], vocab)
        keep[rows, cols] = True
        out[allowed] = out[allowed].masked_fill(~keep, float("-inf"))
    banned = [(i, _completing(params[i].bad_words, outputs[i])) for i, p in enumerate(params) if p.bad_words]
    rows, cols = _cells(banned, vocab)
    out[rows, cols] = float("-inf")
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if 0 <= t < vocab]
    if biased:
        at = torch.tensor([(i, t) for i, t, _ in biased], dtype=torch.long)  # [N, 2]
        bias = torch.tensor([b for _, _, b in biased], dtype=out.dtype)
        out.index_put_((at[:, 0], at[:, 1]), bias, accumulate=True)
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        out[penalized] = _penalized(
            out[penalized], [params[i] for i in penalized], prompts, outputs, penalized
        )
    return out


def _penalized(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[Sequence[int]],
    outputs: list[Sequence[int]],
    rows: list[int],
) -> torch.Tensor:
    """logits: [R, V] of the penalized rows -> the same with their penalties applied."""
    vocab = logits.shape[-1]
    counts = torch.zeros_like(logits)  # [R, V]: occurrences in the output
    r, c = _cells([(j, outputs[i]) for j, i in enumerate(rows)], vocab)
    counts.index_put_((r, c), torch.ones(len(c)), accumulate=True)
    seen = counts > 0
    repeating = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
    r, c = _cells([(j, prompts[rows[j]]) for j in repeating], vocab)
    in_prompt = torch.zeros_like(seen)
    in_prompt[r, c] = True
    penalty = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)[:, None]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen | in_prompt, penalized, logits)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)[:, None]
    return logits - frequency * counts - presence * seen.to(logits.dtype)


def _completing(words: tuple[tuple[int, ...], ...], output: Sequence[int]) -> list[int]:
    """The last token of each banned sequence whose other tokens end the output (vLLM's rule: a
    one-token word is always banned; the output alone is matched, not the prompt)."""
    last = []
    for word in words:
        head = len(word) - 1
        if head <= len(output) and (head == 0 or list(output[len(output) - head :]) == list(word[:-1])):
            last.append(word[-1])
    return last


def _cells(rows: Iterable[tuple[int, Iterable[int]]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column index) tensors of each row's token ids inside the vocabulary."""
    listed = [(row, torch.tensor(list(ids), dtype=torch.long)) for row, ids in rows]
    if not listed:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    cols = torch.cat([ids for _, ids in listed])  # [N]
    counts = torch.tensor([len(ids) for _, ids in listed])
    index = torch.repeat_interleave(torch.tensor([row for row, _ in listed], dtype=torch.long), counts)
    inside = (cols >= 0) & (cols < vocab)
    return index[inside], cols[inside]


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


Logprobs = tuple[float, tuple[tuple[int, float], ...]]  # the token's, and the top (id, logprob) pairs


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int | None]) -> list[Logprobs | None]:
    """Per row asking (`top[i]` not None): the log-softmax of the logits at its token, and its
    `top[i]` likeliest tokens with theirs. logits: [B, V], as the model gave them (vLLM's raw
    logprobs: before any control, penalty or temperature)."""
    rows = [i for i, k in enumerate(top) if k is not None]
    out: list[Logprobs | None] = [None] * len(tokens)
    if not rows:
        return out
    logprobs = logits[rows].float().log_softmax(dim=-1)  # [R, V]
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows])).squeeze(1).tolist()
    k = max(top[i] or 0 for i in rows)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    for j, i in enumerate(rows):
        n = top[i] or 0
        pairs = tuple(zip(ids[j, :n].tolist(), values[j, :n].tolist(), strict=True))
        out[i] = (chosen[j], pairs)
    return out
