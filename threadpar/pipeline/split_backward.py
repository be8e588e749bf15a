"""A chunk's backward split in two for zero-bubble schedules: I (the input gradient, sent upstream at once)
and, later, W (the weight gradients) from what I kept.

I runs the autograd engine from the chunk's output gradients towards its received inputs only (`inputs=`
the gradient anchor of the received activations), so only the nodes on a path to the inputs run, and each
of them computes only the gradients that path needs: e.g. a linear layer's AddmmBackward computes
dL/dx and skips the dL/dW matmul (the engine's per-task `should_compute_output`). On the way, I records
the gradient arriving at every *boundary* node: a node on the input path from which a path leads to a
parameter without touching the input path (for y = x @ W that is the matmul's node itself). W then starts
the engine again at the boundary nodes with those recorded gradients and asks for the parameters only, so
it runs what I skipped and nothing I already did (the same idea as torch.distributed.pipelining's
`stage_backward_input` / `stage_backward_weight`, rebuilt here on this executor's P2P Functions).

W computes the weight gradients with `torch.autograd.grad` (one call per group of parameters that share
boundary nodes: one call over all groups would also walk the input path between them, redoing I) and
then accumulates them with one `torch.autograd.backward` whose roots are the parameters themselves. That
last call goes through each parameter's AccumulateGrad node, so post-accumulate-grad hooks fire, once per
parameter and in one backward: a DistributedDataParallel reducer sees a normal backward (no_sync and its
once-per-step synchronization work as for a fused backward). A custom autograd.Function on the input path
that also holds a weight runs in both halves (its `needs_input_grad` is fixed at forward time).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from threadpar.pipeline.p2p import output_gradients

Captured = tuple[torch.Tensor | None, ...]  # the gradients a node received, one per output of its forward


def grad_node(tensor: torch.Tensor) -> Node | None:
    """The node a gradient of `tensor` flows into: its grad_fn, or a leaf's AccumulateGrad node."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    # A leaf's AccumulateGrad node exists while a graph refers to it; a view reaches it (as torch does).
    view_node: Any = tensor.view_as(tensor).grad_fn
    return view_node.next_functions[0][0]


@dataclass
class _Group:
    """Parameters whose gradients come from the same boundary nodes."""

    params: list[torch.Tensor]
    boundary: list[Node]
    captured: dict[Node, Captured] = field(default_factory=dict)


@dataclass
class PendingWeights:
    """What an I leaves for its W: the parameter groups with the gradients recorded at their boundaries,
    and the output gradients of roots that never reach the input (all of their backward is W's)."""

    groups: list[_Group]
    root_edges: list[GradientEdge]
    root_grads: list[torch.Tensor]
    root_params: list[torch.Tensor]


def _walk(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from `roots`, mapped to the nodes that feed it a gradient (its parents)."""
    parents: dict[Node, list[Node]] = {}
    queue = deque(roots)
    for node in queue:
        parents.setdefault(node, [])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _upstream(start: Node, parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes from which `start` is reachable (walking parents), not entering `stop`; and the `stop` nodes
    met at the border."""
    seen, met = {start}, set()
    queue = deque([start])
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


def backward_input(
    edges: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: torch.Tensor,
    params: Sequence[torch.Tensor],
) -> PendingWeights:
    """I: run backward from the output `edges` (with `grads`) to `inputs` only (the leaf whose gradient path
    the received activations are on), recording what W needs for `params`."""
    parents = _walk(edge.node for edge in edges)
    anchor = grad_node(inputs)
    input_path: set[Node] = set()
    if anchor in parents:
        input_path, _ = _upstream(anchor, parents, set())
        input_path.discard(anchor)
    # Group the parameters by the boundary nodes their gradient paths start from.
    groups: dict[frozenset[Node], _Group] = {}
    root_nodes = {edge.node for edge in edges if edge.node not in input_path}
    root_params: list[torch.Tensor] = []
    for p in params:
        node = grad_node(p) if p.requires_grad else None
        if node is None or node not in parents:
            continue  # not used by this microbatch
        region, boundary = _upstream(node, parents, input_path)
        if region & root_nodes:
            root_params.append(p)
        if boundary:
            groups.setdefault(frozenset(boundary), _Group([], list(boundary))).params.append(p)
    pending = PendingWeights(list(groups.values()), [], [], root_params)
    for edge, grad in zip(edges, grads):
        if edge.node not in input_path:  # no path to the input: W runs all of it
            pending.root_edges.append(edge)
            pending.root_grads.append(grad)
    if input_path:
        handles = []
        for group in pending.groups:
            for node in group.boundary:
                handles.append(node.register_prehook(_recorder(group.captured, node)))
        try:
            kept = [(e, g) for e, g in zip(edges, grads) if e.node in input_path]
            torch.autograd.backward(
                [e for e, _ in kept], [g for _, g in kept], inputs=[inputs], retain_graph=True
            )
        finally:
            for handle in handles:
                handle.remove()
    return pending


def _recorder(store: dict[Node, Captured], node: Node):
    def hook(grad_outputs: Captured) -> None:
        store[node] = tuple(grad_outputs)

    return hook


def _replacer(captured: Captured):
    def hook(_grad_outputs: Captured) -> Captured:
        return captured

    return hook


def backward_weight(pending: PendingWeights) -> None:
    """W: the weight gradients from what I recorded, accumulated into .grad in one backward (hooks fire)."""
    totals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (param, gradient)

    def add(params: Sequence[torch.Tensor], results: Sequence[torch.Tensor | None]) -> None:
        for p, g in zip(params, results):
            if g is not None:
                previous = totals.get(id(p))
                totals[id(p)] = (p, g if previous is None else previous[1] + g)

    for group in pending.groups:
        roots, root_grads = [], []
        for node in group.boundary:
            for i, g in enumerate(group.captured.get(node, ())):
                if g is not None:
                    roots.append(GradientEdge(node, i))
                    root_grads.append(g)
        if not roots:
            continue
        # Several boundary nodes of one group may lie on one path (a weight used twice): the recorded
        # gradient already holds what flows between them, so each takes exactly what I recorded.
        handles = (
            [n.register_prehook(_replacer(group.captured.get(n, ()))) for n in group.boundary]
            if len(group.boundary) > 1
            else []
        )
        try:
            grads = torch.autograd.grad(roots, group.params, root_grads, retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        add(group.params, grads)
    if pending.root_edges and pending.root_params:
        grads = torch.autograd.grad(
            pending.root_edges,
            pending.root_params,
            pending.root_grads,
            retain_graph=True,
            allow_unused=True,
        )
        add(pending.root_params, grads)
    if totals:
        params, grads = zip(*totals.values())
        torch.autograd.backward(list(params), list(grads))


def loss_gradient(loss: torch.Tensor) -> tuple[list[GradientEdge], list[torch.Tensor]]:
    """The last chunk's root: the (scaled) loss, with gradient 1."""
    if not loss.requires_grad:
        return [], []
    return [torch.autograd.graph.get_gradient_edge(loss)], [torch.ones_like(loss)]


def receive_output_gradients(
    token: torch.Tensor, anchor: torch.Tensor
) -> tuple[list[GradientEdge], list[torch.Tensor]]:
    """dL/d(output) from the next stage (p2p.output_gradients: the token's own node only), as the edges into
    the chunk's graph and their gradients, one per edge (summed where two outputs share one). A token that
    only drops an unwanted gradient (its edge leads to the `anchor`) leaves nothing to do."""
    anchor_node = grad_node(anchor)
    summed: dict[tuple[Node, int], torch.Tensor] = {}
    for node, nr, grad in output_gradients(token):
        if node is not anchor_node:
            summed[(node, nr)] = grad if (node, nr) not in summed else summed[(node, nr)] + grad
    return [GradientEdge(n, nr) for n, nr in summed], list(summed.values())
