"""Model directories of supported families that the stages cannot serve, each refused for its own reason."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from tiny import make_tiny_model, make_tokenizer

LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4d7a214614ab2935c943f9e0ff69ab9e1ad4c1c4d7e6a2a4f4e1d6c9a2f7b3e1\n"
    "size 538090408\n"
)


def lfs_pointer(path: Path) -> Path:
    """A clone made without `git lfs pull`: model.safetensors is the pointer's text."""
    make_tiny_model(path)
    (path / "model.safetensors").write_text(LFS_POINTER)
    return path


def headless(path: Path, *, architecture: str = "LlamaModel") -> Path:
    """An untied checkpoint without `lm_head.weight` (a reward model's backbone, its own head elsewhere)."""
    tokenizer = make_tokenizer()
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    tensors["score.weight"] = torch.zeros(1, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config.architectures = [architecture]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def bidirectional(path: Path) -> Path:
    """EmbeddingGemma's shape: a Gemma 3 text model whose attention is bidirectional."""
    tokenizer = make_tokenizer()
    config = tf.Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        use_bidirectional_attention=True,
    )
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def falcon(path: Path, good: Path) -> Path:
    """An architecture the stages do not run, with a tokenizer and weights (a good model's files)."""
    shutil.copytree(good, path)
    config = tf.FalconConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    config.save_pretrained(path)
    return path
