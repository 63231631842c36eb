"""Rotary tables whose frequencies depend on the sequence's length, computed for each row on its own.

Two rope types change their frequencies with the length of the sequence (transformers'
`dynamic_rope_update`):

- `dynamic` (dynamic NTK): a sequence longer than `max_position_embeddings` gets a larger rope base,
  recomputed from its length at every step; up to that length the config's own frequencies hold.
- `longrope` (Phi-3.5, Phi-4-mini): the short factors up to `original_max_position_embeddings`, the
  long ones beyond it. Where a sequence grows past that length, Phi-3's `generate` drops its cache
  and computes the whole sequence again with the long factors.

transformers keeps that state in the rotary module (it rewrites `inv_freq` at every forward from
the longest row of the call), which on a stage is shared by every batch it runs: one batch's
length would change another's frequencies. Here a row's frequencies are chosen from that row's own
length, as `generate` of that prompt alone chooses them, and the module is never written to.

A Phi-3 longrope sequence that grows past `original_max_position_embeddings` while it decodes is
computed again whole with the long factors at that step, as Phi-3's `generate` does: a stage finds
those rows itself (`crossing`), and `StagePartition.steps` recomputes them. Other families' `generate`
keeps the cached keys there (`Family.longrope_again`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from app.core.errors import UnsupportedModel

DYNAMIC = "dynamic"
LONGROPE = "longrope"


@dataclass(frozen=True)
class LengthRule:
    """How a model's rotary frequencies depend on a sequence's length."""

    kind: str  # DYNAMIC or LONGROPE
    limit: int  # sequences up to this length use the config's own frequencies (longrope: the short ones)


def parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return params if isinstance(params, dict) else {}


def length_rule(config: Any) -> LengthRule | None:
    """The length rule of a config's rope, None where its frequencies do not depend on the length.

    Who calls: `family_for` (so a rule it cannot follow refuses the model before a weight is read)
    and `StagePartition`. Per-layer-type rope parameters (Gemma 3's local and global bases) with a
    length-dependent type are refused."""
    params = parameters(config)
    if params and all(isinstance(value, dict) for value in params.values()):
        kinds = sorted({_type(value) for value in params.values()})
        if any(_depends_on_length(kind) for kind in kinds):
            raise UnsupportedModel(
                f"rope types {kinds} per layer type: a rope that depends on the sequence length is "
                "supported for one rope shared by every layer only",
                model_type=getattr(config, "model_type", None),
            )
        return None
    kind = _type(params)
    if kind == LONGROPE:
        limit = params.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        return LengthRule(LONGROPE, int(limit or config.max_position_embeddings))
    if _depends_on_length(kind):
        return LengthRule(DYNAMIC, int(config.max_position_embeddings))
    return None


def _type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def _depends_on_length(kind: str) -> bool:
    return DYNAMIC in kind or kind == LONGROPE  # transformers' own test in `dynamic_rope_update`


class RowTables:
    """cos and sin [B, S, dim] of one step, each row's from its own length.

    `module` is the stage's rotary module (transformers' own class, whose forward is wrapped by
    `dynamic_rope_update`); its unwrapped forward is run with the chosen frequencies, so the
    tables are computed exactly as transformers computes them for a sequence of that length."""

    def __init__(self, module: Any, config: Any, rule: LengthRule) -> None:
        self.module, self.config, self.rule = module, config, rule
        self._forward = type(module).forward.__wrapped__  # without the length update (and its writes)
        self._by_length: dict[int, torch.Tensor] = {}  # dynamic: frequencies of a length, kept

    @staticmethod
    def applies(module: Any) -> bool:
        """Whether the module's forward is the one transformers updates by length (else it never
        depends on the length, and runs as it is)."""
        return hasattr(type(module).forward, "__wrapped__")

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # A row's length is its last position + 1: `generate`'s seq_len for that prompt alone.
        lengths = (position_ids.amax(dim=-1) + 1).tolist()  # [B]
        limit = self.rule.limit
        dynamic = self.rule.kind == DYNAMIC
        # A row's frequencies by key: 0 the config's own; dynamic: its length's; longrope: the long.
        keys = [0 if n <= limit else n if dynamic else limit + 1 for n in lengths]
        if not any(keys):
            return self._table(self.module.original_inv_freq, hidden, position_ids)
        cos = sin = None
        for key in sorted(set(keys)):
            rows = torch.tensor([r for r, k in enumerate(keys) if k == key], device=hidden.device)
            inv_freq = self._frequencies(key, position_ids) if key else self.module.original_inv_freq
            c, s = self._table(inv_freq, hidden[rows], position_ids[rows])
            if cos is None or sin is None:
                cos = c.new_empty((len(keys), *c.shape[1:]))
                sin = s.new_empty((len(keys), *s.shape[1:]))
            cos[rows], sin[rows] = c, s
        assert cos is not None and sin is not None
        return cos, sin

    def _frequencies(self, length: int, position_ids: torch.Tensor) -> torch.Tensor:
        """The frequencies of a sequence of `length` tokens past the limit, as transformers computes
        them: dynamic NTK's from the length (a tensor, as its forward passes it), longrope's long
        factors (for any length past the limit)."""
        if self.rule.kind == LONGROPE:
            length = self.rule.limit + 1  # transformers' `original_max_position_embeddings + 1`
        if length not in self._by_length:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            seq_len: int | torch.Tensor = length
            if self.rule.kind == DYNAMIC:
                seq_len = torch.tensor(length, dtype=position_ids.dtype, device=position_ids.device)
            init = ROPE_INIT_FUNCTIONS[self.module.rope_type]
            self._by_length[length] = init(self.config, position_ids.device, seq_len=seq_len)[0]
            while len(self._by_length) > 256:  # lengths only grow: the oldest are not asked again
                self._by_length.pop(next(iter(self._by_length)))
        return self._by_length[length]

    def _table(
        self, inv_freq: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._forward(_WithFrequencies(self.module, inv_freq), hidden, position_ids)  # type: ignore[no-any-return]


def crossing(rule: LengthRule | None, lengths: torch.Tensor) -> list[int]:
    """The rows of a decode step whose longrope sequence has just grown past the limit (`lengths`
    [B]: each row's tokens with this step's): those `generate` computes again whole, with the long
    factors. Later steps of such a row only add their own token, with the long factors."""
    if rule is None or rule.kind != LONGROPE:
        return []
    return [int(r) for r in (lengths == rule.limit + 1).nonzero().flatten().tolist()]


class _WithFrequencies:
    """The rotary module as its forward reads `self`, with other frequencies."""

    def __init__(self, module: Any, inv_freq: torch.Tensor) -> None:
        self._module = module
        self.inv_freq = inv_freq

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)
