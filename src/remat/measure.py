"""Measure what backward holds: the bytes of activations alive after forward.

On CPU there is no allocator to ask: op outputs alive after forward (weakly referenced) are what
autograd keeps for backward. Not seen: tensors made outside the dispatcher, the CPU RNG state a
checkpoint keeps for dropout (5 KB per layer) and Python scalars autograd saves as 0-dim tensors
(the suite's allocator count, tests/independent_memory.py, finds exactly these).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class LiveStorages(TorchDispatchMode):
    """remat's one tracker of live tensors. Without `peak_on`: each op output with the `scope` it ran
    in (the running layer), read after the body by `held()`. With `peak_on` (a device): a running
    count of the bytes of storages alive there, from when known (`known`, or returned by an op)
    until freed, and `peak`, the most at any moment (as torch's `MemTracker` counts it)."""

    def __init__(
        self,
        scope: Callable[[], Any] | None = None,
        *,
        peak_on: torch.device | None = None,
        known: Iterable[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        self._scope = scope or (lambda: None)
        self.outputs: list[tuple[weakref.ref[torch.Tensor], Any]] = []
        self._device_type = None if peak_on is None else peak_on.type
        self.current = self.peak = 0
        self._counted: dict[int, weakref.ref[Any]] = {}
        for tensor in known:
            self._count(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        tensors = [value for value in tree_flatten(out)[0] if isinstance(value, torch.Tensor)]
        if self._device_type is None:
            scope = self._scope()
            self.outputs += [(weakref.ref(tensor), scope) for tensor in tensors]
        else:
            for tensor in tensors:
                self._count(tensor)
        return out

    def held(self, exclude: Container[int] = (), device: torch.device | str | None = None) -> dict[int, tuple]:
        """{data pointer: (bytes, scope, device)} of the outputs still alive, one entry per storage,
        leaving out pointers in `exclude`; with `device`, only storages there."""
        where = torch.device(device) if device is not None else None
        seen: dict[int, tuple[int, Any, torch.device]] = {}
        for ref, scope in self.outputs:
            tensor = ref()
            if tensor is None or not _on(tensor.device, where):
                continue
            for ptr, nbytes in storage_keys(tensor):
                if ptr not in exclude and ptr != 0 and (ptr not in seen or nbytes > seen[ptr][0]):
                    seen[ptr] = (nbytes, scope, tensor.device)
        return seen

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self._device_type:
            return
        if is_traceable_wrapper_subclass(tensor):  # its storage is a stand-in: what it holds is its inner tensors
            for inner in _plain_tensors(tensor):
                self._count(inner)
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # meta tensors, other subclasses
            return
        key = id(storage)
        ref = self._counted.get(key)
        if ref is not None and ref() is storage:
            return
        nbytes = storage.nbytes()
        self._counted[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._freed(key, nbytes))
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int, nbytes: int) -> None:
        self.current -= nbytes
        ref = self._counted.get(key)
        if ref is not None and ref() is None:
            del self._counted[key]


def storage_keys(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """(data pointer, bytes) of the tensor's storage, or of each plain tensor's inside a wrapper subclass (a quantized
    weight of torchao or optimum-quanto: int8 data and scales; its own storage is a stand-in with no data pointer);
    none for a meta tensor."""
    keys = []
    for plain in _plain_tensors(tensor):
        try:
            storage = plain.untyped_storage()
            keys.append((storage.data_ptr(), storage.nbytes()))
        except (RuntimeError, NotImplementedError):  # meta tensors
            continue
    return keys


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    if not is_traceable_wrapper_subclass(tensor):
        yield tensor
        return
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    for name in names:
        yield from _plain_tensors(getattr(tensor, name))


def weight_storages(module: nn.Module) -> dict[int, int]:
    """{data pointer: bytes} of the module's parameters' and buffers' storages, each once."""
    keys = (key for t in (*module.parameters(), *module.buffers()) for key in storage_keys(t))
    return {ptr: nbytes for ptr, nbytes in keys if ptr != 0}


def held_bytes_after(
    forward: Callable[[], Any], exclude: Container[int], device: torch.device | str | None = None
) -> tuple[Any, int]:
    """`forward()`'s result and the bytes of op outputs still alive after it (with `device`, only
    there: an offloaded input waits in host memory)."""
    with LiveStorages() as tracker:
        result = forward()
    gc.collect()
    return result, sum(entry[0] for entry in tracker.held(exclude, device).values())


def _on(device: torch.device, where: torch.device | None) -> bool:
    """Whether `device` is `where` ("cuda" means any CUDA device; None, anywhere)."""
    return where is None or (device.type == where.type and where.index in (None, device.index))
