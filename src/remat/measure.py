"""Measure what backward holds: the bytes of activations alive after forward.

On CPU there is no allocator to ask, so the forward runs under a dispatch mode that keeps a weak
reference to every tensor an op produces. After forward, the ones still alive are exactly what
the autograd graph (and the loss) keep for backward: everything else was freed when the layer
returned. torch keeps a tensor's Python object alive as long as its C++ tensor lives, so a weak
reference dies only when the memory is really released. Storages are counted once each, and
storages of parameters and buffers are excluded (they are weights, not activations).

Tensors saved by a checkpoint are its inputs, produced by the previous layer's ops, so they are
counted; the activations inside a checkpointed layer die with the layer and are not.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class OutputTracker(TorchDispatchMode):
    """Records a weak reference to every tensor an op produces, with the scope it ran in."""

    def __init__(self, scope: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self._scope = scope or (lambda: None)
        self.outputs: list[tuple[weakref.ref[torch.Tensor], Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        scope = self._scope()
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.outputs.append((weakref.ref(value), scope))
        return out

    def alive(self) -> Iterator[tuple[torch.Tensor, Any]]:
        """The recorded tensors that still exist, with their scopes."""
        for ref, scope in self.outputs:
            tensor = ref()
            if tensor is not None:
                yield tensor, scope


@contextmanager
def track_outputs(scope: Callable[[], Any] | None = None) -> Iterator[OutputTracker]:
    tracker = OutputTracker(scope)
    with tracker:
        yield tracker


def storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the tensor's storage, or None for tensors without one."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # meta tensors, some wrapper subclasses
        return None
    return storage.data_ptr(), storage.nbytes()


def weight_storages(model: nn.Module) -> set[int]:
    keys = set()
    for tensor in (*model.parameters(), *model.buffers()):
        key = storage_key(tensor)
        if key is not None:
            keys.add(key[0])
    return keys


def held_bytes_after(
    forward: Callable[[], Any], exclude: set[int], device: torch.device | str | None = None
) -> tuple[Any, int]:
    """Run `forward()`, return its result and the bytes of op outputs still alive afterwards,
    one count per storage, ignoring storages whose data pointer is in `exclude`; with `device`,
    only storages there (an offloaded input waits in host memory, which holds no device bytes)."""
    where = torch.device(device) if device is not None else None
    with track_outputs() as tracker:
        result = forward()
    gc.collect()
    seen: dict[int, int] = {}
    for tensor, _ in tracker.alive():
        key = storage_key(tensor)
        if key is None or key[0] in exclude or key[0] == 0 or not _on(tensor.device, where):
            continue
        seen[key[0]] = max(seen.get(key[0], 0), key[1])
    return result, sum(seen.values())


def _on(device: torch.device, where: torch.device | None) -> bool:
    """Whether `device` is `where` ("cuda" means any CUDA device; None, anywhere)."""
    return where is None or (device.type == where.type and where.index in (None, device.index))


@dataclass(frozen=True)
class StepMeasurement:
    """One training step: how long it took and how many activation bytes backward held."""

    seconds: float
    activation_bytes: int
    loss: float


def measure_step(model: nn.Module, batch: dict[str, torch.Tensor], *, track_memory: bool = True) -> StepMeasurement:
    """One forward + backward of `model(**batch).loss`, timed; gradients are left in place.

    The memory count runs the forward under a tracking mode that slows it down, so a step
    measured for memory is not the one timed: call twice, once with `track_memory=False`.
    """
    if track_memory:
        exclude = weight_storages(model)
        loss, held = held_bytes_after(lambda: model(**batch).loss, exclude)
        loss.backward()
        return StepMeasurement(float("nan"), held, loss.item())
    start = time.perf_counter()
    loss = model(**batch).loss
    loss.backward()
    return StepMeasurement(time.perf_counter() - start, -1, loss.item())
