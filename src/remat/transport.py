"""The one host<->device transport per device (`transport_for`), shared by offload and block swap. CUDA has a
side stream per copy direction (one copy engine each: an input going out overlaps a weight coming in); the compute
stream waits on an event only where it reads what a copy wrote. Test doubles live in `remat.testing`."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

logger = logging.getLogger("remat")


class Event(Protocol):
    def wait(self) -> None: ...  # the compute stream waits for the work this event marks
    def synchronize(self) -> None: ...  # the host blocks until that work is done


class DoneEvent:
    """The event of a copy that is already complete (synchronous copies)."""

    def wait(self) -> None: ...

    synchronize = wait


@dataclass
class CudaEvent:
    event: Any
    device: torch.device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()


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
    pinned where that helps; copies only start, their events say when they are done."""

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


class CudaTransport:
    """Pinned host memory and one side stream per copy direction on one CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.to_host_stream = torch.cuda.Stream(device)
        self.to_device_stream = torch.cuda.Stream(device)
        self._said_cache_stays = False

    def __reduce__(self) -> Any:  # a copy gets streams of its own
        return (type(self), (self.device,))

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.detach())
        return host

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
        event = torch.cuda.Event()
        event.record(stream)
        return CudaEvent(event, self.device)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        stream = self.to_host_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the input is fully written first
        with torch.cuda.stream(stream):
            dst[: src.nbytes].copy_(as_bytes(src), non_blocking=dst.is_pinned())
            src.record_stream(stream)  # its memory is not reused until the copy is done
        return self._recorded(stream)

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        stream = self.to_device_stream
        stream.wait_stream(self.to_host_stream)  # `src` was written by a copy to the host
        with torch.cuda.stream(stream):
            out = torch.empty(meta.nbytes, dtype=torch.uint8, device=meta.device)
            out.copy_(src[: meta.nbytes], non_blocking=src.is_pinned())
        out.record_stream(torch.cuda.current_stream(self.device))
        return from_bytes(out, meta), self._recorded(stream)

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        stream = self.to_device_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the slot's previous user is done with it
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        return self._recorded(stream)


class CpuTransport:
    """The model runs on the CPU (or a device without separate host memory): copies are synchronous."""

    def handles(self, tensor: torch.Tensor) -> bool:
        return False

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def return_freed_host_memory(self) -> None: ...

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        dst[: src.nbytes].copy_(as_bytes(src))
        return DoneEvent()

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        return from_bytes(src.clone(), meta), DoneEvent()

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        dst.copy_(src)
        return DoneEvent()


_TRANSPORTS: dict[torch.device, Transport] = {}
_TRANSPORTS_LOCK = threading.Lock()


def transport_for(device: torch.device) -> Transport:
    """This process's transport for `device`, made on first use and shared by offload and swap."""
    with _TRANSPORTS_LOCK:
        if device not in _TRANSPORTS:
            _TRANSPORTS[device] = CudaTransport(device) if device.type == "cuda" else CpuTransport()
        return _TRANSPORTS[device]


def default_host_budget() -> int:
    """Half of the host's physical memory, split between this host's processes (`LOCAL_WORLD_SIZE`, set by
    torchrun and accelerate). Past it buffers are pageable, never an OOM kill."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // 2 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
