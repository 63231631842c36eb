"""Assigning a graph's compute nodes to pieces under a memory budget (app/partitions/graph.py cuts
the graph where these say): what each node costs (`NodeCost`, from `graph.estimate`), the greedy
packing and the even (least squares) cut into a given number of pieces. Pure functions of the nodes
in topological order and their costs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import fx

MB = 1024 * 1024  # `max_mem_mb` counts MiB, the unit device memory is reported in
Costs = Mapping[str, "NodeCost"]  # node name -> cost, from `estimate`
Nodes = Sequence[fx.Node]  # compute nodes in topological order


@dataclass(frozen=True)
class NodeCost:
    """What one node costs at the planning shape: the weights it reads and the value it makes."""

    param_bytes: int  # get_attr: the tensor; call_module: the submodule's parameters and buffers
    activation_bytes: int  # output bytes the node allocates (0 for views of another tensor)
    value_bytes: int  # output bytes once materialised, which is what a hand-off carries


class _Packer:
    """Exact cost of one partition as nodes join it: own outputs, weights read, values received."""

    def __init__(self, costs: Costs) -> None:
        self.costs = costs
        self.members: set[str] = set()
        self.held: set[str] = set()  # weights and incoming hand-offs already counted
        self.total = 0

    def added(self, node: fx.Node) -> tuple[int, int]:
        """(weight bytes, value bytes) that `node` would add."""
        weights, values = self.costs[node.name].param_bytes, self.costs[node.name].activation_bytes
        for arg in node.all_input_nodes:
            if arg.name not in self.members and arg.name not in self.held:
                weights += self.costs[arg.name].param_bytes
                values += 0 if arg.op == "get_attr" else self.costs[arg.name].value_bytes
        return weights, values

    def add(self, node: fx.Node) -> None:
        self.total += sum(self.added(node))
        self.members.add(node.name)
        self.held.update(a.name for a in node.all_input_nodes)


def greedy_assign(nodes: Nodes, costs: Costs, budget: int) -> dict[str, int]:
    """The seed's packing: nodes in topological order, a new partition when the next would overflow."""
    assignment: dict[str, int] = {}
    packer, pid = _Packer(costs), 0
    for node in nodes:
        weights, values = _Packer(costs).added(node)
        if weights + values > budget:
            raise ValueError(
                f"node {node.name!r} alone needs {(weights + values) / MB:.2f} MB (weights "
                f"{weights / MB:.2f} MB + values {values / MB:.2f} MB) but max_mem is {budget / MB:.2f} MB"
            )
        if packer.members and packer.total + sum(packer.added(node)) > budget:
            packer, pid = _Packer(costs), pid + 1
        packer.add(node)
        assignment[node.name] = pid
    return assignment


def balanced_assign(nodes: Nodes, costs: Costs, parts: int, budget: float = math.inf) -> dict[str, int]:
    """`parts` contiguous pieces, as even as possible: least sum of squared piece sizes (a DP).

    A piece's size counts its outputs, the weights it reads first and the hand-offs it receives,
    so among near-even cuts the one handing over the fewest bytes wins (a layer boundary, say).
    Pieces larger than `budget` are excluded.
    """
    if not 1 <= parts <= len(nodes):
        raise ValueError(f"cannot cut {len(nodes)} nodes into {parts} partitions")
    prefix, received = _prefix_and_received(nodes, costs)  # [N + 1], [N + 1], in MB
    n, limit = len(nodes), budget / MB
    best = np.full((parts + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    back = np.zeros((parts + 1, n + 1), dtype=np.int64)
    for k in range(1, parts + 1):
        for j in range(k, n - parts + k + 1):
            start = np.arange(k - 1, j)  # the piece is nodes[start:j]
            size = prefix[j] - prefix[start] + received[start]
            total = best[k - 1, start] + np.where(size > limit, np.inf, size**2)
            back[k, j], best[k, j] = start[np.argmin(total)], total.min()
    if not np.isfinite(best[parts, n]):
        raise ValueError(f"no {parts} partitions fit max_mem {limit:.2f} MB")
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(int(back[k, bounds[-1]]))
    bounds.reverse()  # [0, c1, ..., n]
    return {node.name: k for k in range(parts) for node in nodes[bounds[k] : bounds[k + 1]]}


def _prefix_and_received(nodes: Nodes, costs: Costs) -> tuple[Any, Any]:
    """Prefix sums of node sizes (weights at first use) and the bytes live across each cut."""
    position = {node.name: i for i, node in enumerate(nodes)}
    n, seen = len(nodes), set[str]()
    sizes, live = np.zeros(n), np.zeros(n + 2)
    for i, node in enumerate(nodes):
        weights = {a.name for a in node.all_input_nodes if a.op == "get_attr"} - seen
        seen |= weights
        sizes[i] = sum(costs[w].param_bytes for w in weights) + costs[node.name].param_bytes
        sizes[i] += costs[node.name].activation_bytes
    values = [v for v in nodes[0].graph.nodes if v.op == "placeholder" or v.name in position]
    for value in values:
        made = position.get(value.name, -1)
        last = max((position.get(u.name, n) for u in value.users), default=made)
        if last > made:  # crosses every cut i with made < i <= last
            live[made + 1] += costs[value.name].value_bytes
            live[last + 1] -= costs[value.name].value_bytes
    prefix = np.concatenate([[0.0], np.cumsum(sizes)]) / MB
    return prefix, np.cumsum(live)[: n + 1] / MB


def piece_sizes(nodes: Nodes, costs: Costs, assignment: Mapping[str, int]) -> list[int]:
    """Exact bytes of each piece of an assignment, as the greedy packer counts them."""
    packers: dict[int, _Packer] = {}
    for node in nodes:
        packers.setdefault(assignment[node.name], _Packer(costs)).add(node)
    return [packers[pid].total for pid in sorted(packers)]
