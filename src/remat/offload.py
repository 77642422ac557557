"""The "offload" policy: which checkpoint input moves to the host when (bytes cross in `remat.transport`). torch saves
a checkpointed layer's positional inputs before entering its hooks, so a `saved_tensors_hooks` context around the call
sees exactly those. Backward needs the last checkpointed layer's input first, so each input is held back until the
next checkpointed layer starts, then copied out while it computes. Host buffers go with the graph that holds them."""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .transport import CpuTransport, Event, OffloadTransport, TensorMeta, default_host_budget, transport_for
from .transport import Transport as Transport  # where model.py has always imported it from

logger = logging.getLogger("remat")

KEPT_SMALL = "smaller than offload_min_bytes"
KEPT_LAST = "last checkpointed layer of forward (backward needs it first)"
KEPT_ON_CPU = CpuTransport.reason
KEPT_SHARED = "not the layer's first input (masks and other inputs shared by layers stay)"

_nothing_held: Callable[[], None] = lambda: None  # stands for a dead weak reference: no input is held back


@dataclass
class LayerOffloadStats:
    """What offload did for one layer, summed since the counters were last reset."""

    offloaded_bytes: int = 0
    kept_bytes: int = 0
    kept_because: dict[str, int] = field(default_factory=dict)
    copies_to_host: int = 0
    copies_to_device: int = 0

    def keep(self, nbytes: int, why: str) -> None:
        self.kept_bytes += nbytes
        self.kept_because[why] = self.kept_because.get(why, 0) + nbytes


def _signature(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


# The host buffers of every wrapper offloading under the default host budget (held weakly)
_SHARING_THE_DEFAULT: weakref.WeakSet[HostBuffers] = weakref.WeakSet()


class HostBuffers:
    """One device's transport and the pinned bytes offloaded inputs hold there, against the host budget. Past it, or
    where pinning fails, a buffer is pageable (one warning): copies do not overlap compute, but host memory is never
    exhausted. A GC pass (any thread, mid-method) gives buffers back, so `give_back` only pops (atomic): no lock."""

    def __init__(self, transport: OffloadTransport, max_bytes: int, *, shared: bool = False):
        self.transport = transport
        self.max_bytes = max_bytes
        if shared:  # the default budget is the process's: every wrapper's pinned bytes count against it
            _SHARING_THE_DEFAULT.add(self)
        self.pageable_fallbacks = 0
        self._pinned: dict[int, int] = {}  # storage pointer -> bytes, of every pinned buffer a graph holds
        self._returning = False  # nothing offloads: give the host memory back once the last buffer is freed
        self._cached = False  # pinned buffers went into the transport's cache since it was last emptied

    @property
    def pinned_bytes(self) -> int:
        return sum(list(self._pinned.values()))

    def take(self, nbytes: int) -> torch.Tensor:
        self._returning = False
        sharing = [self] if self not in _SHARING_THE_DEFAULT else list(_SHARING_THE_DEFAULT)
        if sum(buffers.pinned_bytes for buffers in sharing) + nbytes > self.max_bytes:
            return self._pageable(nbytes, f"the host budget of {self.max_bytes} bytes would be exceeded")
        try:
            buffer = self.transport.allocate_host(nbytes)
        except RuntimeError as err:
            return self._pageable(nbytes, f"pinning host memory failed ({err})")
        self._pinned[buffer.untyped_storage().data_ptr()] = nbytes
        self._cached = True
        return buffer

    def _pageable(self, nbytes: int, why: str) -> torch.Tensor:
        self.pageable_fallbacks += 1
        if self.pageable_fallbacks == 1:
            logger.warning("offload: %s; using pageable host memory, so copies will not overlap compute", why)
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_back(self, buffer: torch.Tensor) -> bool:
        """True: the last pinned buffer after `release()`; the caller drops it, then returns host memory."""
        counted = self._pinned.pop(buffer.untyped_storage().data_ptr(), None) is not None
        last = counted and self._returning and not self._pinned
        self._cached &= not last
        return last

    def release(self) -> None:
        """Nothing offloads any more: host memory goes back now, or when a graph frees the last buffer."""
        self._returning = True
        if self._cached and not self._pinned:
            self._cached = False
            self.transport.return_freed_host_memory()
            logger.info("offload: gave its pinned host memory back (no layer offloads now)")


class _Packed:
    """One offloaded input, as the autograd graph stores it: on the device until forward moves past it,
    then on the host. It goes with the graph (after backward, or an abandoned step), its buffer too."""

    def __init__(self, offloader: Offloader, buffers: HostBuffers, layer: int, tensor: torch.Tensor, order: int):
        self.stats, self.buffers, self.transport = offloader.stats, buffers, buffers.transport
        self.layer, self.order = layer, order
        self.generation = offloader.generation  # the forward of the wrapped model it was packed in
        self.meta = TensorMeta(tensor.shape, tensor.dtype, tensor.device, tensor.nbytes)
        self.device_tensor: torch.Tensor | None = tensor
        self.version, self.version_moved = tensor._version, tensor._version  # torch's check of a saved tensor
        self.host: torch.Tensor | None = None
        self.prefetched: tuple[torch.Tensor, Event] | None = None
        self.alive = True

    def move_to_host(self) -> None:
        if self.device_tensor is None or self.host is not None:
            return
        self.version_moved = self.device_tensor._version
        self.host = self.buffers.take(self.meta.nbytes)
        self.transport.to_host(self.device_tensor, self.host, self.layer)
        self.device_tensor = None  # the device memory is freed (after the copy, on CUDA)
        self.stats[self.layer].offloaded_bytes += self.meta.nbytes
        self.stats[self.layer].copies_to_host += 1

    def prefetch(self) -> None:
        if self.host is not None and self.prefetched is None:
            self.prefetched = self.transport.to_device(self.host, self.meta, self.layer)
            self.stats[self.layer].copies_to_device += 1

    def fetch(self) -> torch.Tensor:
        now = self.device_tensor._version if self.device_tensor is not None else self.version_moved
        if now != self.version:  # as torch raises for a saved tensor it holds (the host copy would hide the change)
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"the input of layer {self.layer} that offload saved is at version {now}; expected version "
                f"{self.version} instead (the layer, or code after it, changed its input in place: clone it first)"
            )
        if self.device_tensor is not None:
            return self.device_tensor
        self.prefetch()
        assert self.prefetched is not None
        (tensor, event), self.prefetched = self.prefetched, None  # a second backward (retain_graph) fetches again
        event.wait()
        return tensor

    def __del__(self) -> None:
        self.alive, self.device_tensor, self.prefetched = False, None, None
        host, self.host = self.host, None
        if host is not None and self.buffers.give_back(host):
            del host  # the last reference: nothing offloads since this graph was made
            self.transport.return_freed_host_memory()


class Offloader:
    """Packs and unpacks the saved inputs of "offload" layers, one per CheckpointedModel; `transport=None`
    takes each device's shared transport, `max_host_bytes=None` the `default_host_budget()`."""

    def __init__(self, min_bytes: int, transport: OffloadTransport | None = None, max_host_bytes: int | None = None):
        self.min_bytes = min_bytes
        self.max_host_bytes = default_host_budget() if max_host_bytes is None else max_host_bytes
        self._shared = max_host_bytes is None
        self._fixed = HostBuffers(transport, self.max_host_bytes, shared=self._shared) if transport else None
        self._routes: dict[torch.device, HostBuffers | None] = {}
        self._stays_because: dict[torch.device, str] = {}
        self.stats: dict[int, LayerOffloadStats] = defaultdict(LayerOffloadStats)
        self._held_back: Callable[[], _Packed | None] = _nothing_held
        # whether an input may be held back: a flag a compiled layer's shim reads (a traced check of the weak
        # reference would recompile at every step), so `checkpoint_started` runs only where it has work
        self.holding = False
        self._live: weakref.WeakValueDictionary[int, _Packed] = weakref.WeakValueDictionary()
        self._order = 0
        # each forward of the wrapped model is a generation; a backward prefetches within its own only: an earlier
        # graph still alive (retained, kept without a backward, or in a reference cycle not yet collected) had its
        # input copied back and held. Two forwards summed into one loss lose the prefetch across them, not a copy.
        self.generation = 0

    def __reduce__(self) -> Any:
        """A copy (deepcopy, pickle) keeps settings and counters, not buffers (this process's, this graph's)."""
        transport = self._fixed.transport if self._fixed is not None else None
        stats = defaultdict(LayerOffloadStats, self.stats)
        budget = None if self._shared else self.max_host_bytes
        return (type(self), (self.min_bytes, transport, budget), {"stats": stats})

    def _route(self, tensor: torch.Tensor) -> HostBuffers | None:
        if self._fixed is not None:
            return self._fixed if self._fixed.transport.handles(tensor) else None
        if tensor.device not in self._routes:
            transport = transport_for(tensor.device)
            handled = transport.handles(tensor)
            route = HostBuffers(transport, self.max_host_bytes, shared=self._shared) if handled else None
            self._routes[tensor.device] = route
        return self._routes[tensor.device]

    def _why_it_stays(self, device: torch.device) -> str:
        """Why inputs on `device` are not offloaded: its transport's `reason`. Unless that is the CPU's (nothing to
        free there), offload was asked to free device memory and cannot: a warning says so too, once per device."""
        if device not in self._stays_because:
            transport = self._fixed.transport if self._fixed is not None else transport_for(device)
            why = getattr(transport, "reason", None) or f"{type(transport).__name__} does not move {device} tensors"
            if why != KEPT_ON_CPU:
                logger.warning("offload: %s", why)
            self._stays_because[device] = why
        return self._stays_because[device]

    @property
    def host_buffers(self) -> list[HostBuffers]:
        routes = [self._fixed] if self._fixed is not None else list(self._routes.values())
        return [route for route in routes if route is not None]

    def release_host_memory(self) -> None:
        """No layer offloads any more: torch's cache would keep the pinned memory otherwise."""
        for buffers in self.host_buffers:
            buffers.release()

    def hooks(self, layer: int, target: torch.Tensor | None) -> torch.autograd.graph.saved_tensors_hooks:
        """The context around one checkpoint call. Only `target` (the hidden states) is offloaded, recognised by
        storage, shape and dtype (some torch versions save a 0-byte marker first); only its signature is kept, as a
        closure over the tensor (stored with every saved tensor) would pin it."""
        signature = _signature(target) if target is not None else None
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(layer, t, signature), self._unpack)

    @torch.compiler.disable  # read by dynamo, the count was a guard: a compiled model recompiled at every forward
    def forward_started(self) -> None:
        """The wrapped model's forward begins: what it packs is prefetched only within its own backward."""
        self.generation += 1

    @torch.compiler.disable  # a copy to the host, eagerly: traced with dynamic shapes, `nbytes` failed on a SymInt
    def checkpoint_started(self) -> None:
        """A checkpointed layer starts: the input held back so far is not backward's first, so it goes out."""
        previous, self._held_back, self.holding = self._held_back(), _nothing_held, False
        if previous is not None and previous.alive:
            previous.move_to_host()

    def _pack(self, layer: int, tensor: torch.Tensor, target: tuple | None) -> Any:
        stats = self.stats[layer]
        if target is None or _signature(tensor) != target:
            if tensor.nbytes:
                stats.keep(tensor.nbytes, KEPT_SHARED)
            return tensor
        route = self._route(tensor)
        if route is None or tensor.nbytes < self.min_bytes:
            stats.keep(tensor.nbytes, self._why_it_stays(tensor.device) if route is None else KEPT_SMALL)
            return tensor
        self.checkpoint_started()  # a layer without a shim call first (hooks used directly)
        self._order += 1
        packed = _Packed(self, route, layer, tensor, self._order)
        self._live[packed.order] = packed
        self._held_back, self.holding = weakref.ref(packed), True
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.device_tensor is not None and packed is self._held_back():  # backward's first input
            self.stats[packed.layer].keep(packed.meta.nbytes, KEPT_LAST)
            self._held_back, self.holding = _nothing_held, False
        tensor = packed.fetch()
        candidate = self._live.get(max((o for o in self._live if o < packed.order), default=0))  # orders start at 1
        if candidate is not None and candidate.alive and candidate.generation == packed.generation:
            candidate.prefetch()  # backward needs the input packed just before this one next
        return tensor

    def live_host_bytes(self) -> dict[int, int]:
        """Bytes each layer holds in host memory right now."""
        out: dict[int, int] = defaultdict(int)
        for packed in list(self._live.values()):
            if packed.alive and packed.host is not None:
                out[packed.layer] += packed.meta.nbytes
        return dict(out)

    def host_storages(self) -> set[int]:
        """Data pointers of every host buffer a graph holds now."""
        return {p.host.untyped_storage().data_ptr() for p in list(self._live.values()) if p.host is not None}

    def reset_stats(self) -> None:
        self.stats.clear()
