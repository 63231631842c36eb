"""Model families a stage can run: what each does before its first layer, between layers, and after
its last, so that a range of layers runs exactly as the whole model does.

Stages are layer ranges; the decoder layers themselves are transformers' own modules (they apply
their own attention soft-capping, residual and attention multipliers, partial rotary, QK norms).
What a family adds is what the model's outer `forward` does around the layers, read from
transformers' modeling file of each family:

- before the first layer: the token embedding and its scale (Gemma's `embed_scale` lives in a
  non-persistent buffer; Granite multiplies by `embedding_multiplier`; GPT-2 adds learned positions);
- between layers: which attention each layer uses (full, or sliding with its window, from
  `config.layer_types` or the config's `sliding_window`) and which rotary table it reads (Gemma 3
  has a local and a global rope base);
- after the last layer: the final norm, the LM head, then the logit scale (Cohere), the logit
  divisor (Granite) or the final soft-capping (Gemma 2 and 3).

Anything not in `FAMILIES` is refused before a weight is read, with the supported list: a family
we have not checked could run and emit tokens that differ from the model's own, without an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.core.errors import UnsupportedModel
from app.partitions import rope

FULL = "full_attention"
SLIDING = "sliding_attention"


def _identity(config: Any, logits: torch.Tensor) -> torch.Tensor:
    return logits


def _cohere_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    return logits * config.logit_scale


def _granite_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    return logits / config.logits_scaling


def _softcapped_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


@dataclass(frozen=True)
class Family:
    """One architecture family: where its modules live and what its outer forward adds."""

    name: str
    model_types: tuple[str, ...]
    body: str = "model"  # attribute of the causal LM that holds the base model
    embed: str = "embed_tokens"
    layers: str = "layers"
    norm: str = "norm"
    learned_positions: str | None = None  # GPT-2: `wpe`, added to the token embedding
    rotary: bool = True
    embedding_multiplier: str | None = None  # config attribute the embedding is multiplied by
    logits: Callable[[Any, torch.Tensor], torch.Tensor] = _identity
    # Legacy checkpoint names of fused parameters (per-expert MoE weights): see loading.py.
    experts: tuple[str, str, str] | None = None  # (gate, up, down) name patterns with {e}
    renames: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (ours, the checkpoint's)
    # Phi-3's `generate` computes a sequence again whole when it grows past a longrope's
    # `original_max_position_embeddings` (its `prepare_inputs_for_generation` drops the cache);
    # the other families' go on from their cache, only the new tokens with the long factors.
    longrope_again: bool = False


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",)),
    Family("mistral", ("mistral",)),
    Family("qwen2", ("qwen2",)),
    Family("qwen3", ("qwen3",)),
    Family("phi3", ("phi3",), longrope_again=True),
    Family("gemma", ("gemma",)),
    Family("gemma2", ("gemma2",), logits=_softcapped_logits),
    Family("gemma3", ("gemma3_text",), logits=_softcapped_logits),
    Family("granite", ("granite",), embedding_multiplier="embedding_multiplier", logits=_granite_logits),
    Family("cohere", ("cohere",), logits=_cohere_logits),
    Family("stablelm", ("stablelm",)),
    Family("olmo2", ("olmo2",)),
    Family("smollm3", ("smollm3",)),
    Family(
        "mixtral",
        ("mixtral",),
        experts=(
            "block_sparse_moe.experts.{e}.w1.weight",
            "block_sparse_moe.experts.{e}.w3.weight",
            "block_sparse_moe.experts.{e}.w2.weight",
        ),
        renames=(("mlp.gate.weight", "block_sparse_moe.gate.weight"),),
    ),
    Family(
        "qwen3_moe",
        ("qwen3_moe",),
        experts=(
            "mlp.experts.{e}.gate_proj.weight",
            "mlp.experts.{e}.up_proj.weight",
            "mlp.experts.{e}.down_proj.weight",
        ),
    ),
    Family(
        "gpt2",
        ("gpt2",),
        body="transformer",
        embed="wte",
        layers="h",
        norm="ln_f",
        learned_positions="wpe",
        rotary=False,
    ),
)

_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def family_for(config: Any) -> Family:
    """The family of a model config, or `UnsupportedModel` naming the architecture and the list.

    Who calls: `conveyor model add`, `conveyor plan` and every stage worker, before any weight is
    read. It looks at the config only.
    """
    model_type = getattr(config, "model_type", None)
    architectures = getattr(config, "architectures", None) or []
    named = f"{model_type!r}" + (f" ({', '.join(architectures)})" if architectures else "")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(
            f"model type {named} is an encoder-decoder model; Conveyor serves decoder-only causal "
            f"language models: {', '.join(supported_model_types())}",
            model_type=model_type,
            supported=supported_model_types(),
        )
    family = _BY_MODEL_TYPE.get(str(model_type))
    if family is None:
        raise UnsupportedModel(
            f"model type {named} is not supported; supported model types: "
            f"{', '.join(supported_model_types())}",
            model_type=model_type,
            supported=supported_model_types(),
        )
    attention_kinds(config)  # refuses attention kinds the stages cannot run (e.g. chunked)
    _check_causal_lm(config, named)
    rope.length_rule(config)  # refuses a length-dependent rope it cannot follow
    return family


# Heads of checkpoints that are not language models: a score or a label per token, not the next
# token. Their backbones load as a causal LM, and would generate through a head they never had.
NOT_GENERATIVE = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "RewardModel",
)


def _check_causal_lm(config: Any, named: str) -> None:
    """Refuse configs of a supported family that are not causal language models: bidirectional
    attention (EmbeddingGemma: an encoder, its tokens see the ones after them), or a checkpoint saved
    with a classification or reward head. A checkpoint without an LM head of its own is refused
    from its weights' headers (`modelstore.check_head`)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModel(
            f"model type {named} uses bidirectional attention (an embedding model such as "
            "EmbeddingGemma): it is not a causal language model, and the stages attend causally",
            model_type=getattr(config, "model_type", None),
        )
    heads = [a for a in getattr(config, "architectures", None) or [] if a.endswith(NOT_GENERATIVE)]
    if heads:
        raise UnsupportedModel(
            f"model type {named} was saved with a {', '.join(heads)} head: it scores or labels text, "
            "it does not generate it; Conveyor serves causal language models",
            model_type=getattr(config, "model_type", None),
        )


def attention_kinds(config: Any) -> list[str]:
    """Each layer's attention: `full_attention` or `sliding_attention` (window `config.sliding_window`).

    Families with alternating layers list them in `config.layer_types` (Gemma 2/3, Qwen2/3 with a
    window); the others use one window for every layer when `sliding_window` is set (Mistral v0.1,
    Phi-3, Mixtral), as their modeling files choose the sliding mask for the whole model.
    """
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        kinds = [SLIDING if window else FULL] * layers
    else:
        kinds = list(types)[:layers]
    unknown = sorted(set(kinds) - {FULL, SLIDING})
    if unknown:
        raise UnsupportedModel(
            f"attention kinds {unknown} are not supported (only full and sliding-window attention)",
            model_type=getattr(config, "model_type", None),
        )
    if SLIDING in kinds and not window:
        raise UnsupportedModel("sliding-window layers without a `sliding_window` size in the config")
    return kinds
