"""Memory-budget partition planner for decoder language models (docs/architecture.md).

Who calls what: `conveyor plan` calls `load_config`, then `plan_decoder`, prints `format_table` and
writes `Plan.to_json()`; the launcher reads that file with `Plan.from_json` and starts one stage
worker per `Plan.ranges()` entry; whoever measures per-stage step latency calls `rebalance` for new
cut points. Everything here is pure: a config in, a plan out. Costs come from the model built on the
`meta` device (no weights are allocated): a 175B configuration is planned in under a second, plus
about two for transformers to import the model's module the first time.

Units: `max_mem_mb` is MiB (2**20 bytes; 81920 = an 80 GiB device). FLOPs are per token: 2 per
weight of every matrix a token goes through (embedding lookups cost none, the LM head counts).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

CONFIGS = Path(__file__).parent / "configs"
PLAN_FORMAT = "conveyor.plan/1"
MIB = 2**20


@dataclass(frozen=True)
class StagePlan:
    """One stage: decoder layers [start, stop) plus the embedding (first) or norm + LM head (last)."""

    stage: int
    start: int
    stop: int  # exclusive
    param_bytes: int  # a tied LM head counts again on the last stage when the embedding lives elsewhere
    kv_bytes_per_token: int  # per sequence per token: 2 * layers * kv_heads * head_dim * dtype bytes
    activation_bytes_per_token: int  # hidden states handed to the next stage; 0 on the last stage
    compute_share: float  # this stage's share of the per-token FLOPs (the model's prediction)
    has_embedding: bool
    has_head: bool

    def memory_bytes(self, kv_tokens: int) -> int:
        """What the device must hold: parameters plus the KV cache for `kv_tokens` tokens."""
        return self.param_bytes + kv_tokens * self.kv_bytes_per_token


@dataclass(frozen=True)
class Plan:
    """An immutable partition plan; stage ranges are contiguous and cover every layer once."""

    model: str
    dtype: str
    num_layers: int
    max_mem_mb: float | None
    kv_budget_tokens: int
    stages: tuple[StagePlan, ...]

    def __post_init__(self) -> None:
        """The launcher trusts a plan read from a file: check it covers every layer once, in order."""
        starts = [0] + [s.stop for s in self.stages]
        numbered = all(s.stage == k and s.start == starts[k] < s.stop for k, s in enumerate(self.stages))
        if not (self.stages and numbered and starts[-1] == self.num_layers):
            raise ValueError(
                f"stages {self.ranges()} do not cover layers 0-{self.num_layers - 1} once, in order"
            )

    def ranges(self) -> list[tuple[int, int]]:
        return [(s.start, s.stop) for s in self.stages]

    def to_json(self) -> str:
        body = {"format": PLAN_FORMAT, **asdict(self)}
        return json.dumps(body, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        body = json.loads(text)
        if body.pop("format", None) != PLAN_FORMAT:
            raise ValueError(f"not a {PLAN_FORMAT} plan file")
        stages = tuple(StagePlan(**s) for s in body.pop("stages"))
        return cls(stages=stages, **body)


@dataclass(frozen=True)
class ModelCosts:
    """Per-layer and end-piece costs of one decoder model, in parameters and FLOPs per token."""

    layer_params: tuple[int, ...]
    layer_flops: tuple[int, ...]
    first_params: int  # token (and position) embeddings: everything registered before the layers
    first_flops: int
    last_params: int  # final norm, and the LM head when it is not tied
    last_flops: int  # includes the LM head, tied or not
    tied_head_params: int  # the LM head's weight when tied to the embedding, else 0
    kv_per_layer: int  # KV elements per token per layer: 2 * kv_heads * head_dim
    hidden_size: int


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float16', 'fp16', 'bf16', 'torch.float32'... -> torch dtype (the CLI's --dtype)."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}
    key = name.removeprefix("torch.").lower()
    dtype = getattr(torch, aliases.get(key, key), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; try float16, bfloat16 or float32")
    return dtype


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def load_config(source: str | Path) -> PretrainedConfig:
    """A model directory, a config.json path, or the name of a bundled config (never the hub)."""
    path = Path(source)
    bundled = CONFIGS / f"{source}.json"
    if not path.exists() and bundled.is_file():
        config = AutoConfig.from_pretrained(bundled, local_files_only=True)
        config.name_or_path = str(source)  # the plan's model name: "gpt3-175b", not a file path
        return config
    if not path.exists():
        names = ", ".join(bundled_configs())
        raise ValueError(
            f"no model directory, config file or bundled config {str(source)!r}; bundled: {names}"
        )
    return AutoConfig.from_pretrained(path, local_files_only=True)


def model_costs(config: PretrainedConfig) -> ModelCosts:
    """Count parameters per decoder layer on a `meta`-device copy of the model (allocates no weights)."""
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    text = config.get_text_config()
    layers_name = _layers_name(model, text.num_hidden_layers)
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    active = _expert_fraction(text)
    layer_params, layer_flops = [0] * text.num_hidden_layers, [0] * text.num_hidden_layers
    ends = {"first": [0, 0], "last": [0, 0]}  # [params, flops]
    seen_layers = False
    for name, param in model.named_parameters():  # shared (tied) weights appear once
        flops = 0 if id(param) in lookups or param.dim() < 2 else 2 * param.numel()
        if ".experts." in name:
            flops = int(flops * active)
        if name.startswith(layers_name + "."):
            index = int(name[len(layers_name) + 1 :].split(".")[0])
            layer_params[index] += param.numel()
            layer_flops[index] += flops
            seen_layers = True
        else:
            bucket = ends["last" if seen_layers else "first"]
            bucket[0] += param.numel()
            bucket[1] += flops
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    tied_params = head.weight.numel() if tied else 0
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return ModelCosts(
        layer_params=tuple(layer_params),
        layer_flops=tuple(layer_flops),
        first_params=ends["first"][0],
        first_flops=ends["first"][1],
        last_params=ends["last"][0],
        last_flops=ends["last"][1] + 2 * tied_params,
        tied_head_params=tied_params,
        kv_per_layer=2 * kv_heads * head_dim,
        hidden_size=text.hidden_size,
    )


def _layers_name(model: nn.Module, num_layers: int) -> str:
    """The decoder-layer list: `model.layers` (Llama family), `transformer.h` (GPT-2)..."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return name
    raise ValueError(f"{type(model).__name__} has no list of {num_layers} decoder layers")


def _expert_fraction(text: PretrainedConfig) -> float:
    """Mixture-of-experts layers: a token goes through top-k of the experts, not all of them."""
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    return top_k / experts if experts and top_k else 1.0


class _Problem:
    """Segment costs for the partitioner: compute, parameters and memory of layers [i, j)."""

    def __init__(
        self,
        costs: ModelCosts,
        *,
        dtype: torch.dtype,
        kv_tokens: int,
        budget_mb: float | None,
        compute: Sequence[float] | None = None,
        ends: tuple[float, float] | None = None,
    ) -> None:
        """`compute` and `ends` (first, last piece) default to the FLOPs model."""
        self.costs, self.itemsize, self.kv_tokens = costs, dtype.itemsize, kv_tokens
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.budget = None if budget_mb is None else budget_mb * MIB
        self.n = len(costs.layer_params)
        first, last = ends or (costs.first_flops, costs.last_flops)
        self.first_compute: float = first
        self.last_compute: float = last
        self._compute = list(accumulate(costs.layer_flops if compute is None else compute, initial=0))
        self._params = list(accumulate(costs.layer_params, initial=0))

    def compute(self, i: int, j: int) -> float:
        first = self.first_compute if i == 0 else 0
        return self._compute[j] - self._compute[i] + first + (self.last_compute if j == self.n else 0)

    def params(self, i: int, j: int) -> int:
        c = self.costs
        ends = c.first_params if i == 0 else 0
        if j == self.n:  # a tied head is already there when the same stage holds the embedding
            ends += c.last_params + (c.tied_head_params if i > 0 else 0)
        return int(self._params[j] - self._params[i]) + ends

    def kv_per_token(self, i: int, j: int) -> int:
        return self.costs.kv_per_layer * self.itemsize * (j - i)

    def memory(self, i: int, j: int) -> int:
        return self.params(i, j) * self.itemsize + self.kv_tokens * self.kv_per_token(i, j)

    def fits(self, i: int, j: int) -> bool:
        return self.budget is None or self.memory(i, j) <= self.budget


def _check_layers_fit(p: _Problem) -> None:
    """plan_decoder calls this before packing: every layer (with its end piece) must fit alone."""
    for i in range(p.n):
        if not p.fits(i, i + 1):
            assert p.budget is not None
            kv = p.kv_tokens * p.kv_per_token(i, i + 1)
            ends = ["the embedding"] * (i == 0) + ["the norm and LM head"] * (i == p.n - 1)
            extra = f" with {' and '.join(ends)}" if ends else ""
            raise ValueError(
                f"layer {i}{extra} alone needs {p.memory(i, i + 1) / MIB:.1f} MiB "
                f"({p.params(i, i + 1) * p.itemsize / MIB:.1f} MiB parameters + {kv / MIB:.1f} MiB KV cache "
                f"for {p.kv_tokens} tokens), over the budget of {p.budget / MIB:g} MiB per device"
            )


def _greedy_stages(p: _Problem, bound: float = float("inf")) -> int:
    """Fewest stages with every stage fitting and computing at most `bound` (greedy is exact here:
    a part of a feasible segment is feasible)."""
    count, i = 0, 0
    while i < p.n:
        j = i
        while j < p.n and p.fits(i, j + 1) and p.compute(i, j + 1) <= bound:
            j += 1
        if j == i:
            return p.n + 1
        count, i = count + 1, j
    return count


def _bottleneck(p: _Problem, stages: int) -> float:
    """The smallest achievable maximum stage compute with `stages` stages (binary search over
    the compute of every feasible segment)."""
    candidates = set()
    for i in range(p.n):
        for j in range(i + 1, p.n + 1):
            if not p.fits(i, j):
                break
            candidates.add(p.compute(i, j))
    ordered = sorted(candidates)
    lo, hi = 0, len(ordered) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _greedy_stages(p, ordered[mid]) <= stages else (mid + 1, hi)
    return ordered[lo]


def _cuts(p: _Problem, stages: int) -> list[int]:
    """Cut points [0, c1, ..., n] minimizing the maximum stage compute, then (among those) the sum of
    squared compute and of squared memory, so spare layers go where they hurt least."""
    bound = _bottleneck(p, stages)
    inf = (float("inf"), float("inf"))
    best: list[list[tuple[float, float]]] = [[inf] * (p.n + 1) for _ in range(stages + 1)]
    back = [[0] * (p.n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        for j in range(s, p.n - (stages - s) + 1):
            for i in range(j - 1, s - 2, -1):  # widen the segment until it no longer fits
                if p.compute(i, j) > bound or not p.fits(i, j):
                    break
                prev = best[s - 1][i]
                score = (prev[0] + p.compute(i, j) ** 2, prev[1] + p.memory(i, j) ** 2)
                if score < best[s][j]:
                    best[s][j], back[s][j] = score, i
    cuts = [p.n]
    for s in range(stages, 0, -1):
        cuts.append(back[s][cuts[-1]])
    return cuts[::-1]


def plan_decoder(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype | str = torch.float16,
    max_mem_mb: float | None = None,
    stages: int | None = None,
    kv_budget_tokens: int = 0,
    name: str = "",
) -> Plan:
    """Cut a decoder LM on layer boundaries: the fewest stages that fit `max_mem_mb` each (param
    bytes + `kv_budget_tokens` tokens of KV cache), or exactly `stages`; then balance by compute.
    `dtype` is the weights' and the KV cache's (a torch dtype, or a name such as "float16")."""
    if (max_mem_mb is None) == (stages is None):
        raise ValueError(f"give exactly one of max_mem_mb ({max_mem_mb}) and stages ({stages})")
    p = _Problem(
        model_costs(config), dtype=parse_dtype(dtype), kv_tokens=kv_budget_tokens, budget_mb=max_mem_mb
    )
    if stages is None:
        _check_layers_fit(p)
        stages = _greedy_stages(p)
    elif not 1 <= stages <= p.n:
        raise ValueError(f"cannot cut {p.n} layers into {stages} stages")
    model = name or getattr(config, "name_or_path", "") or config.model_type
    return _plan(p, _cuts(p, stages), model=model, max_mem_mb=max_mem_mb)


def rebalance(plan: Plan, step_latency_s: Sequence[float], config: PretrainedConfig) -> Plan:
    """New cut points from measured per-stage step latency (the seeds' dynamic load balancing).

    A stage's measured seconds per unit of predicted compute (latency / compute share) scales the
    FLOPs of the layers it ran, on the view that devices are alike and the FLOPs model was off
    there (attention over long contexts, sampling, a codec). The same number of stages is re-cut
    under the same budget so that predicted latencies are equal; with equal latencies on a balanced
    plan the cut points stay. The new plan's compute shares are the FLOPs model's again, so the
    next measurement is read against the same baseline."""
    if len(step_latency_s) != len(plan.stages) or min(step_latency_s) <= 0:
        raise ValueError(
            f"need one positive latency per stage ({len(plan.stages)}), got {list(step_latency_s)}"
        )
    costs = model_costs(config)
    if len(costs.layer_flops) != plan.num_layers:
        raise ValueError(f"the plan has {plan.num_layers} layers, the config {len(costs.layer_flops)}")
    total = sum(costs.layer_flops) + costs.first_flops + costs.last_flops
    seconds = [t / (s.compute_share * total) for t, s in zip(step_latency_s, plan.stages, strict=True)]
    scaled = [costs.layer_flops[i] * seconds[s.stage] for s in plan.stages for i in range(s.start, s.stop)]
    ends = (costs.first_flops * seconds[0], costs.last_flops * seconds[-1])
    common: dict[str, Any] = {
        "dtype": parse_dtype(plan.dtype),
        "kv_tokens": plan.kv_budget_tokens,
        "budget_mb": plan.max_mem_mb,
    }
    cuts = _cuts(_Problem(costs, compute=scaled, ends=ends, **common), len(plan.stages))
    return _plan(_Problem(costs, **common), cuts, model=plan.model, max_mem_mb=plan.max_mem_mb)


def _plan(p: _Problem, cuts: list[int], *, model: str, max_mem_mb: float | None) -> Plan:
    """Assemble the Plan for cut points [0, c1, ..., n]; compute shares from `p`'s compute."""
    total = p.compute(0, p.n)
    stages = tuple(
        StagePlan(
            stage=stage,
            start=i,
            stop=j,
            param_bytes=p.params(i, j) * p.itemsize,
            kv_bytes_per_token=p.kv_per_token(i, j),
            activation_bytes_per_token=p.costs.hidden_size * p.itemsize if j < p.n else 0,
            compute_share=p.compute(i, j) / total,
            has_embedding=i == 0,
            has_head=j == p.n,
        )
        for stage, (i, j) in enumerate(zip(cuts, cuts[1:], strict=False))
    )
    return Plan(
        model=model,
        dtype=p.dtype_name,
        num_layers=p.n,
        max_mem_mb=max_mem_mb,
        kv_budget_tokens=p.kv_tokens,
        stages=stages,
    )


def format_table(plan: Plan) -> str:
    """A readable table of the plan, for `conveyor plan` to print."""
    budget = f"{plan.max_mem_mb:g} MiB per device" if plan.max_mem_mb is not None else "no memory budget"
    lines = [
        f"{plan.model}: {plan.num_layers} layers, {plan.dtype}, {len(plan.stages)} stages, {budget}, "
        f"KV cache for {plan.kv_budget_tokens} tokens",
        f"{'stage':>5}  {'layers':<14}{'params':>11}{'KV/token':>11}{'act/token':>11}{'compute':>9}  memory",
    ]
    for s in plan.stages:
        ends = ("+emb" if s.has_embedding else "") + ("+head" if s.has_head else "")
        layers = f"{s.start}-{s.stop - 1}{ends}"
        used = s.memory_bytes(plan.kv_budget_tokens)
        memory = _size(used)
        if plan.max_mem_mb is not None:
            memory += f" / {_size(plan.max_mem_mb * MIB)} ({used / (plan.max_mem_mb * MIB):.0%})"
        lines.append(
            f"{s.stage:>5}  {layers:<14}{_size(s.param_bytes):>11}{_size(s.kv_bytes_per_token):>11}"
            f"{_size(s.activation_bytes_per_token):>11}{s.compute_share:>9.1%}  {memory}"
        )
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
