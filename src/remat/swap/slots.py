"""The slot pool: device memory that swapped weights occupy while their layer runs.

Only what `p.data` points at changes (optimizers, PEFT and `state_dict` keep the same
`Parameter` objects): at rest a placeholder (one element expanded to the full shape, ~0
bytes), in use a slot filled from the host copy. Frozen weights never change, so nothing is
copied back. Slots are shared by layout, `prefetch_depth + 1` per layout, so one layer runs
while the next `prefetch_depth` are fetched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..refs import InstancePatches
from ..transport import Event, WeightMover

Layout = tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]


@dataclass
class LayerSwapStats:
    fetches: int = 0
    bytes_fetched: int = 0


@dataclass
class SwappedLayer:
    index: int
    name: str
    params: list[nn.Parameter]
    host: list[torch.Tensor]
    placeholders: list[torch.Tensor]
    mover: WeightMover
    slot: list[torch.Tensor] | None = None  # None at rest
    ready: list[Event] | None = None
    stats: LayerSwapStats = field(default_factory=LayerSwapStats)
    handles: list[Any] = field(default_factory=list)
    patches: InstancePatches = field(default_factory=InstancePatches)

    @property
    def layout(self) -> Layout:
        return tuple((tuple(p.shape), p.dtype, p.device) for p in self.placeholders)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.placeholders)

    def point_at(self, tensors: list[torch.Tensor]) -> None:
        for param, tensor in zip(self.params, tensors, strict=True):
            param.data = tensor

    def rest(self) -> None:
        self.point_at(self.placeholders)


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class SlotPool:
    def __init__(self, prefetch_depth: int):
        self.prefetch_depth = prefetch_depth
        self._free: dict[Layout, list[list[torch.Tensor]]] = {}
        self._count: dict[Layout, int] = {}
        self.resident_bytes = 0
        self.peak_resident_bytes = 0

    def size_bytes(self, layers: list[SwappedLayer]) -> int:
        """The most swapped-weight bytes that can be resident at once."""
        per_layout = {layer.layout: layer.nbytes for layer in layers}
        return sum(nbytes * (self.prefetch_depth + 1) for nbytes in per_layout.values())

    def fetch(self, layer: SwappedLayer, *, beyond_pool: bool = False) -> bool:
        """Start copying the layer's weights into a slot; False if every slot of its layout is
        held (`beyond_pool` makes one more: a step that failed halfway holds them)."""
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
        if layer.slot is None:
            return
        layer.rest()
        self._free.setdefault(layer.layout, []).append(layer.slot)
        layer.slot, layer.ready = None, None
        self.resident_bytes -= layer.nbytes

    def keep_only(self, layouts: set[Layout]) -> None:
        for layout in (set(self._count) | set(self._free)) - layouts:
            self._free.pop(layout, None)
            self._count.pop(layout, None)
