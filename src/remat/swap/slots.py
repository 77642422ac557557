"""The slot pool (device memory swapped weights occupy while their layer runs) and its schedule. Only `p.data` changes
(the `Parameter` objects stay): a ~0-byte placeholder at rest, in use a slot filled from the host copy (frozen: nothing
is copied back); `prefetch_depth + 1` slots per layout. An exception can abandon a step with slots held, so a layer
that does not continue the current pass (forward ascending, backward descending) starts a new one, freeing them all."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import BlockSwapError
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
    rest_versions: list[int] = field(default_factory=list)  # each Parameter's version counter when put to rest
    converting: int = 0  # `.to()` calls in progress on its modules (a parent's own weights blanked meanwhile)

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
        self.rest_versions = [p._version for p in self.params]

    def take_writes_at_rest(self) -> None:
        if self.slot is None and not self.converting:
            self._take_writes_at_rest()

    def _take_writes_at_rest(self) -> None:
        """Before a fetch of a layer at rest: what was done to its Parameters since, which the slot would overwrite.
        `p.data = p.data.to(dtype)` (PEFT's `prepare_model_for_kbit_training` casts so) cast the placeholder: the host
        copy is cast as `.to(dtype)` casts it. Any other write (new values in `.data`, `p.zero_()` under no_grad, a
        move) was lost silently, or failed in a matmul on dtypes: refused."""
        written = []
        for i, (param, rest, host) in enumerate(zip(self.params, self.placeholders, self.host, strict=True)):
            data = param.data
            if data.data_ptr() == host.data_ptr() and data.shape == host.shape and data.dtype == host.dtype:
                param.data = rest  # a load interrupted while pointed at the host copies
            elif _where(data) != _where(rest):
                if data.shape != rest.shape or data.device != rest.device or data.dtype == rest.dtype or data.any():
                    written.append(i)
                    continue
                self.host[i] = self.mover.host_copy(host.to(dtype=data.dtype))  # a cast of the placeholder's zeros
                self.placeholders[i] = placeholder(rest.shape, data.dtype, rest.device)
                param.data = self.placeholders[i]
            elif param._version != self.rest_versions[i]:
                written.append(i)
        if written:
            raise BlockSwapError(
                f"layer {self.index} ({self.name}): {len(written)} of its swapped weights were written while at rest "
                "(new values in .data, an in-place op, a move), where their Parameters hold placeholders for the "
                "host copies: the write would be lost. Write them with load_state_dict (it writes the host copies), "
                "cast or move with .to(), or make the change with remat disabled (cm.disable())"
            )
        self.rest_versions = [p._version for p in self.params]

    def keep_replaced(self) -> None:
        """A forward that replaced a weight's data in use (bitsandbytes repacks a 4-bit weight on some CPUs, and its
        quantization state says so from then on) made that the weight: it becomes the host copy (a slot fetched
        but not used yet, its weight at rest, is not that). Put back to rest instead, the next fetch brought the
        old data under the new state (0.57 off in the logits, for good)."""
        for i, (param, used, rest) in enumerate(zip(self.params, self.slot or (), self.placeholders, strict=False)):
            now = (param.data_ptr(), param.shape, param.dtype)
            if now != (used.data_ptr(), used.shape, used.dtype) and now != (rest.data_ptr(), rest.shape, rest.dtype):
                self.host[i] = self.mover.host_copy(param.data)
                self.placeholders[i] = placeholder(param.shape, param.dtype, param.device)

    def check_frozen(self) -> None:
        """A swapped weight made trainable since (its data a placeholder between uses): an optimizer's step on it
        failed in torch with nothing naming the swap."""
        if trained := sum(p.requires_grad for p in self.params):
            raise BlockSwapError(
                f"layer {self.index} ({self.name}): {trained} of its swapped weights were made trainable after it was "
                "swapped; a swapped weight rests in host memory and must stay frozen. Leave the layer out of "
                "swap_layers first (cm.enable(swap_layers=...)), then train that weight"
            )


def _where(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tensor.data_ptr(), tensor.shape, tensor.dtype, tensor.device


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
        return sum(per_layout.values()) * (self.prefetch_depth + 1)

    def fetch(self, layer: SwappedLayer, *, beyond_pool: bool = False) -> bool:
        """Start copying the layer's weights into a slot; False if every slot of its layout is held (`beyond_pool`
        makes one more: a step that failed halfway holds them)."""
        if layer.slot is not None:
            return True
        layer.take_writes_at_rest()
        layout = layer.layout
        free = self._free.setdefault(layout, [])
        if free:
            slot = free.pop()
        elif beyond_pool or self._count.get(layout, 0) <= self.prefetch_depth:
            self._count[layout] = self._count.get(layout, 0) + 1
            with torch.inference_mode(False):  # made in an inference_mode forward, a slot no training step could fill
                slot = [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in layer.placeholders]
        else:
            return False
        layer.ready = [layer.mover.fetch(dst, src) for dst, src in zip(slot, layer.host, strict=True)]
        layer.slot = slot
        layer.stats.fetches += 1
        layer.stats.bytes_fetched += layer.nbytes
        self.resident_bytes += layer.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        return True

    def release(self, layer: SwappedLayer) -> None:
        if layer.slot is None:
            return
        layout, nbytes = layer.layout, layer.nbytes  # the slot's (a replaced weight changes the layer's)
        layer.keep_replaced()
        layer.rest()
        self._free.setdefault(layout, []).append(layer.slot)  # a layout no layer has now goes at `release_all`
        layer.slot, layer.ready = None, None
        self.resident_bytes -= nbytes

    def keep_only(self, layers: Iterable[SwappedLayer]) -> None:
        """Forget the slots of every layout none of `layers` has (a layer gone, a replaced weight's old layout)."""
        for layout in (set(self._count) | set(self._free)) - {layer.layout for layer in layers}:
            self._free.pop(layout, None)
            self._count.pop(layout, None)


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
        self.pool.keep_only(self.layers.values())

    def after_forward(self, index: int) -> None:
        if index in self.layers:
            self.pool.release(self.layers[index])

    @contextlib.contextmanager
    def recomputing(self, index: int) -> Iterator[None]:
        """Backward recomputes layer `index`: fetch its weights; the layer's own hooks stand aside (a layer swapped no
        more since the forward needs nothing)."""
        if index not in self.layers:
            yield
            return
        self.start(index, forward=False)
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self.in_recompute = True
        try:
            yield
        finally:
            self.in_recompute = False

    def start(self, index: int, forward: bool) -> None:
        """Layer `index` runs (forward ascending, backward descending): the layers passed give their slots back, its
        own weights are fetched and the next ones start fetching."""
        phase, direction = self._phase, "forward" if forward else "backward"
        if phase is None or phase[0] != direction or not (index > phase[1] if forward else index < phase[1]):
            self.release_all()  # a new pass
            self._callback_queued = False  # a backward that failed never ran its end callback
        self._phase = (direction, index)
        if forward and torch.is_grad_enabled():
            self.layers[index].check_frozen()
        order = list(self.layers) if forward else list(reversed(self.layers))
        at = order.index(index)
        for passed in order[:at]:
            self.pool.release(self.layers[passed])
        self._use(index)
        self._prefetch(order[at + 1 :])

    def _end_of_backward(self) -> None:
        """Run by autograd at the end of a backward that recomputed a swapped layer, in that backward's grad mode:
        on with `create_graph=True` (a gradient penalty), whose new graph holds the fetched weights, which the
        release turns back into placeholders: its second backward would read them (wrong gradients, silently)."""
        self._callback_queued = False
        self._phase = None
        self.release_all()
        if torch.is_grad_enabled():
            raise BlockSwapError(
                "a backward with create_graph=True (a gradient penalty, a double backward) went through a swapped "
                "layer: its weights go back to host memory after the backward, so the graph it made would compute "
                "wrong gradients. Use a map without swap_layers for double backward"
            )

    def _use(self, index: int) -> None:
        layer = self.layers[index]
        if not self.pool.fetch(layer):
            # Every slot of this layout is held by a prefetch: the running layer comes first, the farthest gives way.
            holders = [e for e in self.layers.values() if e.slot is not None and e.layout == layer.layout]
            if holders:
                self.pool.release(max(holders, key=lambda e: abs(e.index - index)))
            self.pool.fetch(layer, beyond_pool=not holders)
        for event in layer.ready or ():
            event.wait()
        layer.point_at(layer.slot)

    def _prefetch(self, upcoming: list[int]) -> None:
        for index in upcoming[: self.pool.prefetch_depth]:
            try:
                if not self.pool.fetch(self.layers[index]):
                    break
            except BlockSwapError:  # written at rest: refused at its own turn, after its guards' own checks
                break
