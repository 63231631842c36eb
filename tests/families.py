"""Tiny random-weight configs of every supported model family (the model boundary of the tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers as tf
from transformers import AutoModelForCausalLM

VOCAB = 96
WINDOW = 6  # shorter than every prompt plus its tokens: sliding layers really slide
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
ALTERNATING = ["sliding_attention", "sliding_attention", "full_attention"] * 2
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _configs() -> dict[str, Any]:
    c = COMMON
    return {
        "llama": tf.LlamaConfig(**c),
        "llama-tied": tf.LlamaConfig(**c, tie_word_embeddings=True),
        "llama3-rope": tf.LlamaConfig(**c, rope_parameters=LLAMA3_ROPE),
        "mistral": tf.MistralConfig(**c, sliding_window=None),
        "mistral-window": tf.MistralConfig(**c, sliding_window=WINDOW),
        "qwen2": tf.Qwen2Config(**c),
        "qwen2-window": tf.Qwen2Config(
            **c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
        ),
        "qwen3": tf.Qwen3Config(**c, head_dim=16),
        "phi3-window": tf.Phi3Config(**c, sliding_window=WINDOW, original_max_position_embeddings=256),
        "gemma": tf.GemmaConfig(**c, head_dim=16),
        "gemma2": tf.Gemma2Config(**c, head_dim=16, sliding_window=WINDOW, final_logit_softcapping=3.0),
        "gemma3": tf.Gemma3TextConfig(**c, head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING),
        "granite": tf.GraniteConfig(
            **c,
            embedding_multiplier=6.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=0.25,
        ),
        "cohere": tf.CohereConfig(**c, logit_scale=4.0),
        "stablelm": tf.StableLmConfig(**c),
        "olmo2": tf.Olmo2Config(**c),
        "smollm3": tf.SmolLM3Config(**c),
        "mixtral": tf.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": tf.Qwen3MoeConfig(
            **c, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        ),
        "gpt2": tf.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=6, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2
        ),
    }


CONFIGS = _configs()


def save_families(root: Path) -> dict[str, tuple[Path, Any]]:
    """Each family's tiny model saved to safetensors under `root`, and the whole model it came from."""
    out = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        config.initializer_range = 0.1  # decisive logits: tiny models at 0.02 are nearly uniform
        model = AutoModelForCausalLM.from_config(config).eval()
        model.generation_config.eos_token_id = None  # every row runs all its steps
        path = root / name
        model.save_pretrained(path)
        out[name] = (path, model)
    return out
