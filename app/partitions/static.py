"""A stage's decode step over fixed shapes, so that a GPU can replay it as one CUDA graph.

A decode step in `StagePartition.forward` has shapes that change every step (the history grows by
a column) and host work between its kernels (masks, the cache's bookkeeping, Python per layer).
On a GPU that host work is most of a small model's step: hundreds of kernel launches of a few
microseconds each. Here the step reads and writes the KV cache's whole preallocated buffers
(`SlabLayer`: [row capacity, heads, column capacity, dim]) instead of views of their live part:
the new key and value are written into column `end` by `index_copy_` with the column as a tensor,
attention runs over every column with a mask that admits each row's real tokens, and spare rows
compute on zeros and are dropped. Between two reallocations of a batch's cache the shapes and the
buffers' addresses do not change, so one captured graph serves every step in between.

Modes (`CONVEYOR_COMPILE`, `mode_for`):

    graphs    a GPU: the step is captured once per cache layout into a `torch.cuda.CUDAGraph` and
              replayed (the inputs are copied into the graph's own tensors first). On an H200,
              SmolLM2-135M: 3.2-4.0x faster steps in fp32, 4.8-5.5x in bf16, the same greedy tokens
              (`bench/static_step.py --device cuda` at commit 57abc94, docs/benchmarks.md).
    off       the eager step of `StagePartition.forward` (what tests compare against), and a CPU's
              default: there the layout's spare rows and columns cost more than the host work it
              saves (`bench/static_step.py --mode eager` at commit 57abc94), and `torch.compile` did not pay
              either (fp32, batch 4, one thread): the step compiled as one graph took over ten
              minutes to build on two cores; compiled a layer at a time (one graph for every layer,
              shapes dynamic) it ran 227 ms against 57 eager.

What it does not take: prefill (many tokens a row: eager, as before, and stopping between layers for
urgent work), stages with sliding-window layers (their cache keeps only a window: eager) and
ropes whose frequencies depend on each row's length (`app.partitions.rope`: eager). A step
it takes runs whole: urgent work waits for the end of a decode step, not a layer. A step it does not
take runs eagerly, the same numbers as before. The attention over spare columns costs work the eager
step does not do; on a GPU that is free next to launch overhead, on a CPU it is not: `auto` captures
on a GPU only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from app.partitions.batchstate import BatchState
from app.partitions.families import SLIDING
from app.partitions.kvcache import SlabLayer

# The stage whose steps are captured: a `StagePartition` (app/partitions/layers.py, which imports
# this module, so it is named here by what it is, not imported).
StagePartition = Any

log = logging.getLogger(__name__)

MODES = ("auto", "graphs", "off")
MAX_GRAPHS = 8  # captured layouts kept per stage (a batch's cache is reallocated as it grows)


def mode_for(setting: str, device: torch.device | str) -> str:
    """The mode a stage on `device` runs its decode steps in for `CONVEYOR_COMPILE`. `graphs` needs
    a GPU: asking for it on a CPU is refused, not silently served eagerly."""
    setting = setting.lower()
    if setting not in MODES:
        raise ValueError(f"unknown compile mode {setting!r}; choose one of {', '.join(MODES)}")
    is_cuda = torch.device(device).type == "cuda"
    if setting == "graphs" and not is_cuda:
        raise ValueError("compile mode 'graphs' needs a CUDA device; a CPU runs decode steps eagerly ('off')")
    if setting == "auto":
        return "graphs" if is_cuda else "off"
    return setting


class _ColumnCache:
    """What transformers' attention calls `cache.update` on, for one layer: writes the step's key
    and value into column `column` of the layer's whole buffers and hands the whole buffers back."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor) -> None:
        self.keys, self.values, self.column = keys, values, column

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values


def _layer_step(
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    column: torch.Tensor,
    extra: dict[str, Any],
) -> torch.Tensor:
    """One decoder layer over one column."""
    cache = _ColumnCache(keys, values, column)
    out = layer(hidden, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True, **extra)
    return out[0] if isinstance(out, tuple) else out


@dataclass
class _Inputs:
    """One step's inputs, laid out over the cache's whole buffers."""

    x: torch.Tensor  # [R, 1] token ids, or [R, 1, D] hidden states
    position_ids: torch.Tensor  # [R, 1]
    mask: torch.Tensor  # [R, 1, 1, C] bool (or additive float for eager attention)
    column: torch.Tensor  # [1] long: where the step's key and value go
    rows: int  # live rows (the first `rows` of R)


class _Graph:
    """One captured step: its input tensors (copied into before each replay) and its output."""

    def __init__(
        self, step: Any, inputs: _Inputs, buffers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.inputs = _Inputs(
            inputs.x.clone(),
            inputs.position_ids.clone(),
            inputs.mask.clone(),
            inputs.column.clone(),
            inputs.rows,
        )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # kernels and allocator warm, as capture needs
            step(self.inputs, buffers)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = step(self.inputs, buffers)

    def __call__(self, inputs: _Inputs) -> torch.Tensor:
        self.inputs.x.copy_(inputs.x)
        self.inputs.position_ids.copy_(inputs.position_ids)
        self.inputs.mask.copy_(inputs.mask)
        self.inputs.column.copy_(inputs.column)
        self.graph.replay()
        return self.output


class StaticDecode:
    """The decode step of one stage over its caches' whole buffers, captured as CUDA graphs."""

    def __init__(self, stage: StagePartition, mode: str) -> None:
        if mode not in ("graphs", "eager"):  # eager: the layout alone, uncaptured (CPU tests run it)
            raise ValueError(f"a static decode step runs as 'graphs' or 'eager', not {mode!r}")
        self.stage = stage
        self.mode = mode
        self.graphs: OrderedDict[tuple[int, ...], _Graph] = OrderedDict()
        self.refused: str | None = None  # why this stage's steps could not be captured: eager from then on

    def handles(self, state: BatchState, x: torch.Tensor) -> bool:
        """A one-token step of a batch that has a history, on a stage without sliding layers whose
        steps could be captured."""
        if self.refused is not None or x.shape[1] != 1 or SLIDING in self.stage.kinds:
            return False
        if self.stage.rope is not None:  # its tables are chosen per row on the host: eager steps
            return False
        rows = state.attention_mask.shape[0]
        slabs = self._slabs(state)
        return bool(slabs) and all(
            s._k is not None and s.rows == rows and s.length == state.length - 1 for s in slabs
        )

    @torch.inference_mode()
    def __call__(self, state: BatchState, x: torch.Tensor) -> torch.Tensor:
        slabs = self._slabs(state)
        for slab in slabs:
            slab.reserve(1)  # column `end` exists in every buffer
        inputs = self._inputs(state, slabs, x)
        buffers = {self.stage.range.start + i: (s._k, s._v) for i, s in enumerate(slabs)}
        assert all(k is not None and v is not None for k, v in buffers.values())
        out = self._run(inputs, buffers)  # type: ignore[arg-type]
        for slab in slabs:
            slab.advance(1)
        return out[: inputs.rows].clone()

    def _run(self, inputs: _Inputs, buffers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if self.mode != "graphs":
            return self._step(inputs, buffers)
        with torch.cuda.device(self.stage.device):  # stage k may sit on GPU k: capture and replay there
            return self._replay(inputs, buffers)

    def _replay(self, inputs: _Inputs, buffers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        key = (inputs.x.dim(), *(t.data_ptr() for pair in buffers.values() for t in pair), *inputs.mask.shape)
        graph = self.graphs.get(key)
        if graph is None:
            while len(self.graphs) >= MAX_GRAPHS:
                self.graphs.popitem(last=False)
            try:
                graph = _Graph(self._step, inputs, buffers)
            except RuntimeError as exc:  # an op that syncs with the host (data-dependent routing, ...)
                self.refused = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log.warning(
                    "stage %s: decode steps run eagerly, capture failed: %s", self.stage.range, self.refused
                )
                return self._step(inputs, buffers)  # this step, uncaptured: the same numbers
            self.graphs[key] = graph
        self.graphs.move_to_end(key)
        return graph(inputs)

    def _slabs(self, state: BatchState) -> list[SlabLayer]:
        return state.slabs[self.stage.range.start : self.stage.range.stop]

    def _inputs(self, state: BatchState, slabs: list[SlabLayer], x: torch.Tensor) -> _Inputs:
        """The step's inputs over R buffer rows and C buffer columns.

        Live row r's history sits in columns [start, end) of the buffers, right-aligned with the
        batch's mask (which the caller has extended by the new column); the new token goes to
        column `end`. A spare row sees only that column (a row that sees nothing would be NaN)."""
        first = slabs[0]
        assert first._k is not None
        capacity_rows, columns = first._k.shape[0], first._k.shape[2]
        rows, start, end = first.rows, first.start, first.end
        device = self.stage.device
        history = state.attention_mask.to(device).bool()  # [rows, end - start + 1]
        allowed = torch.zeros(capacity_rows, columns, dtype=torch.bool, device=device)
        allowed[:rows, start : end + 1] = history
        allowed[rows:, end] = True
        positions = torch.zeros(capacity_rows, 1, dtype=torch.long, device=device)
        positions[:rows, 0] = history.long().sum(-1) - 1
        mask = allowed[:, None, None, :]
        if self.stage.eager:  # eager attention adds a float mask
            dtype = self.stage.hidden_dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        x = x.to(device)
        padded = x.new_zeros((capacity_rows, *x.shape[1:]))
        padded[:rows] = x
        column = torch.tensor([end], dtype=torch.long, device=device)
        return _Inputs(padded, positions, mask, column, rows)

    def _step(self, inputs: _Inputs, buffers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The stage's layers over one column: no host synchronisation, no shape that depends on data."""
        stage = self.stage
        position_ids = inputs.position_ids
        hidden = stage._embed(inputs.x, position_ids) if stage.embed_tokens is not None else inputs.x
        rotary = stage._rotary(hidden, position_ids)
        for index, (layer, kind) in enumerate(zip(stage.layers, stage.kinds, strict=True)):
            extra = {} if rotary is None else {"position_embeddings": rotary[kind]}
            keys, values = buffers[stage.range.start + index]
            hidden = _layer_step(layer, hidden, inputs.mask, position_ids, keys, values, inputs.column, extra)
        return stage.finish(hidden)
