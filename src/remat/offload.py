"""Host offload of checkpoint inputs: the "offload" policy.

What moves: torch's non-reentrant checkpoint saves a layer's positional inputs (the hidden
states) as saved tensors before it enters its own hooks, so a `saved_tensors_hooks` context
around the checkpoint call sees exactly those inputs and nothing from inside the layer: the
recompute's internals never move. Keyword inputs (masks, position embeddings) are shared by all
layers and stay where they are.

Rules, each for a reason:
- Only a layer's first positional input (the hidden states) moves. Other positional inputs
  (an attention mask passed positionally by a remote-code loop) are shared by every layer:
  copying them once per layer would cost more than it saves.
- Inputs smaller than `offload_min_bytes` stay on the device: the copy costs more than it saves.
- The input of the last checkpointed layer that forward runs stays on the device, because
  backward needs it first. Which layer that is is decided while forward runs, not from an index
  planned in advance: each input is held back until the next checkpointed layer packs its own,
  and only then copied out. The copy of layer i's input therefore overlaps layer i+1's compute,
  and whatever input is still held back when forward ends stays on the device. A map that
  changes between steps cannot leave a stale "last layer".
- Copies are exact byte copies: no dtype change.
- When a layer's input is brought back for its recompute, the input of the layer that backward
  reaches next is fetched ahead, so its copy overlaps this layer's recompute.
- Host buffers come from a pool, allocated once and reused every step; a buffer returns to the
  pool when the autograd graph that holds it is freed, which also covers an abandoned step (an
  exception in forward, or a forward without backward).
- On a model that runs on the CPU there is no device memory to free: inputs stay where they are
  and the counters say why.

The device/host pair is behind `Transport`: `CudaTransport` uses a side stream, events and
pinned memory; `SimulatedTransport` plays a device and a host on the CPU so the ordering, pool,
fallback and abandonment logic run in CI without a GPU.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

logger = logging.getLogger("remat")

KEPT_SMALL = "smaller than offload_min_bytes"
KEPT_LAST = "last checkpointed layer of forward (backward needs it first)"
KEPT_ON_CPU = "the model runs on the CPU: nothing to offload"
KEPT_SHARED = "not the layer's first input (masks and other inputs shared by layers stay)"


class Event(Protocol):
    def wait(self) -> None:
        """Make the compute stream wait for the work this event marks."""

    def synchronize(self) -> None:
        """Block the host until that work is done."""


class Transport(Protocol):
    """A device/host pair: where buffers come from and how bytes cross."""

    def handles(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on this transport's device (only those are offloaded)."""

    def allocate_host(self, nbytes: int) -> torch.Tensor: ...

    def return_freed_host_memory(self) -> None:
        """Give host buffers this transport allocated and nobody references back to the system."""

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        """Start copying `src` (on the device) into the host buffer `dst`."""

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        """Start copying the host buffer `src` back into a new device tensor shaped by `meta`."""


@dataclass(frozen=True)
class TensorMeta:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _from_bytes(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    return buffer[: meta.nbytes].view(meta.dtype).view(meta.shape)


class DoneEvent:
    def wait(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaTransport:
    """Copies on a side stream into pinned host memory; the compute stream waits on events only
    where it reads what a copy wrote."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._said_cache_stays = False

    def __reduce__(self) -> Any:  # a copy gets a stream of its own
        return (type(self), (self.device,))

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def return_freed_host_memory(self) -> None:
        # Pinned tensors come from torch's caching host allocator: dropping them only returns
        # the blocks to its cache. Emptying it frees every unused cached pinned block of the
        # process (blocks in use, ours or anyone's, are untouched).
        empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()
        elif not self._said_cache_stays:  # pragma: no cover - older torch
            self._said_cache_stays = True
            logger.warning(
                "offload: torch %s cannot empty its pinned-memory cache; freed buffers stay pinned "
                "until the process ends",
                torch.__version__,
            )

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the input must be fully written before it is read
        with torch.cuda.stream(self.stream):
            dst[: src.nbytes].copy_(_as_bytes(src), non_blocking=dst.is_pinned())
            src.record_stream(self.stream)  # its memory is not reused until the copy is done
            event = torch.cuda.Event()
            event.record(self.stream)
        return CudaEvent(event, self.device)

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        with torch.cuda.stream(self.stream):
            out = torch.empty(meta.nbytes, dtype=torch.uint8, device=meta.device)
            out.copy_(src[: meta.nbytes], non_blocking=src.is_pinned())
            event = torch.cuda.Event()
            event.record(self.stream)
        out.record_stream(torch.cuda.current_stream(self.device))
        return _from_bytes(out, meta), CudaEvent(event, self.device)


class CudaEvent:
    def __init__(self, event: Any, device: torch.device):
        self.event = event
        self.device = device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()


class SimulatedTransport:
    """A device/host pair played on the CPU, for tests: copies are real (and so exact), every
    operation is logged in order, and pinning can be made to fail."""

    def __init__(self, *, pin_fails: bool = False):
        self.pin_fails = pin_fails
        self.log: list[tuple[str, int]] = []  # ("to_host" | "to_device", layer index), in order
        self.allocations = 0
        self.cache_emptied = 0

    def handles(self, tensor: torch.Tensor) -> bool:
        return True

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        if self.pin_fails:
            raise RuntimeError("simulated: cannot pin host memory")
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def return_freed_host_memory(self) -> None:
        self.cache_emptied += 1

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        dst[: src.nbytes].copy_(_as_bytes(src))
        self.log.append(("to_host", layer))
        return DoneEvent()

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        self.log.append(("to_device", layer))
        return _from_bytes(src.clone(), meta), DoneEvent()


_BUCKET = 1 << 20


class HostPool:
    """Host buffers, allocated once and reused. Pinned when the transport can pin; if pinning
    fails or `max_bytes` would be exceeded, pageable buffers, with one warning.

    A request takes the smallest free buffer that holds it and is at most twice its size, and
    new buffers are rounded up to whole MiB, so sequence lengths that vary from batch to batch
    (dynamic padding) reuse buffers instead of pinning a new one per length.

    Buffers come back through `release`, which runs from `_Handle.__del__` when a graph is
    freed: that can be a GC pass in the middle of any method here, on this thread, or the
    autograd engine's thread. So `release` never takes the lock: it appends to a queue (atomic),
    and the methods that hold the lock move what the queue holds into the pool first.
    """

    def __init__(self, transport: Transport, max_bytes: int | None = None):
        self.transport = transport
        self.max_bytes = max_bytes
        self.free: list[tuple[torch.Tensor, Event | None]] = []
        self.pageable_fallbacks = 0
        self._warned = False
        self._lock = threading.Lock()
        self._returned: deque[tuple[torch.Tensor, Event | None]] = deque()
        self._sizes: dict[int, int] = {}  # storage pointer -> bytes, of every pinned buffer alive
        self._draining = False  # cleared and not used since: buffers coming back are freed

    def _take_returned(self) -> None:
        """Move returned buffers into the pool (the caller holds the lock)."""
        while self._returned:
            self.free.append(self._returned.popleft())

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._take_returned()
            self._draining = False
            fitting = [i for i, (b, _) in enumerate(self.free) if nbytes <= b.numel() <= 2 * max(nbytes, _BUCKET)]
            if fitting:
                best = min(fitting, key=lambda i: self.free[i][0].numel())
                buffer, last_use = self.free.pop(best)
                if last_use is not None:
                    last_use.synchronize()  # a copy may still read or write it
                return buffer
        size = -(-nbytes // _BUCKET) * _BUCKET
        if self.max_bytes is not None and self.allocated_bytes + size > self.max_bytes:
            return self._pageable(nbytes, f"the host budget of {self.max_bytes} bytes would be exceeded")
        try:
            buffer = self.transport.allocate_host(size)
        except RuntimeError as err:
            return self._pageable(nbytes, f"pinning host memory failed ({err})")
        self._sizes[buffer.untyped_storage().data_ptr()] = size
        return buffer

    def _pageable(self, nbytes: int, why: str) -> torch.Tensor:
        self.pageable_fallbacks += 1
        if not self._warned:
            self._warned = True
            logger.warning("offload: %s; using pageable host memory, so copies will not overlap compute", why)
        return torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buffer: torch.Tensor, last_use: Event | None) -> bool:
        """Put `buffer` back into the pool. If the pool was cleared since it was taken (a graph
        that outlived `clear()`), it is not pooled but forgotten; True then means the last
        pinned buffer is now free, and the caller, once it has dropped its reference, calls the
        transport's `return_freed_host_memory()` (once for all of them, not per buffer)."""
        self._returned.append((buffer, last_use))
        return self._forget_returned() if self._draining else False

    def _forget_returned(self) -> bool:
        """While draining: free what came back (whoever pops a buffer frees it: no lock needed).
        True if that left no pinned buffer alive."""
        freed = False
        while True:
            try:
                buffer, last_use = self._returned.popleft()
            except IndexError:
                break
            if last_use is not None:
                last_use.synchronize()
            freed |= self._sizes.pop(buffer.untyped_storage().data_ptr(), 0) > 0
            del buffer, last_use
        return freed and not self._sizes

    def clear(self) -> int:
        """Free every pooled buffer (after its last copy finished), and every buffer a pending
        backward still holds when it comes back, until the next acquire. Returns bytes freed."""
        with self._lock:
            self._take_returned()
            entries, self.free = self.free, []
            self._draining = True
        freed = 0
        while entries:
            buffer, last_use = entries.pop()
            if last_use is not None:
                last_use.synchronize()
            freed += self._sizes.pop(buffer.untyped_storage().data_ptr(), 0)
            del buffer, last_use  # the pool held the last reference
        if self._forget_returned() or freed:  # a buffer may have come back while this ran
            self.transport.return_freed_host_memory()
        return freed

    @property
    def allocated_bytes(self) -> int:
        """Pinned bytes alive: pooled or held by a graph (acquire runs on the forward thread
        only, so checking the budget against this needs no reservation)."""
        return sum(list(self._sizes.values()))

    @property
    def pooled_buffers(self) -> int:
        return len(self.pooled())

    def pooled(self) -> list[torch.Tensor]:
        """The buffers in the pool now (returned ones included)."""
        return [buffer for buffer, _ in list(self.free) + list(self._returned)]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a HostPool holds host buffers of one process and cannot be copied; copy its Offloader")


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


def default_host_budget() -> int:
    """Half of the host's physical memory, shared by the processes of this host.

    Several ranks on one machine each keep a pool of their own; `LOCAL_WORLD_SIZE` (set by
    torchrun and accelerate) says how many share the host, so each gets its share. Past the
    budget buffers are pageable (one warning), never an out-of-memory kill.
    """
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return total // 2 // local_ranks


def _signature(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


@dataclass(frozen=True)
class _Route:
    transport: Transport
    pool: HostPool


class _Packed:
    """One saved input: held on the device until forward moves past it, then on the host."""

    def __init__(self, offloader: Offloader, route: _Route, layer: int, tensor: torch.Tensor, order: int):
        self.offloader = offloader
        self.transport = route.transport
        self.pool = route.pool
        self.layer = layer
        self.order = order
        self.meta = TensorMeta(tensor.shape, tensor.dtype, tensor.device, tensor.nbytes)
        self.device_tensor: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.last_event: Event | None = None
        self.prefetched: tuple[torch.Tensor, Event] | None = None
        self.alive = True

    def move_to_host(self) -> None:
        tensor = self.device_tensor
        if tensor is None or self.host is not None:
            return
        self.host = self.pool.acquire(self.meta.nbytes)
        self.last_event = self.transport.to_host(tensor, self.host, self.layer)
        self.device_tensor = None  # the device memory is freed (after the copy, on CUDA)
        stats = self.offloader.stats[self.layer]
        stats.offloaded_bytes += self.meta.nbytes
        stats.copies_to_host += 1

    def prefetch(self) -> None:
        if self.host is not None and self.prefetched is None:
            self.prefetched = self.transport.to_device(self.host, self.meta, self.layer)
            self.last_event = self.prefetched[1]
            self.offloader.stats[self.layer].copies_to_device += 1

    def fetch(self) -> torch.Tensor:
        if self.device_tensor is not None:
            return self.device_tensor
        self.prefetch()
        assert self.prefetched is not None
        tensor, event = self.prefetched
        self.prefetched = None  # a second backward (retain_graph) fetches again
        event.wait()
        return tensor

    def release(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.device_tensor = None
        self.prefetched = None
        host, self.host = self.host, None
        if host is not None and self.pool.release(host, self.last_event):
            del host  # the last reference: the pool was cleared while this graph was alive
            self.transport.return_freed_host_memory()


class Offloader:
    """Packs and unpacks the saved inputs of checkpointed layers with the "offload" policy.

    One per CheckpointedModel; `hooks(layer)` is the saved_tensors_hooks context that wraps
    that layer's checkpoint call.
    """

    def __init__(self, min_bytes: int, transport: Transport | None = None, max_host_bytes: int | None = None):
        """`transport=None` picks one per device as inputs arrive: CUDA tensors get a
        `CudaTransport` (a side stream and a pinned pool of their own), CPU tensors stay put.
        `max_host_bytes=None` budgets pinned memory with `default_host_budget()`."""
        self.min_bytes = min_bytes
        self.max_host_bytes = default_host_budget() if max_host_bytes is None else max_host_bytes
        self._fixed = _Route(transport, HostPool(transport, self.max_host_bytes)) if transport is not None else None
        self._routes: dict[torch.device, _Route | None] = {}
        self.stats: dict[int, LayerOffloadStats] = defaultdict(LayerOffloadStats)
        self._held_back: weakref.ref[_Packed] | None = None
        self._live: weakref.WeakValueDictionary[int, _Packed] = weakref.WeakValueDictionary()
        self._order = 0

    def __reduce__(self) -> Any:
        """A copy (deepcopy, pickle) is a new offloader with the same settings and counters and no
        buffers: host buffers and in-flight inputs belong to this process and this graph."""
        transport = self._fixed.transport if self._fixed is not None else None
        return (_rebuilt_offloader, (self.min_bytes, transport, self.max_host_bytes, dict(self.stats)))

    def _route(self, tensor: torch.Tensor) -> _Route | None:
        if self._fixed is not None:
            return self._fixed if self._fixed.transport.handles(tensor) else None
        if tensor.device not in self._routes:
            route = None
            if tensor.device.type == "cuda":
                transport = CudaTransport(tensor.device)
                route = _Route(transport, HostPool(transport, self.max_host_bytes))
            self._routes[tensor.device] = route
        return self._routes[tensor.device]

    @property
    def pools(self) -> list[HostPool]:
        routes = [self._fixed] if self._fixed is not None else list(self._routes.values())
        return [route.pool for route in routes if route is not None]

    def release_host_memory(self) -> None:
        """Free the pooled host buffers: called when no layer offloads any more, so pinned
        memory is not held by a model that will not use it (the pool refills on demand)."""
        freed = sum(pool.clear() for pool in self.pools)
        if freed:
            logger.info("offload: released %.1f MiB of pinned host memory", freed / 2**20)

    # -- the hooks ------------------------------------------------------------------------------

    def hooks(self, layer: int, target: torch.Tensor | None) -> torch.autograd.graph.saved_tensors_hooks:
        """The context around one checkpoint call. Only `target` (the layer's hidden states, its
        first tensor input by transformers' convention) is offloaded; it is recognised by its
        storage, shape and dtype, not by the order in which a torch version saves inputs (some
        save a 0-byte marker first)."""
        # Only the target's signature is kept: autograd stores the pack hook with every saved
        # tensor, so a closure over the tensor itself would keep it on the device.
        signature = _signature(target) if target is not None else None
        return torch.autograd.graph.saved_tensors_hooks(
            lambda tensor: self._pack(layer, tensor, signature), self._unpack
        )

    def checkpoint_started(self) -> None:
        """A checkpointed layer (of any policy) starts its forward: the input held back so far
        is not the last one backward needs first, so it can go to the host now."""
        self._move_held_back_to_host()

    def _pack(self, layer: int, tensor: torch.Tensor, target: tuple | None) -> Any:
        stats = self.stats[layer]
        if target is None or _signature(tensor) != target:
            if tensor.nbytes:
                stats.keep(tensor.nbytes, KEPT_SHARED)
            return tensor
        route = self._route(tensor)
        if route is None:
            stats.keep(tensor.nbytes, KEPT_ON_CPU)
            return tensor
        if tensor.nbytes < self.min_bytes:
            stats.keep(tensor.nbytes, KEPT_SMALL)
            return tensor
        self._move_held_back_to_host()  # a layer without a shim call first (hooks used directly)
        self._order += 1
        packed = _Packed(self, route, layer, tensor, self._order)
        self._live[packed.order] = packed
        self._held_back = weakref.ref(packed)
        return _Handle(packed)

    def _unpack(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        packed = handle.packed
        if packed.device_tensor is not None and packed is self._current_held_back():
            # Backward has started: the held-back input is the first one it needs.
            self.stats[packed.layer].keep(packed.meta.nbytes, KEPT_LAST)
            self._held_back = None
        tensor = packed.fetch()
        self._prefetch_before(packed.order)
        return tensor

    # -- ordering -------------------------------------------------------------------------------

    def _current_held_back(self) -> _Packed | None:
        return self._held_back() if self._held_back is not None else None

    def _move_held_back_to_host(self) -> None:
        previous = self._current_held_back()
        self._held_back = None
        if previous is not None and previous.alive:
            previous.move_to_host()

    def _prefetch_before(self, order: int) -> None:
        """Start fetching the input backward needs next: the one packed just before `order`."""
        earlier = [o for o in self._live if o < order]
        if earlier:
            candidate = self._live.get(max(earlier))
            if candidate is not None and candidate.alive:
                candidate.prefetch()

    # -- reporting ------------------------------------------------------------------------------

    def live_host_bytes(self) -> dict[int, int]:
        """Bytes each layer holds in host memory right now."""
        out: dict[int, int] = defaultdict(int)
        for packed in list(self._live.values()):
            if packed.alive and packed.host is not None:
                out[packed.layer] += packed.meta.nbytes
        return dict(out)

    def host_storages(self) -> set[int]:
        """Data pointers of every host buffer this offloader owns (pooled or in use)."""
        out = {buffer.untyped_storage().data_ptr() for pool in self.pools for buffer in pool.pooled()}
        for packed in list(self._live.values()):
            if packed.host is not None:
                out.add(packed.host.untyped_storage().data_ptr())
        return out

    def reset_stats(self) -> None:
        self.stats.clear()


def _rebuilt_offloader(
    min_bytes: int, transport: Transport | None, max_host_bytes: int, stats: dict[int, LayerOffloadStats]
) -> Offloader:
    offloader = Offloader(min_bytes, transport, max_host_bytes)
    offloader.stats.update(stats)
    return offloader


class _Handle:
    """What the autograd graph stores for an offloaded input. When the graph is freed (after
    backward, or when a step is abandoned) the handle goes, and its host buffer returns to the
    pool."""

    __slots__ = ("__weakref__", "packed")

    def __init__(self, packed: _Packed):
        self.packed = packed

    def __del__(self) -> None:
        self.packed.release()
