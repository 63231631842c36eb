"""Graph partitions (docs/architecture.md): cut a captured `torch.fx` graph into pieces under a memory budget.

Pipeline, each step a plain function of its inputs:

    capture(module, example_inputs, dynamic_shapes)      -> GraphModule   (torch.export, then .module())
    estimate(gm, example_inputs)                          -> {node: NodeCost}
    partition(gm, max_mem_mb=... | parts=...)             -> GraphPlan      (topological order)
    run_chain(plan.partitions, {name: value}, ...)        -> {name: value}  (piece after piece, by name)

Which node goes to which piece app/partitions/assign.py decides. Every piece is a GraphModule
that owns the weights it reads, takes its inputs positionally in the order of `input_names`, and
returns a dict keyed by `output_names`. Values crossing pieces are the hand-offs a stage worker
sends to the next; symbolic sizes (batch, sequence) are recomputed inside each piece from a tensor it
receives, so hand-offs are tensors only when the graph allows it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import sympy
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.fx.passes.split_module import split_module

from app.partitions.assign import MB, Costs, NodeCost, Nodes, balanced_assign, greedy_assign, piece_sizes

COMPUTE_OPS = ("call_function", "call_method", "call_module")
_SIZE_OPS = (torch.ops.aten.sym_size.int,)


def capture(module: nn.Module, example_inputs: tuple[Any, ...], dynamic_shapes: Any = None) -> fx.GraphModule:
    """Capture `module` as an aten-level fx graph (called once per model, by planners and tests).

    `dynamic_shapes` is passed to `torch.export.export` as is (e.g. `{"x": {0: Dim("batch")}}`);
    without it the graph is specialised to the example shapes.
    """
    module = module.eval()
    with torch.no_grad():
        program = torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes)
    return program.module()  # type: ignore[return-value]


# --- estimate ---------------------------------------------------------------------------------


def estimate(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None) -> dict[str, NodeCost]:
    """Per-node memory at the planning shape (called by `partition`, and by reports).

    Shapes come from the `val` meta that torch.export attaches; symbolic dimensions are bound to
    the sizes of `example_inputs` when given, else to the sizes seen at capture. A graph without
    that meta (a `symbolic_trace`) needs `example_inputs` and gets `ShapeProp` run over it.
    """
    if any(n.users and "val" not in n.meta and "tensor_meta" not in n.meta for n in _compute_nodes(gm)):
        if example_inputs is None:
            raise ValueError("graph has no shape meta: pass example_inputs to estimate it")
        with torch.no_grad():
            ShapeProp(gm).propagate(*gm.graph._codegen.process_inputs(*example_inputs))
    bindings = _bind_symbols(gm, example_inputs)
    costs: dict[str, NodeCost] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val", node.meta.get("tensor_meta"))
        value_bytes = sum(_nbytes(t, bindings) for t in _leaves(value))
        if node.op == "get_attr":
            costs[node.name] = NodeCost(value_bytes, 0, value_bytes)
        elif node.op == "call_module":
            held = _module_bytes(gm.get_submodule(str(node.target)))
            costs[node.name] = NodeCost(held, value_bytes, value_bytes)
        else:
            activation = 0 if _is_view(node) or node.op == "placeholder" else value_bytes
            costs[node.name] = NodeCost(0, activation, value_bytes)
    return costs


def _bind_symbols(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> dict[sympy.Symbol, int]:
    """Symbol -> size, read off the placeholders (`s0` of input_ids [s0, s1] -> 32, say)."""
    flat = None if example_inputs is None else gm.graph._codegen.process_inputs(*example_inputs)
    bindings: dict[sympy.Symbol, int] = {}
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for d, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                hint = size.node.hint if flat is None else flat[i].shape[d]
                if hint is not None:
                    bindings[size.node.expr] = int(hint)
    return bindings


def _nbytes(value: Any, bindings: Mapping[sympy.Symbol, int]) -> int:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        return 0  # a SymInt or a non-tensor: nothing worth counting
    return math.prod(_size(size, bindings) for size in shape) * dtype.itemsize


def _size(size: int | torch.SymInt, bindings: Mapping[sympy.Symbol, int]) -> int:
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = sympy.sympify(sympy.sympify(size.node.expr).xreplace(bindings))
    hint = size.node.hint if expr.free_symbols else expr  # an unbound (data-dependent) size: its hint
    if hint is None:
        raise ValueError(f"cannot size {size.node.expr}: no binding and no hint")
    return int(hint)


def _leaves(value: Any) -> list[Any]:
    """A node's output tensors: one, or several for tuple-returning ops (TensorMetadata is a tuple)."""
    return list(value) if isinstance(value, (list, tuple)) and not hasattr(value, "shape") else [value]


def _is_view(node: fx.Node) -> bool:
    """True for aten views (view, expand, transpose, slice, ...): they allocate nothing."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _module_bytes(module: nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]


# --- split: partition ids -> pieces ------------------------------------------------------------


class UnloadedWeights(RuntimeError):
    """A piece planned on `meta` still holds tensors that were never loaded (CPU ops would read garbage)."""


@dataclass(frozen=True)
class GraphPartition:
    """One piece: what a stage worker loads (its weights) and exchanges (hand-offs, by name)."""

    index: int
    module: fx.GraphModule  # forward(*[values[n] for n in input_names]) -> {name: value}
    input_names: tuple[str, ...]  # graph inputs and earlier pieces' outputs it reads
    output_names: tuple[str, ...]  # values later pieces or the caller need
    param_names: tuple[str, ...]  # qualified names, in the captured module, of the weights it owns
    param_attrs: tuple[str, ...]  # where `module` holds each of param_names (a flattened attribute)
    param_bytes: int
    activation_bytes: int  # estimated at the planning shape: own outputs and received hand-offs

    def __call__(self, values: Mapping[str, Any]) -> dict[str, Any]:
        unloaded = self.unloaded()
        if unloaded:  # a meta weight: linear() on the CPU would return uninitialised memory, not fail
            shown = ", ".join(unloaded[:3]) + (f" and {len(unloaded) - 3} more" if len(unloaded) > 3 else "")
            raise UnloadedWeights(f"partition {self.index} has tensors on meta, never loaded: {shown}")
        return self.module(*[values[name] for name in self.input_names])  # type: ignore[no-any-return]

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put `tensors` (qualified name -> tensor of the planned shape and dtype) in place of the piece's
        own. Called once by a stage worker on a piece planned on `meta`; a name not given keeps its
        tensor, so `unloaded()` then names what the checkpoint lacked."""
        for name, attr in zip(self.param_names, self.param_attrs, strict=True):
            if name not in tensors:
                continue
            owner, _, leaf = attr.rpartition(".")  # "w" -> ("", "w"): the piece itself
            module, new = self.module.get_submodule(owner), tensors[name]
            old = getattr(module, leaf)
            if (new.shape, new.dtype) != (old.shape, old.dtype):
                raise ValueError(
                    f"{name}: {new.dtype}{list(new.shape)}, planned {old.dtype}{list(old.shape)}"
                )
            kept = nn.Parameter(new, old.requires_grad) if isinstance(old, nn.Parameter) else new
            setattr(module, leaf, kept)  # a parameter stays a parameter, a buffer a buffer

    def unloaded(self) -> list[str]:
        """Qualified names of the piece's tensors still on `meta` (planned, never loaded)."""
        qualified = dict(zip(self.param_attrs, self.param_names, strict=True))
        held = [*self.module.named_parameters(), *self.module.named_buffers()]
        return [qualified.get(attr, attr) for attr, tensor in held if tensor.is_meta]


@dataclass(frozen=True)
class GraphPlan:
    """The unsplit graph, its pieces in topological order, and how to call the chain like the module."""

    graph_module: fx.GraphModule
    partitions: tuple[GraphPartition, ...]
    assignment: dict[str, int] = field(repr=False)  # compute node name -> partition index
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def __call__(self, *args: Any) -> Any:
        """Same call and return structure as `graph_module(*args)`, run through the chain."""
        codegen = self.graph_module.graph._codegen
        flat = codegen.process_inputs(*args)
        values = run_chain(self.partitions, dict(zip(self.input_names, flat, strict=True)), self.output_names)
        out_node = next(n for n in reversed(self.graph_module.graph.nodes) if n.op == "output")
        return codegen.process_outputs(fx.graph.map_arg(out_node.args[0], lambda n: values[n.name]))

    @property
    def param_bytes(self) -> int:
        """Bytes of the unsplit graph's weights (a tensor pieces share counted once), loaded or on meta."""
        return _module_bytes(self.graph_module)

    def fingerprint(self, model: str) -> str:
        """12 hex digits naming the cut: `model`, the piece count, each piece's first and last node and
        node count, and the names it receives and hands on (not weights, devices or shapes).

        Stage workers plan independently: each stamps its messages with this and refuses a message
        stamped by another plan, whose tensors it would mis-read."""
        members: dict[int, list[str]] = {}
        for node in self.graph_module.graph.nodes:
            if node.name in self.assignment:
                members.setdefault(self.assignment[node.name], []).append(node.name)
        pieces = [
            [members[p.index][0], members[p.index][-1], len(members[p.index]), p.input_names, p.output_names]
            for p in self.partitions
        ]
        cut = [model, len(self.partitions), self.input_names, self.output_names, pieces]
        return hashlib.sha256(json.dumps(cut).encode()).hexdigest()[:12]


def partition(
    gm: fx.GraphModule,
    *,
    max_mem_mb: float | None = None,
    parts: int | None = None,
    example_inputs: Sequence[Any] | None = None,
) -> GraphPlan:
    """Plan `gm` into pieces: under `max_mem_mb` each, or into `parts` balanced ones (exactly one).

    `example_inputs` sets the shape activations are estimated at (default: the capture's shapes);
    plan with the largest batch and sequence a stage will see. `gm` stays runnable and can be
    planned again (split_module tags its nodes; ShapeProp may add shape meta).
    """
    if (max_mem_mb is None) == (parts is None):
        raise ValueError("give exactly one of max_mem_mb and parts")
    costs = estimate(gm, example_inputs)
    nodes = _compute_nodes(gm)
    if parts is not None:
        assignment = balanced_assign(nodes, costs, parts)
    else:
        assert max_mem_mb is not None
        assignment = _fewest_even_pieces(nodes, costs, int(max_mem_mb * MB))
    return build_plan(gm, assignment, costs)


def _fewest_even_pieces(nodes: Nodes, costs: Costs, budget: int) -> dict[str, int]:
    """Greedy packing decides how many pieces; the balancer then evens them out under the same budget
    (kept only when every piece's exact size still fits)."""
    greedy = greedy_assign(nodes, costs, budget)
    try:
        even = balanced_assign(nodes, costs, max(greedy.values()) + 1, budget)
    except ValueError:
        return greedy
    return even if max(piece_sizes(nodes, costs, even)) <= budget else greedy


def build_plan(gm: fx.GraphModule, assignment: dict[str, int], costs: Costs) -> GraphPlan:
    """split_module, then make each piece own its weights and speak in named tensors."""
    split = split_module(
        gm, gm, lambda n: assignment[n.name], keep_original_node_name=True, tuple_return=True
    )
    pids = sorted(set(assignment.values()))
    pieces = [cast(fx.GraphModule, getattr(split, f"submod_{pid}")) for pid in pids]
    owned = [_own_weights(gm, piece) for piece in pieces]
    for piece in pieces:
        _local_sizes(piece)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph_outputs = tuple(n.name for n in out.all_input_nodes)
    _named_outputs(pieces, graph_outputs)
    partitions = tuple(
        _describe(i, p, costs, names) for i, (p, names) in enumerate(zip(pieces, owned, strict=True))
    )
    inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    return GraphPlan(gm, partitions, dict(assignment), inputs, graph_outputs)


def _own_weights(gm: fx.GraphModule, piece: fx.GraphModule) -> dict[str, str]:
    """split_module passes tensor attributes in as placeholders; move them into the piece instead.

    Returns qualified name (in `gm`) -> attribute (in the piece) of the weights the piece now
    holds, call_module ones too.
    """
    graph, attrs = piece.graph, {n.name: n for n in gm.graph.nodes if n.op == "get_attr"}
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    owned: dict[str, str] = {}
    for ph in [n for n in graph.nodes if n.op == "placeholder" and str(n.target) in attrs]:
        source = attrs[str(ph.target)]
        tensor = functools.reduce(getattr, str(source.target).split("."), gm)
        if not isinstance(tensor, torch.Tensor):
            continue
        if isinstance(tensor, nn.Parameter):
            piece.register_parameter(source.name, tensor)
        else:
            piece.register_buffer(source.name, tensor)
        with graph.inserting_before(anchor):
            local = graph.get_attr(source.name)
        local.meta = dict(ph.meta)
        ph.replace_all_uses_with(local)
        graph.erase_node(ph)
        owned[str(source.target)] = source.name
    originals = {n.name: n for n in gm.graph.nodes}
    for node in (n for n in graph.nodes if n.op == "call_module"):
        prefix = str(originals[node.name].target)
        for name in gm.get_submodule(prefix).state_dict():
            owned[f"{prefix}.{name}"] = f"{node.target}.{name}"
    return owned


def _local_sizes(piece: fx.GraphModule) -> None:
    """Replace a received SymInt (batch size, sequence length) by `sym_size` of a received tensor.

    A size travelling as a scalar hand-off would need its own codec; the tensors that arrive
    already carry it. A size no received tensor carries stays a (scalar) input.
    """
    graph = piece.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    carriers: dict[Any, tuple[fx.Node, int]] = {}  # symbol -> (received tensor, dim)
    for node in placeholders:
        for dim, size in enumerate(getattr(node.meta.get("val"), "shape", ())):
            if isinstance(size, torch.SymInt):
                carriers.setdefault(size.node.expr, (node, dim))
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for ph in placeholders:
        value = ph.meta.get("val")
        if not isinstance(value, torch.SymInt) or value.node.expr not in carriers:
            continue
        with graph.inserting_before(anchor):
            local = graph.create_node(
                "call_function", _SIZE_OPS[0], carriers[value.node.expr], name=f"{ph.target}_local"
            )
        local.meta = {"val": value, "local_size": True}
        ph.replace_all_uses_with(local)
        graph.erase_node(ph)


def _named_outputs(pieces: Sequence[fx.GraphModule], graph_outputs: Sequence[str]) -> None:
    """(a, b) -> {"a": a}: a piece returns, by name, what a later piece reads or the caller wants."""
    for k, piece in enumerate(pieces):
        later = {str(n.target) for p in pieces[k + 1 :] for n in p.graph.nodes if n.op == "placeholder"}
        out = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
        out.args = ({n.name: n for n in out.args[0] if n.name in later or n.name in graph_outputs},)
        for node in reversed(list(piece.graph.nodes)):  # sizes the next pieces now read off tensors
            if node.target in _SIZE_OPS and not node.users:
                piece.graph.erase_node(node)
        piece.graph.lint()
        piece.recompile()


def _describe(index: int, piece: fx.GraphModule, costs: Costs, owned: dict[str, str]) -> GraphPartition:
    inputs = tuple(str(n.target) for n in piece.graph.nodes if n.op == "placeholder")
    out = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
    made = sum(
        costs[n.name].activation_bytes for n in piece.graph.nodes if n.op in COMPUTE_OPS and n.name in costs
    )
    received = sum(costs[name].value_bytes for name in inputs)
    outputs, names, attrs = tuple(out.args[0]), tuple(owned), tuple(owned.values())
    return GraphPartition(index, piece, inputs, outputs, names, attrs, _module_bytes(piece), made + received)


# --- run -------------------------------------------------------------------------------------


def run_chain(
    partitions: Sequence[GraphPartition], inputs: Mapping[str, Any], output_names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Run the pieces in order, as stage workers would (called by `GraphPlan.__call__` and tests).

    Each piece receives only the values it names; between pieces the message keeps only values a
    later piece or the caller still needs. `output_names` defaults to the last piece's outputs.
    """
    wanted = tuple(output_names) if output_names is not None else partitions[-1].output_names
    message = dict(inputs)
    for k, piece in enumerate(partitions):
        missing = [name for name in piece.input_names if name not in message]
        if missing:
            raise KeyError(f"partition {piece.index} needs {missing}, which nothing handed over")
        message.update(piece({name: message[name] for name in piece.input_names}))
        needed = {n for p in partitions[k + 1 :] for n in p.input_names} | set(wanted)
        message = {name: value for name, value in message.items() if name in needed}
    return {name: message[name] for name in wanted}


def handoff_names(plan: GraphPlan, k: int) -> tuple[str, ...]:
    """Names the message from piece k to piece k + 1 carries (after the last piece: the outputs).

    Called by whoever sends stage k's result on: graph inputs and values made so far that a later
    piece or the caller still reads.
    """
    made = dict.fromkeys([*plan.input_names, *(n for p in plan.partitions[: k + 1] for n in p.output_names)])
    needed = {n for p in plan.partitions[k + 1 :] for n in p.input_names} | set(plan.output_names)
    return tuple(name for name in made if name in needed)
