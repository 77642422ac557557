"""Test doubles for remat's device seams, as `torch.testing` is for torch: used by remat's tests
and by anyone testing code that uses remat on a machine without a GPU. remat itself never
imports this module.

`SimulatedTransport` plays a device/host pair on the CPU through the whole transport protocol
(`remat.transport.Transport`): copies are real, so results are exact; every copy is logged in
order; pinning can be made to fail; and the buffers it allocated can be counted while alive,
so a test can check that host memory really is given back.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .integrations.transformers_compat import has_activation_checkpointing_names
from .transport import DoneEvent, Event, TensorMeta, as_bytes, from_bytes


def trainer_checkpointing_args(enabled: bool = True, kwargs: dict | None = None) -> dict[str, Any]:
    """The `TrainingArguments` keywords that ask Trainer for checkpointing on this transformers
    version (`activation_checkpointing*` from 5.23, `gradient_checkpointing*` before), for tests
    that run on every supported release."""
    if has_activation_checkpointing_names():
        return {"activation_checkpointing": enabled, "activation_checkpointing_kwargs": kwargs}
    return {"gradient_checkpointing": enabled, "gradient_checkpointing_kwargs": kwargs}


class SimulatedTransport:
    """A device/host pair played on the CPU: `handles` every tensor, so the "offload" policy
    moves inputs through it as it would on an accelerator."""

    def __init__(self, *, pin_fails: bool = False):
        self.pin_fails = pin_fails
        # ("to_host" | "to_device", layer index) or ("fetch", None), in order
        self.log: list[tuple[str, int | None]] = []
        self.allocations = 0
        self.cache_emptied = 0
        self.live_when_emptied: list[int] = []  # allocated buffers still alive at each return_freed_host_memory
        self._allocated: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> buffer, dropped when it dies

    def handles(self, tensor: torch.Tensor) -> bool:
        return True

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        if self.pin_fails:
            raise RuntimeError("simulated: cannot pin host memory")
        self.allocations += 1
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        key = id(buffer)
        self._allocated[key] = weakref.ref(buffer, lambda _, key=key: self._allocated.pop(key, None))
        return buffer

    def live_buffers(self) -> int:
        """How many buffers `allocate_host` gave out that something still references."""
        return sum(ref() is not None for ref in list(self._allocated.values()))

    def return_freed_host_memory(self) -> None:
        self.cache_emptied += 1
        self.live_when_emptied.append(self.live_buffers())

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        dst[: src.nbytes].copy_(as_bytes(src))
        self.log.append(("to_host", layer))
        return DoneEvent()

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        self.log.append(("to_device", layer))
        return from_bytes(src.clone(), meta), DoneEvent()

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        dst.copy_(src)
        self.log.append(("fetch", None))
        return DoneEvent()
