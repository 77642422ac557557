"""The one host<->device transport per device (`transport_for`), shared by offload and block swap. An accelerator has
a side stream per copy direction (one copy engine each: an input going out overlaps a weight coming in); the compute
stream waits on an event only where it reads what a copy wrote. The waits are written once (`StreamTransport`), over
the few stream and event calls a device offers (`DeviceStreams`): `torch.cuda`'s on CUDA, torch's generic
`torch.Stream`/`torch.Event`/`torch.accelerator` on any other accelerator. Test doubles live in `remat.testing`."""

from __future__ import annotations

import logging
import os
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .compat.accelerator import is_accelerator

logger = logging.getLogger("remat")


class Event(Protocol):
    def wait(self) -> None: ...  # the compute stream waits for the work this event marks
    def synchronize(self) -> None: ...  # the host blocks until that work is done


class DoneEvent:
    """The event of a copy that is already complete (synchronous copies)."""

    def wait(self) -> None: ...

    synchronize = wait


@dataclass(frozen=True)
class TensorMeta:
    """What a tensor sent to the host as bytes needs to be rebuilt on the device."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def from_bytes(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    return buffer[: meta.nbytes].view(meta.dtype).view(meta.shape)


class OffloadTransport(Protocol):
    """What the "offload" policy calls (`CheckpointedModel(offload_transport=...)`). Host buffers are uint8,
    pinned where that helps; copies only start, their events say when they are done. A transport may also have a
    `reason`: why the tensors it does not handle stay on their device (in the map; a warning too, unless the CPU's)."""

    def handles(self, tensor: torch.Tensor) -> bool: ...  # on this transport's device (only those are offloaded)
    def allocate_host(self, nbytes: int) -> torch.Tensor: ...
    def return_freed_host_memory(self) -> None: ...  # buffers it allocated that nobody references go back
    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event: ...  # device src -> host dst
    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]: ...


class WeightMover(Protocol):
    """What block swap calls (`CheckpointedModel(swap_mover=...)`)."""

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor: ...  # in host memory, pinned where that helps
    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Event: ...  # starts copying host src into device dst


class Transport(OffloadTransport, WeightMover, Protocol):
    """One device's host<->device transport: both features' calls, one set of streams."""


class DeviceStreams(Protocol):
    """Every device call a `StreamTransport` makes, so that its waits are written once for all devices. Streams
    returned have `wait_stream(stream)` and `wait_event(event)`; events `record(stream)` and `synchronize()`."""

    def new_stream(self, device: torch.device) -> Any: ...
    def current_stream(self, device: torch.device) -> Any: ...  # the compute stream
    def running_on(self, stream: Any) -> AbstractContextManager: ...  # work queued inside goes to `stream`
    def new_event(self, device: torch.device) -> Any: ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...  # memory kept until `stream` is done


class _TorchAllocator:
    """Both devices' caching allocators are told the same way that a side stream still uses a tensor."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class CudaStreams(_TorchAllocator):
    """CUDA's own stream API (`torch.cuda`): the path remat has always taken there."""

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def running_on(self, stream: Any) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self, device: torch.device) -> Any:
        return torch.cuda.Event()


class AcceleratorStreams(_TorchAllocator):
    """torch's device-generic API, for any accelerator torch knows (XPU, NPU, MPS, ...)."""

    def new_stream(self, device: torch.device) -> Any:
        stream = torch.Stream(device)
        # Freeing a tensor a side stream still reads is only safe where the allocator can be told (record_stream):
        # a device whose allocator cannot gets no transport rather than a race.
        torch.empty(1, device=device).record_stream(stream)
        return stream

    def current_stream(self, device: torch.device) -> Any:
        return torch.accelerator.current_stream(device)

    def running_on(self, stream: Any) -> AbstractContextManager:
        return stream  # a torch.Stream is the context that makes it current

    def new_event(self, device: torch.device) -> Any:
        return torch.Event(device)


@dataclass
class StreamEvent:
    """A copy's event on a side stream: the compute stream, or the host, waits for it."""

    event: Any
    streams: DeviceStreams
    device: torch.device

    def wait(self) -> None:
        self.streams.current_stream(self.device).wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()


class StreamTransport:
    """Host memory pinned where the device can, and one side stream per copy direction on one device; every wait
    that keeps the copies and the compute stream apart is here, and only here."""

    def __init__(self, device: torch.device, streams: DeviceStreams):
        self.device, self.streams = device, streams
        self.to_host_stream = streams.new_stream(device)
        self.to_device_stream = streams.new_stream(device)
        self._pins = True  # until pinning fails once
        self._said_cache_stays = False

    def __reduce__(self) -> Any:  # a copy gets streams of its own
        return (type(self), (self.device, self.streams))

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        # Where pinning fails this raises: offload's HostBuffers then takes pageable memory, counted and said once,
        # and never counts it against the pinned host budget.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A swapped weight's host copy: pinned, or pageable where the device cannot pin (said once)."""
        if self._pins:
            try:
                return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor.detach())
            except RuntimeError as err:
                self._pins = False
                logger.warning(
                    "swap: host memory cannot be pinned for %s (%s); using pageable host memory, so weight copies "
                    "will not overlap compute",
                    self.device,
                    err,
                )
        return tensor.detach().to("cpu", copy=True)

    def return_freed_host_memory(self) -> None:
        # Dropped pinned tensors only go back to torch's caching host allocator; emptying it frees
        # every unused cached pinned block of the process (blocks in use, anyone's, are untouched).
        empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()
        elif not self._said_cache_stays:  # pragma: no cover - older torch
            self._said_cache_stays = True
            logger.warning(
                "offload: torch %s cannot empty its pinned-memory cache; freed buffers stay pinned", torch.__version__
            )

    def _recorded(self, stream: Any) -> Event:
        event = self.streams.new_event(self.device)
        event.record(stream)
        return StreamEvent(event, self.streams, self.device)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        stream, streams = self.to_host_stream, self.streams
        stream.wait_stream(streams.current_stream(self.device))  # the input is fully written first
        with streams.running_on(stream):
            dst[: src.nbytes].copy_(as_bytes(src), non_blocking=dst.is_pinned())
            streams.record_stream(src, stream)  # its memory is not reused until the copy is done
        return self._recorded(stream)

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        stream, streams = self.to_device_stream, self.streams
        stream.wait_stream(self.to_host_stream)  # `src` was written by a copy to the host
        with streams.running_on(stream):
            out = torch.empty(meta.nbytes, dtype=torch.uint8, device=meta.device)
            out.copy_(src[: meta.nbytes], non_blocking=src.is_pinned())
        streams.record_stream(out, streams.current_stream(self.device))
        return from_bytes(out, meta), self._recorded(stream)

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        stream, streams = self.to_device_stream, self.streams
        stream.wait_stream(streams.current_stream(self.device))  # the slot's previous user is done with it
        with streams.running_on(stream):
            dst.copy_(src, non_blocking=True)
        return self._recorded(stream)


class CudaTransport(StreamTransport):
    """A CUDA device: `torch.cuda`'s streams and events (the fast path, and the one longest tested)."""

    def __init__(self, device: torch.device, streams: DeviceStreams | None = None):
        super().__init__(device, streams if streams is not None else CudaStreams())


class AcceleratorTransport(StreamTransport):
    """Any other accelerator torch knows (XPU, NPU, MPS, ...), through torch's device-generic streams and events."""

    def __init__(self, device: torch.device, streams: DeviceStreams | None = None):
        super().__init__(device, streams if streams is not None else AcceleratorStreams())


class CpuTransport:
    """The model runs on the CPU (or a device without separate host memory): copies are synchronous."""

    reason = "the model runs on the CPU: nothing to offload"

    def handles(self, tensor: torch.Tensor) -> bool:
        return False

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", copy=True)

    def return_freed_host_memory(self) -> None: ...

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        dst[: src.nbytes].copy_(as_bytes(src))
        return DoneEvent()

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        return from_bytes(src.clone(), meta), DoneEvent()

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        dst.copy_(src)
        return DoneEvent()


class NoTransport(CpuTransport):
    """A device remat has no streams for: offload leaves its inputs there and says `reason`; swapped weights wait in
    host memory and come back with synchronous copies."""

    def __init__(self, reason: str):
        self.reason = reason


_TRANSPORTS: dict[torch.device, Transport] = {}
_TRANSPORTS_LOCK = threading.Lock()


def transport_for(device: torch.device) -> Transport:
    """This process's transport for `device`, made on first use and shared by offload and swap."""
    with _TRANSPORTS_LOCK:
        if device not in _TRANSPORTS:
            _TRANSPORTS[device] = _new_transport(device)
        return _TRANSPORTS[device]


def _new_transport(device: torch.device) -> Transport:
    """CUDA's streams on CUDA, torch's generic ones on the machine's accelerator; where neither can be made, a
    transport that offloads nothing and says why (offload never does nothing silently)."""
    if device.type == "cpu":
        return CpuTransport()
    if device.type != "cuda" and not is_accelerator(device):
        return NoTransport(
            f"{device.type} is not torch's accelerator here, so remat has no streams for it: "
            "the input stays on the device"
        )
    try:
        return CudaTransport(device) if device.type == "cuda" else AcceleratorTransport(device)
    except Exception as err:  # any failure to make the streams leaves the device without a transport, said why
        return NoTransport(
            f"{device.type} has no host<->device transport in remat (its streams: {err}): the input stays on the device"
        )


def default_host_budget() -> int:
    """Half of the host's physical memory, split between this host's processes (`LOCAL_WORLD_SIZE`, set by
    torchrun and accelerate). Past it buffers are pageable, never an OOM kill."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // 2 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
