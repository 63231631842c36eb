"""A decoder language model cut on layer boundaries: one stage runs layers [start, stop).

What a family's outer forward adds around its layers (embedding scale, learned positions, per-layer
attention kinds and rotary tables, logit scaling and soft-capping) comes from `families.py`.

The first stage owns the token embedding, the last one the final norm and the LM head; a model
that fits one device is the one-stage case of the same code. Per batch, a stage keeps its own
KV cache and attention mask (`BatchState`, `app.partitions.batchstate`); positions are derived from
the mask, never counted.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from app.core import modelstore
from app.core.errors import UnsupportedModel
from app.core.steps import Steps, complete
from app.partitions import attention, fusion, packing, rope, static
from app.partitions.batchstate import BatchState as BatchState
from app.partitions.batchstate import left_pad as left_pad
from app.partitions.families import SLIDING, attention_kinds, family_for
from app.partitions.kvcache import SlabLayer
from app.partitions.loading import Checkpoint, build_on_meta, check_materialized, fill, rebuild_buffers


@dataclass(frozen=True)
class LayerRange:
    start: int
    stop: int  # exclusive

    @classmethod
    def even_split(cls, num_layers: int, stages: int, stage: int) -> LayerRange:
        if not 0 <= stage < stages <= num_layers:
            raise ValueError(f"cannot cut {num_layers} layers into {stages} stages (stage {stage})")
        bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
        return cls(bounds[stage], bounds[stage + 1])


class StagePartition(nn.Module):
    """Layers [start, stop) of a causal LM of a supported family, plus embedding / head at the ends.

    Built from a whole model in memory (tests) or, through `load`, from a checkpoint with only
    this stage's tensors read. One code path for one stage or many.
    """

    embed_tokens: nn.Module | None
    positions: nn.Module | None
    norm: nn.Module | None
    lm_head: nn.Module | None

    def __init__(self, model: Any, layers: LayerRange) -> None:
        super().__init__()
        self.config: PretrainedConfig = model.config
        self.family = family_for(self.config)
        self.range = layers
        self.is_first = layers.start == 0
        self.is_last = layers.stop == self.config.num_hidden_layers
        kinds = attention_kinds(self.config)
        self.kinds = kinds[layers.start : layers.stop]  # this stage's layers' attention kinds
        self.window = getattr(self.config, "sliding_window", None)
        self.eager = self.config._attn_implementation == "eager"  # additive float masks, else boolean
        attention.use_for(self.config)  # half-precision decode steps on a CPU: a query block per KV head
        family = self.family
        body = getattr(model, family.body)
        self.embed_tokens = getattr(body, family.embed) if self.is_first else None
        self.positions = (
            getattr(body, family.learned_positions) if self.is_first and family.learned_positions else None
        )
        self.layers = nn.ModuleList(getattr(body, family.layers)[layers.start : layers.stop])
        self.rotary_emb: Any = body.rotary_emb if family.rotary else None
        self._rotary_by_kind = self.rotary_emb is not None and (
            "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        )
        self.rope: rope.RowTables | None = None
        self._bind_rope()
        self.norm = getattr(body, family.norm) if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.static: static.StaticDecode | None = None  # decode steps captured as CUDA graphs: `use_static`
        attention.prefer_plan_free_kernels(next(model.parameters()).device)  # built on a GPU (tests)
        self.wide_decode = True  # decode steps may attend over whole cache buffers (`_wide_slabs`)

    @classmethod
    def load(
        cls,
        path: Path,
        layers: LayerRange | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        pack: bool = True,
        fuse: bool | None = None,
    ) -> StagePartition:
        """Build this stage alone: its modules on `device` in `dtype`, its tensors read from disk.

        `pack`: bf16 linear layers on a CPU multiply by weights packed once for oneDNN (same
        numbers, faster; `app.partitions.packing`), where the CPU supports it. `fuse`: q/k/v and
        gate/up projections run as one product each (`app.partitions.fusion`); None: where it pays."""
        meta = build_on_meta(path, dtype)
        config = meta.config
        layers = layers or LayerRange(0, config.num_hidden_layers)
        stage = cls(meta, layers)
        target = torch.device(device)
        stage.to_empty(device=target)
        stage._fill(Checkpoint(Path(path)))
        if stage.embed_tokens is not None and stage.lm_head is not None and _tied(config):
            stage.lm_head.weight = stage.embed_tokens.weight  # to_empty() does not keep the tie
        rebuild_buffers(stage, config, target, {"rotary_emb"} if stage.rotary_emb is not None else set())
        stage._bind_rope()  # the rotary module was built again
        check_materialized(stage)
        if fusion.pays(dtype, target) if fuse is None else fuse:
            fusion.fuse(stage)
        if pack and packing.supported(dtype, target):
            packing.pack_linears(stage)
        attention.prefer_plan_free_kernels(target)
        return stage.eval()

    def _bind_rope(self) -> None:
        """A rope whose frequencies depend on the sequence's length (dynamic NTK, longrope) computes
        each row's tables from its own length (`app.partitions.rope`); `rope_limit` is the length up
        to which they are the config's own."""
        self.rope_limit: int | None = None
        rule = rope.length_rule(self.config) if self.rotary_emb is not None else None
        if rule is None or not rope.RowTables.applies(self.rotary_emb):
            self.rope = None
            return
        self.rope = rope.RowTables(self.rotary_emb, self.config, rule)
        self.rope_limit = rule.limit

    def _fill(self, checkpoint: Checkpoint) -> None:
        """Read every parameter and persistent buffer of this stage from the checkpoint."""
        family = self.family
        embedding = f"{family.body}.{family.embed}.weight"
        owners = {
            "embed_tokens": f"{family.body}.{family.embed}",
            "positions": f"{family.body}.{family.learned_positions}",
            "norm": f"{family.body}.{family.norm}",
            "lm_head": "lm_head",
        }
        non_persistent = {
            f"{module_name}.{buffer}" if module_name else buffer
            for module_name, module in self.named_modules()
            for buffer in getattr(module, "_non_persistent_buffers_set", ())
        }
        tensors: list[tuple[str, torch.Tensor]] = [*self.named_parameters()]
        tensors += [(n, b) for n, b in self.named_buffers() if n not in non_persistent]
        try:
            for local, tensor in tensors:
                head, _, rest = local.partition(".")
                if head == "layers":
                    index, _, tail = rest.partition(".")
                    name = f"{family.body}.{family.layers}.{self.range.start + int(index)}.{tail}"
                elif head in owners:
                    name = f"{owners[head]}.{rest}"
                else:
                    raise UnsupportedModel(f"unexpected stage tensor {local!r}")
                fallbacks = [name.removeprefix(f"{family.body}.")]  # saved from the base model
                if head == "lm_head" and _tied(self.config):
                    fallbacks += [embedding, embedding.removeprefix(f"{family.body}.")]  # tied head
                elif head == "lm_head" and name not in checkpoint:
                    raise UnsupportedModel(modelstore.NO_HEAD)
                fill(tensor, name, checkpoint, family, fallbacks=fallbacks)
        finally:
            checkpoint.close()

    def use_static(self, setting: str) -> str:
        """Run decode steps over fixed shapes (`app.partitions.static`) in the mode `setting`
        (`CONVEYOR_COMPILE`) resolves to on this stage's device; returns that mode."""
        mode = static.mode_for(setting, self.device)
        if self.rope is not None:  # each row's rotary tables are chosen on the host: eager steps
            mode = "off"
        self.static = None if mode == "off" else static.StaticDecode(self, mode)
        return mode

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.dtype

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters()) + packing.packed_bytes(self)

    def warmup(self, tokens: int = 16) -> None:
        """One prefill and one decode step on dummy input, so the first real job does not pay
        for the allocator and kernel start-up (about 200 ms on a CPU)."""
        if self.rope_limit is not None:  # not a step that grows past the rope's limit
            tokens = min(tokens, self.rope_limit - 1)
        mask = torch.ones(1, tokens, dtype=torch.long)
        state = BatchState(self.config, ["warmup"], mask)
        if self.embed_tokens is not None:
            x = torch.zeros(1, tokens, dtype=torch.long)
        else:
            x = torch.zeros(1, tokens, self.config.hidden_size, dtype=self.dtype)
        self(state, x)
        state.extend(1)
        self(state, x[:, -1:])

    def forward(self, state: BatchState, x: torch.Tensor) -> torch.Tensor:
        """Run one step over this stage's layers, uninterrupted (`steps`, driven to its end)."""
        return complete(self.steps(state, x))

    @torch.inference_mode()
    def steps(self, state: BatchState, x: torch.Tensor) -> Steps[torch.Tensor]:
        """One step over this stage's layers, suspended after every layer but the last.

        x: token ids [B, S] on the first stage, hidden states [B, S, D] on the others; the caller
        has already extended `state.attention_mask` to cover these S new positions.
        Whoever drives it may run other batches' work while it is suspended (the worker's compute
        thread runs urgent prefills there): it touches nothing of this step's. A decode step that
        `self.static` takes runs whole.
        Returns hidden states [B, S, D], or on the last stage the next-token logits [B, V] (float32).

        A decode step in which Phi-3 longrope rows grow past the rope's limit computes those C rows
        again whole (`_again`, n tokens each): on a stage before the last it returns the step's
        [B, 1, D] followed by those rows' n columns, [B + C * n, 1, D], which the next stage splits
        the same way (it finds the same rows).
        """
        again = self._crossing(state)
        if self.keeps_ids:
            _record_ids(state, x)
        if not again:
            return (yield from self._step(state, x))
        x, whole = self._split(state, again, x)
        out = yield from self._step(state, x)
        return self._again(state, again, whole, out)

    @torch.inference_mode()
    def _step(self, state: BatchState, x: torch.Tensor) -> Steps[torch.Tensor]:
        if self.static is not None and self.static.handles(state, x):
            return self.static(state, x)  # type: ignore[no-any-return]
        x = x.to(self.device)
        mask = state.attention_mask.to(self.device)
        new = x.shape[1]
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -new:]  # [B, S]
        hidden = self._embed(x, position_ids) if self.embed_tokens is not None else x  # [B, S, D]
        slabs = self._wide_slabs(state, new)
        if slabs:
            masks: dict[str, torch.Tensor | None] = dict.fromkeys(set(self.kinds), _wide_mask(slabs[0], mask))
        else:
            unpadded = bool(mask.bool().all())
            masks = {kind: self._mask(mask, new, kind, hidden.dtype, unpadded) for kind in set(self.kinds)}
        rotary = self._rotary(hidden, position_ids)
        for index, (layer, kind) in enumerate(zip(self.layers, self.kinds, strict=True)):
            if index:
                yield
            for slab in slabs:  # set again after every suspension: other batches' steps ran meanwhile
                slab.wide = True
            try:
                extra = {} if rotary is None else {"position_embeddings": rotary[kind]}
                out = layer(
                    hidden,
                    attention_mask=masks[kind],
                    position_ids=position_ids,
                    cache=state.cache,
                    use_cache=True,
                    **extra,
                )
            finally:
                for slab in slabs:
                    slab.wide = False
            hidden = out[0] if isinstance(out, tuple) else out
        self._check_windows(state)
        if state.keep_hidden:
            state.hidden = hidden
        return self.finish(hidden)

    @property
    def _again_past_limit(self) -> bool:
        """Whether rows growing past the rope's limit are computed again whole (`Family.longrope_again`)."""
        return self.family.longrope_again and self.rope is not None and self.rope.rule.kind == rope.LONGROPE

    @property
    def keeps_ids(self) -> bool:
        """A first stage whose rows may have to be computed again whole keeps their token ids."""
        return self.is_first and self._again_past_limit

    def _crossing(self, state: BatchState) -> list[int]:
        """The rows of a decode step (this stage's cache holds the history before it) whose
        longrope sequence grows past the rope's limit at this step (`rope.crossing`)."""
        if not self._again_past_limit:
            return []
        assert self.rope is not None
        held = state.length - 1
        if self.kinds[0] == SLIDING:
            assert self.window is not None
            held = min(held, self.window - 1)
        if state.slabs[self.range.start].length != held or held == 0:
            return []  # a prefill: each row's tables are already its whole length's
        return rope.crossing(self.rope.rule, state.attention_mask.sum(dim=-1))

    def _split(
        self, state: BatchState, rows: list[int], x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A crossing step's input: the step's own ([B, 1] ids or [B, 1, D]) and the C rows' whole
        n tokens ([C, n] ids from the history this first stage keeps, or the [C, n, D] hidden states
        the stage before packed after the step's)."""
        assert self.rope is not None
        n, batch = self.rope.rule.limit + 1, state.attention_mask.shape[0]
        if self.is_first:
            assert state.ids is not None
            return x, state.ids[torch.tensor(rows, dtype=torch.long), -n:]
        if x.shape[0] != batch + len(rows) * n or x.shape[1] != 1:
            raise RuntimeError(
                f"rows {rows} grow past the rope's limit: this stage needs their {n} columns after the "
                f"step's {batch} rows, the step brought {tuple(x.shape)}"
            )
        return x[:batch], x[batch:].reshape(len(rows), n, x.shape[2])

    def _again(
        self, state: BatchState, rows: list[int], tokens: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Compute `rows` again whole with the long factors, as Phi-3's `generate` does when a
        sequence grows past `original_max_position_embeddings`: their keys and values replace the
        ones in this stage's cache, their output the step's. `tokens`: their n tokens' input ([C, n]
        ids, or [C, n, D] hidden states). Runs whole (no suspension): once in a row's life."""
        n = tokens.shape[1]
        fresh = BatchState(
            self.config, [state.seq_ids[r] for r in rows], torch.ones(len(rows), n, dtype=torch.long)
        )
        redone = complete(self._step(fresh, tokens))  # [C, n, D] or logits [C, V]
        for layer in range(self.range.start, self.range.stop):
            state.slabs[layer].replace_rows(rows, fresh.slabs[layer])
        if self.is_last:
            out[torch.tensor(rows, dtype=torch.long, device=out.device)] = redone
            return out
        return torch.cat([out, redone.reshape(len(rows) * n, 1, out.shape[2])])  # [B + C * n, 1, D]

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step's output: hidden states [B, S, D] as they are, or on the last stage the
        next-token logits [B, V] in float32 (the norm and head on the last position only)."""
        if self.lm_head is None or self.norm is None:
            return hidden
        logits = self.lm_head(self.norm(hidden[:, -1, :]))
        return self.family.logits(self.config, logits).float()

    def _wide_slabs(self, state: BatchState, new: int) -> list[SlabLayer]:
        """This stage's cache layers, room made for the step's column, where a decode step attends
        over their whole buffers (`attention.WIDE_MIN_ROWS`): a half-precision step on a CPU through
        `attention.grouped_attention`, of enough rows, without sliding layers, every layer's buffer
        laid out alike. Else [] (the step attends over the live columns, as always)."""
        rows = state.attention_mask.shape[0]
        if (
            not self.wide_decode
            or new != 1
            or rows < attention.WIDE_MIN_ROWS
            or self.device.type != "cpu"
            or self.dtype not in attention.HALF
            or self.config._attn_implementation != attention.IMPLEMENTATION
            or SLIDING in self.kinds
        ):
            return []
        slabs = state.slabs[self.range.start : self.range.stop]
        if any(s._k is None or s.rows != rows or s.length != state.length - 1 for s in slabs):
            return []  # a first step, or a cache that does not match the mask: the usual path
        for slab in slabs:
            slab.reserve(1)
        first = slabs[0]
        assert first._k is not None
        layout = (first.start, first.end, first._k.shape)
        if any(s._k is None or (s.start, s.end, s._k.shape) != layout for s in slabs):
            return []
        return slabs

    def _embed(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None
        hidden = self.embed_tokens(ids)  # [B, S, D] (Gemma's scaled embedding scales itself)
        if self.positions is not None:
            hidden = hidden + self.positions(position_ids)
        multiplier = self.family.embedding_multiplier
        if multiplier is not None:
            hidden = hidden * getattr(self.config, multiplier)
        return hidden  # type: ignore[no-any-return]

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any] | None:
        if self.rotary_emb is None:
            return None
        if self._rotary_by_kind:  # Gemma 3: local and global layers have their own rope base
            return {kind: self.rotary_emb(hidden, position_ids, kind) for kind in set(self.kinds)}
        if self.rope is not None:
            table = self.rope(hidden, position_ids)
        else:
            table = self.rotary_emb(hidden, position_ids=position_ids)
        return dict.fromkeys(set(self.kinds), table)

    def _mask(
        self, mask: torch.Tensor, new: int, kind: str, dtype: torch.dtype, unpadded: bool
    ) -> torch.Tensor | None:
        """The 4-D attention mask of one step for layers of one kind: [B, 1, S, K], or None where
        SDPA's own causal rule is the same mask (no padding, and every key within the window):
        transformers skips the mask there too, and the same kernel gives the same numbers.

        Query i sits at column T - S + i of the batch's history (mask [B, T]); it sees key column k
        when k <= its column and k holds a real token, and for a sliding layer when it is within
        the window (k > q - window, transformers' rule). A sliding layer keeps only its last
        `window - 1` columns before the step, so its keys are the mask's last K columns.
        A prefill after cached columns (`app.partitions.prefix`) has S < T queries, each at its column.
        A padding query sees only itself: its output is never used, and a row that sees nothing
        would be NaN, which even a zero attention weight would carry into real rows.
        """
        total = mask.shape[1]
        within_window = kind != SLIDING or (self.window is not None and total <= self.window)
        if unpadded and within_window and not self.eager and new in (1, total):
            return None  # (SDPA's causal rule puts query 0 at key 0: not a prefill after cached columns)
        q = torch.arange(total - new, total, device=mask.device)[:, None]  # [S, 1]
        k = torch.arange(total, device=mask.device)[None, :]  # [1, T]
        allowed = (k <= q) & mask.bool()[:, None, :]  # [B, S, T]
        if kind == SLIDING:
            assert self.window is not None
            allowed = allowed & (k > q - self.window)
            kept = min(total - new, self.window - 1) + new
            allowed = allowed[:, :, total - kept :]
            k = k[:, total - kept :]
        allowed = (allowed | (k == q))[:, None]  # [B, 1, S, K]
        if not self.eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    def _check_windows(self, state: BatchState) -> None:
        """A sliding layer's cache must hold exactly the columns its mask assumed: refuse otherwise."""
        if self.window is None:
            return
        for index, kind in enumerate(self.kinds):
            slab = state.slabs[self.range.start + index]
            if kind == SLIDING and slab.length != min(state.length, self.window - 1):
                raise RuntimeError(
                    f"sliding cache of layer {self.range.start + index} holds {slab.length} columns, "
                    f"expected {min(state.length, self.window - 1)}"
                )


def _wide_mask(slab: SlabLayer, mask: torch.Tensor) -> torch.Tensor:
    """A decode step's mask over every column of the cache's buffers, [B, 1, 1, C]: the batch's
    history (mask [B, T], already extended by the step's column) sits in columns [start, end] of
    the buffer, the step's own key at `end`; every other column is excluded."""
    assert slab._k is not None
    allowed = torch.zeros(mask.shape[0], slab._k.shape[2], dtype=torch.bool, device=mask.device)
    allowed[:, slab.start : slab.end + 1] = mask.bool()
    return allowed[:, None, None, :]


def _record_ids(state: BatchState, x: torch.Tensor) -> None:
    """Append a step's token ids [B, S] to the history a first stage keeps (a prefill's start it)."""
    ids = x.detach().to("cpu", torch.long)
    state.ids = ids if state.ids is None else torch.cat([state.ids, ids], dim=1)
    if state.ids.shape != state.attention_mask.shape:
        raise RuntimeError(f"token ids {tuple(state.ids.shape)} out of step with the mask")


def _tied(config: Any) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))
