"""Whether a backward is still owed for a forward that ran with gradients.

Between a forward and its backward, autograd holds on to the model's weights: the saved
tensors of layers that were not checkpointed, and the weights checkpointed layers recompute
from. Moving a layer's weights out to host memory in that window (block swap taking a new
layer) would silently change the gradients of that backward, so `CheckpointedModel` asks this
tracker first and refuses while anything is pending.

A forward of the wrapped model opens one entry, tied to its output's autograd node: the entry
closes when the backward through that output finishes, or when the output is freed without a
backward (an abandoned step). An entry holds no tensor, only a count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_KEY = "remat.pending_backward"


class PendingBackward:
    def __init__(self) -> None:
        self.open = 0

    @property
    def pending(self) -> bool:
        return self.open > 0

    def track(self, output: Any) -> None:
        """Called after a forward with gradients enabled: tie an entry to the output's graph."""
        node = _first_node(output)
        if node is None:
            return
        entry = _Entry(self)
        node.metadata[_KEY] = entry  # lives exactly as long as the graph node
        node.register_prehook(entry.backward_started)

    # A copy of the wrapper starts with no graph of its own.
    def __getstate__(self) -> dict[str, Any]:
        return {"open": 0}


class _Entry:
    __slots__ = ("closed", "tracker")

    def __init__(self, tracker: PendingBackward):
        self.tracker = tracker
        self.closed = False
        tracker.open += 1

    def backward_started(self, grad_outputs: Any) -> None:
        # Runs inside the backward: close once the whole backward is done.
        torch.autograd.Variable._execution_engine.queue_callback(self.close)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.tracker.open -= 1

    def __del__(self) -> None:
        self.close()


def _first_node(output: Any) -> Any:
    """The autograd node of the loss if the output has one, else of its first tensor with one."""
    if isinstance(output, torch.Tensor):
        return output.grad_fn
    if isinstance(output, Mapping):
        values = [output["loss"], *output.values()] if output.get("loss") is not None else list(output.values())
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        return None
    for value in values:
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            return value.grad_fn
    return None
