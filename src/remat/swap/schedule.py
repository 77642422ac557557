"""The schedule: when each swapped layer's weights are fetched and given back over a step.

Forward runs the layers ascending, backward recomputes them descending. Before a layer runs its
weights are fetched (waited for only then) and the next `prefetch_depth` start fetching; layers
passed give their slots back. Nothing relies on a step finishing (an exception abandons it with
slots held): a layer that does not continue the current pass starts a new one and gives back every
slot, and a layer finding every slot of its layout held by prefetches takes the farthest one's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .slots import SlotPool, SwappedLayer


class Schedule:
    def __init__(self, layers: dict[int, SwappedLayer], pool: SlotPool):
        self.layers = layers  # the swapper's own dict, read at every call: the set may change mid-step
        self.pool = pool
        self.in_recompute = False  # the layers' own forward hooks stand aside
        self._phase: tuple[str, int] | None = None  # ("forward" | "backward", last layer index)
        self._callback_queued = False

    def reset(self) -> None:
        self._phase = None

    def release_all(self) -> None:
        for layer in self.layers.values():
            self.pool.release(layer)

    def before_forward(self, index: int) -> None:
        self._start(index, forward=True)

    def after_forward(self, index: int) -> None:
        if index in self.layers:
            self.pool.release(self.layers[index])

    @contextlib.contextmanager
    def recomputing(self, index: int) -> Iterator[None]:
        """Backward recomputes layer `index`: fetch its weights; the layer's own hooks stand aside
        (a layer swapped no more since the forward needs nothing)."""
        if index not in self.layers:
            yield
            return
        self._start(index, forward=False)
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self.in_recompute = True
        try:
            yield
        finally:
            self.in_recompute = False

    def _start(self, index: int, forward: bool) -> None:
        """Layer `index` runs (forward ascending, backward descending): the layers passed give their
        slots back, its own weights are fetched and the next ones start fetching."""
        phase, direction = self._phase, "forward" if forward else "backward"
        if phase is None or phase[0] != direction or not (index > phase[1] if forward else index < phase[1]):
            self.release_all()  # a new pass
            self._callback_queued = False  # a backward that failed never ran its end callback
        self._phase = (direction, index)
        order = list(self.layers) if forward else list(reversed(self.layers))
        at = order.index(index)
        for passed in order[:at]:
            self.pool.release(self.layers[passed])
        self._use(index)
        self._prefetch(order[at + 1 :])

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._phase = None
        self.release_all()

    def _use(self, index: int) -> None:
        layer = self.layers[index]
        if not self.pool.fetch(layer):
            # Every slot of this layout is held by a prefetch for later: the running layer comes
            # first, so the prefetch farthest away gives its slot up (it is fetched again later).
            holders = [e for e in self.layers.values() if e.slot is not None and e.layout == layer.layout]
            if holders:
                self.pool.release(max(holders, key=lambda e: abs(e.index - index)))
            self.pool.fetch(layer, beyond_pool=not holders)
        for event in layer.ready or ():
            event.wait()
        layer.point_at(layer.slot)

    def _prefetch(self, upcoming: list[int]) -> None:
        for index in upcoming[: self.pool.prefetch_depth]:
            if not self.pool.fetch(self.layers[index]):
                break
