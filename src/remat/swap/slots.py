"""The slot pool: device memory that swapped weights occupy while their layer runs.

A swapped layer's frozen parameters keep their identity (optimizers, PEFT and `state_dict` see
the same `Parameter` objects); only what `p.data` points at changes:

- at rest, `p.data` is a placeholder: one element expanded to the parameter's shape (shape,
  dtype and numel stay true, memory is ~0); the true values sit in a host copy made once;
- in use, `p.data` points at a slot: device tensors shaped like the layer's weights, filled
  from the host copy by the transport (`remat.transport`);
- given back, the slot returns to the pool for the next layer of the same layout. Frozen
  weights never change, so nothing is ever copied back.

Slots are shared by layout (the weights' shapes, dtypes and device): `prefetch_depth + 1` per
layout, so one layer runs while the next `prefetch_depth` are fetched, and resident swapped
weight bytes never exceed the pool. When the schedule must run a layer while every slot is held
(a step that failed halfway), `fetch(beyond_pool=True)` makes one more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..patches import InstancePatches
from ..transport import Event, WeightMover

Layout = tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]


@dataclass
class LayerSwapStats:
    fetches: int = 0
    bytes_fetched: int = 0


@dataclass
class SwappedLayer:
    """One swapped layer: its frozen parameters, their host copies and placeholders, and the slot
    its weights occupy now (None at rest)."""

    index: int
    name: str
    params: list[nn.Parameter]
    host: list[torch.Tensor]
    placeholders: list[torch.Tensor]
    mover: WeightMover
    slot: list[torch.Tensor] | None = None
    ready: list[Event] | None = None
    stats: LayerSwapStats = field(default_factory=LayerSwapStats)
    handles: list[Any] = field(default_factory=list)
    patches: InstancePatches = field(default_factory=InstancePatches)

    @property
    def layout(self) -> Layout:
        """What a slot must look like to hold this layer's weights (slots are shared by layout)."""
        return tuple((tuple(p.shape), p.dtype, p.device) for p in self.placeholders)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.placeholders)

    def point_at(self, tensors: list[torch.Tensor]) -> None:
        """Make the parameters show `tensors` (the slot, the host copies or the placeholders)."""
        for param, tensor in zip(self.params, tensors, strict=True):
            param.data = tensor

    def rest(self) -> None:
        self.point_at(self.placeholders)


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class SlotPool:
    """Device slots by layout, and the bytes of swapped weights resident in them."""

    def __init__(self, prefetch_depth: int):
        self.prefetch_depth = prefetch_depth
        self._free: dict[Layout, list[list[torch.Tensor]]] = {}
        self._count: dict[Layout, int] = {}
        self.resident_bytes = 0
        self.peak_resident_bytes = 0

    def size_bytes(self, layers: list[SwappedLayer]) -> int:
        """The most swapped-weight bytes that can be resident at once for these layers."""
        per_layout = {layer.layout: layer.nbytes for layer in layers}
        return sum(nbytes * (self.prefetch_depth + 1) for nbytes in per_layout.values())

    def fetch(self, layer: SwappedLayer, *, beyond_pool: bool = False) -> bool:
        """Start copying the layer's weights into a slot. False if every slot of its layout is
        held (and `beyond_pool` is not set): the caller tries again later."""
        if layer.slot is not None:
            return True
        slot = self._acquire(layer, beyond_pool)
        if slot is None:
            return False
        layer.ready = [layer.mover.fetch(dst, src) for dst, src in zip(slot, layer.host, strict=True)]
        layer.slot = slot
        layer.stats.fetches += 1
        layer.stats.bytes_fetched += layer.nbytes
        self.resident_bytes += layer.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        return True

    def _acquire(self, layer: SwappedLayer, beyond_pool: bool) -> list[torch.Tensor] | None:
        layout = layer.layout
        free = self._free.setdefault(layout, [])
        if free:
            return free.pop()
        if beyond_pool or self._count.get(layout, 0) <= self.prefetch_depth:
            self._count[layout] = self._count.get(layout, 0) + 1
            return [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in layer.placeholders]
        return None

    def release(self, layer: SwappedLayer) -> None:
        """The layer's weights go back to rest and its slot to the pool."""
        if layer.slot is None:
            return
        layer.rest()
        self._free.setdefault(layer.layout, []).append(layer.slot)
        layer.slot, layer.ready = None, None
        self.resident_bytes -= layer.nbytes

    def keep_only(self, layouts: set[Layout]) -> None:
        """Drop the slots of layouts no swapped layer has any more."""
        for layout in (set(self._count) | set(self._free)) - layouts:
            self._free.pop(layout, None)
            self._count.pop(layout, None)
