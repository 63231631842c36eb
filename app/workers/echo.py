"""Echo's prompt logprobs, on the last stage: each prompt token's log probability given the tokens
before it, and its likeliest alternatives, from a prefill's final hidden states through the model's
norm and head (the model's own log-softmax, as `token_logprobs` gives a generated token's).

The stage asks for them (`asked`) before its prefill: that prefill then computes every prompt whole
on this stage (`Prefill.start(whole=True)`: a prefix cache hit computes no hidden states for the tokens it
reuses) and keeps its hidden states (`BatchState.keep_hidden`); `take` reads them once, and
`attach` hands each job's to its first token (a `prompt` event before it,
`JobStore.step`). A recovered job that had streamed tokens already had its `prompt` event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from app.core.jobstore import TokenOut
from app.partitions.layers import BatchState, StagePartition
from app.partitions.prefix import Prefill
from app.workers.decode import Sequence

CHUNK = 256  # prompt positions through the head at once: [CHUNK, vocab] float32 logits

Entries = list[list[Any]]  # per prompt token after the first: [logprob, [[id, logprob], ...]]


def asked(sequences: Mapping[str, Sequence]) -> bool:
    """Whether a job of this prefill asks for its prompt's logprobs (and has not streamed yet)."""
    return any(s.params.prompt_logprobs is not None and not s.generated for s in sequences.values())


def take(
    partition: StagePartition, state: BatchState, prefill: Prefill | None, sequences: Mapping[str, Sequence]
) -> dict[str, Entries]:
    """The prompt logprobs of each asking job of this prefill, by job id; its hidden states let go."""
    hidden, state.hidden, state.keep_hidden = state.hidden, None, False
    if hidden is None or prefill is None or not prefill.prompts:
        return {}
    total = hidden.shape[1]  # [B, T, D]: whole prompts, left-padded
    out = {}
    for row, (job_id, ids) in enumerate(zip(prefill.seq_ids, prefill.prompts, strict=True)):
        seq = sequences.get(job_id)
        if seq is None or seq.params.prompt_logprobs is None or seq.generated:
            continue
        # Column t of the prompt predicts token t + 1: its first L - 1 columns, the tokens after the first.
        columns = hidden[row, total - len(ids) : total - 1]  # [L - 1, D]
        out[job_id] = prompt_logprobs(partition, columns, ids, seq.params.prompt_logprobs)
    return out


@torch.inference_mode()
def prompt_logprobs(partition: StagePartition, hidden: torch.Tensor, ids: list[int], top: int) -> Entries:
    """hidden: [L - 1, D], the final hidden states of a prompt's tokens but its last; ids: its L
    tokens. Per token after the first, its log probability and the `top` likeliest tokens'."""
    assert partition.norm is not None and partition.lm_head is not None
    entries: Entries = []
    for start in range(0, hidden.shape[0], CHUNK):
        part = hidden[start : start + CHUNK]  # [C, D]
        logits = partition.family.logits(partition.config, partition.lm_head(partition.norm(part)))
        logprobs = logits.float().log_softmax(dim=-1)  # [C, V]
        after = torch.tensor(ids[start + 1 : start + 1 + part.shape[0]], device=logprobs.device)
        chosen = logprobs.gather(1, after[:, None]).squeeze(1).tolist()
        values, best = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
        for j, logprob in enumerate(chosen):
            entries.append(
                [logprob, [list(p) for p in zip(best[j].tolist(), values[j].tolist(), strict=True)]]
            )
    return entries


def attach(outs: list[TokenOut], echoes: Mapping[str, Entries]) -> list[TokenOut]:
    """Each job's first token out with its prompt's logprobs."""
    if not echoes:
        return outs
    return [replace(o, prompt_logprobs=echoes[o.job_id]) if o.job_id in echoes else o for o in outs]
