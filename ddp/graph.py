"""Which parameters can receive a gradient from a forward's outputs (find_unused_parameters).

Walks the autograd graph from every tensor in the (possibly nested) output back to the
``AccumulateGrad`` leaves. A parameter not reached gets no gradient in this backward, so
the reducer marks it ready at once instead of waiting for it forever (the paper's rule).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


def output_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``: tensors, lists, tuples, dicts, dataclass-like objects."""
    stack = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and id(item) not in seen:
            seen.add(id(item))  # dataclasses / ModelOutput-like containers; guard cycles
            stack.extend(vars(item).values())


def reachable_leaves(outputs: Any) -> set[int]:
    """``id()`` of every leaf tensor that a backward from ``outputs`` would accumulate into."""
    found: set[int] = set()
    seen: dict[int, Any] = {}  # holds the node wrappers alive, so no id() is reused
    stack = [t.grad_fn for t in output_tensors(outputs) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    for t in output_tensors(outputs):  # a parameter returned as-is is its own leaf
        if t.grad_fn is None and t.requires_grad:
            found.add(id(t))
    return found
