"""Putting modules back as they were: the one helper behind "measuring leaves the model as it
was" (`remat.planner`) and "a recompute leaves the layer as its forward did" (`remat.recompute`).

A forward changes more than activations. An MoE router counts tokens in a buffer, a module
advances a step counter kept as a plain int or float attribute, a rotary embedding replaces its
cache buffer. `Watched` lists those places once (buffers, and int/float attributes); a
`Snapshot` of them records each buffer's version counter (and, when asked, a copy of its
values) and each number's value; `Snapshot.restore()` writes back only what changed since.

Only what changed is touched: writing back every buffer would bump version counters that a
reentrant backward checks (rotary caches read through views), and copying every buffer on
every recompute would clone large caches for nothing. So a recompute first asks which entries
its forward changed (`Snapshot.changed()`, no copies), and copies only those.

`model_left_as_it_was` adds what a training step changes besides the modules' state: the
parameters' gradients and the RNG (through `torch.random.fork_rng`, on the model's device).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .refs import Ref

logger = logging.getLogger("remat")

_NUMBER_TYPES = (int, float)  # exact types: a bool is a flag a forward does not advance


@dataclass(frozen=True)
class _BufferEntry:
    owner: Ref[nn.Module]
    name: str


@dataclass(frozen=True)
class _NumberEntry:
    owner: Ref[nn.Module]
    key: str


class Watched:
    """The buffers and int/float attributes of some modules, listed once (a layer's shim lists
    them when it is installed and reads them around every forward). Modules are held weakly."""

    def __init__(self, modules: Iterable[nn.Module] = (), *, numbers: bool = True):
        self.buffers: list[_BufferEntry] = []
        self.numbers: list[_NumberEntry] = []
        for module in modules:
            owner = Ref(module)
            self.buffers += [_BufferEntry(owner, n) for n, b in module._buffers.items() if b is not None]
            if numbers:
                self.numbers += [_NumberEntry(owner, k) for k, v in vars(module).items() if type(v) in _NUMBER_TYPES]

    @classmethod
    def of(cls, buffers: list[_BufferEntry], numbers: list[_NumberEntry]) -> Watched:
        watched = cls()
        watched.buffers, watched.numbers = buffers, numbers
        return watched

    def __bool__(self) -> bool:
        return bool(self.buffers or self.numbers)

    def snapshot(self, *, copy: bool = False, copy_limit: int | None = None) -> Snapshot:
        """The entries as they are now: versions and values; with `copy`, a copy of each buffer
        (on the host when `copy_limit` is given, and only of buffers up to that many bytes:
        larger ones are weights kept as buffers, e.g. a quantized model's, not counters)."""
        tensors = [_current(entry) for entry in self.buffers]
        copies = [_copy(t, copy_limit) if copy and t is not None else None for t in tensors]
        versions = [-1 if t is None else t._version for t in tensors]
        values = [_value(entry) for entry in self.numbers]
        return Snapshot(self, tensors, versions, copies, values)


@dataclass(frozen=True)
class Snapshot:
    """What `Watched.snapshot` recorded: put back with `restore()`, compared with `changed()`."""

    watched: Watched
    tensors: list[torch.Tensor | None]
    versions: list[int]
    copies: list[torch.Tensor | None]
    values: list[int | float | None]

    def changed(self) -> Watched:
        """The entries that changed since the snapshot: a buffer replaced or written to, a number
        with another value."""
        buffers = [
            entry
            for entry, tensor, version in zip(self.watched.buffers, self.tensors, self.versions, strict=True)
            if tensor is not None and (tensor._version != version or _current(entry) is not tensor)
        ]
        numbers = [
            entry for entry, value in zip(self.watched.numbers, self.values, strict=True) if _value(entry) != value
        ]
        return Watched.of(buffers, numbers)

    def restore(self) -> list[str]:
        """Put back what changed since the snapshot; returns the names of changed buffers that
        could not be put back (no copy was taken: too large)."""
        lost = []
        for entry, tensor, version, copy in zip(
            self.watched.buffers, self.tensors, self.versions, self.copies, strict=True
        ):
            module = entry.owner()
            if tensor is None or module is None:
                continue
            if module._buffers.get(entry.name) is not tensor:
                module._buffers[entry.name] = tensor  # replaced by a new tensor (a rotary cache)
            if tensor._version == version:
                continue
            if copy is None:
                lost.append(entry.name)
                continue
            with torch.no_grad():
                tensor.copy_(copy)
        for entry, value in zip(self.watched.numbers, self.values, strict=True):
            module = entry.owner()
            if module is not None and value is not None and vars(module).get(entry.key) != value:
                object.__setattr__(module, entry.key, value)
        return lost


def _current(entry: _BufferEntry) -> torch.Tensor | None:
    module = entry.owner()
    return None if module is None else module._buffers.get(entry.name)


def _value(entry: _NumberEntry) -> int | float | None:
    module = entry.owner()
    return None if module is None else vars(module).get(entry.key)


def _copy(tensor: torch.Tensor, limit: int | None) -> torch.Tensor | None:
    if limit is None:
        return tensor.detach().clone()
    if tensor.numel() * tensor.element_size() > limit:
        return None
    return tensor.detach().to("cpu", copy=True)


@contextlib.contextmanager
def model_left_as_it_was(model: nn.Module, *, copy_limit: int, what: str) -> Iterator[None]:
    """Run the body (training steps) and put back, whatever happens: the parameters' gradients
    (the body starts with none), the buffers and int/float attributes of every module, and the
    RNG state of the CPU and of the model's accelerator. Buffers larger than `copy_limit` bytes
    are not copied; if one of those changed, a warning names it (`what` says who measured)."""
    grads = [(p, p.grad) for p in model.parameters()]
    snapshot = Watched(model.modules()).snapshot(copy=True, copy_limit=copy_limit)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if backend is not None and getattr(backend, "is_initialized", lambda: False)():
        index = device.index if device.index is not None else backend.current_device()
        rng = torch.random.fork_rng(devices=[index], device_type=device.type)
    else:
        rng = torch.random.fork_rng(devices=[])  # the CPU's generator only
    for param, _ in grads:
        param.grad = None
    failures: list[BaseException] = []
    with rng:
        try:
            yield
        finally:
            try:
                for param, grad in grads:
                    param.grad = grad
            except Exception as err:  # each restored on its own: one that fails does not stop the others
                failures.append(err)
            try:
                for name in snapshot.restore():
                    logger.warning("%s: buffer %s changed while measuring and is too large to restore", what, name)
            except Exception as err:
                failures.append(err)
    if failures:
        raise failures[0]
