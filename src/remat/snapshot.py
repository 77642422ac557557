"""Putting modules back as they were, after measuring (`remat.planner`) or a recompute (`remat.recompute`).

A forward changes more than activations: an MoE router counts tokens in a buffer, a step counter
is an int attribute, a rotary embedding replaces its cache buffer. Only what changed is written
back: writing every buffer would bump version counters a reentrant backward checks, and copying
every buffer on every recompute would clone large caches; so a recompute first asks `changed()`.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch import nn

from .compat.dispatch import compute_device
from .refs import Ref

logger = logging.getLogger("remat")


# Batch norm's running statistics, which torch's kernel updates in place without bumping their version counter (a
# recompute in training mode would update them twice)
_UNVERSIONED = ("running_mean", "running_var")


@dataclass(frozen=True)
class _Entry:
    owner: Ref[nn.Module]
    name: str
    buffer: bool  # a buffer, or an int/float attribute
    unversioned: bool = False  # written by torch without a version bump: always taken as changed

    def current(self) -> Any:
        module = self.owner()
        return None if module is None else (module._buffers if self.buffer else vars(module)).get(self.name)


class Watched:
    """The buffers and int/float attributes (exact types: a bool is a flag a forward does not
    advance) of some modules, listed once, held weakly."""

    def __init__(self, modules: Iterable[nn.Module] = ()):
        self.buffers: list[_Entry] = []
        self.numbers: list[_Entry] = []
        for module in modules:
            owner = Ref(module)
            silent = _UNVERSIONED if isinstance(module, nn.modules.batchnorm._NormBase) else ()
            self.buffers += [_Entry(owner, n, True, n in silent) for n, b in module._buffers.items() if b is not None]
            self.numbers += [_Entry(owner, k, False) for k, v in vars(module).items() if type(v) in (int, float)]

    def __bool__(self) -> bool:
        return bool(self.buffers or self.numbers)

    def snapshot(self, *, copy: bool = False, copy_limit: int | None = None) -> Snapshot:
        """Versions and values now; with `copy`, a copy of each buffer (with `copy_limit`, on the host
        and only up to that many bytes: larger ones are weights kept as buffers, not counters)."""
        tensors = [(entry, entry.current()) for entry in self.buffers]
        buffers = [(e, t, t._version, _copy(t, copy_limit) if copy else None) for e, t in tensors if t is not None]
        return Snapshot(buffers, [(entry, entry.current()) for entry in self.numbers])


@dataclass(frozen=True)
class Snapshot:
    """What `Watched.snapshot` recorded: put back with `restore()`, compared with `changed()`."""

    buffers: list[tuple[_Entry, torch.Tensor, int, torch.Tensor | None]]  # entry, tensor, version, copy
    numbers: list[tuple[_Entry, int | float | None]]  # entry, value

    def changed(self) -> Watched:
        """The entries changed since: a buffer replaced or written to, a number with another value."""
        changed = Watched()
        changed.buffers = [
            e for e, t, version, _ in self.buffers if t._version != version or e.current() is not t or _updated(e)
        ]
        changed.numbers = [entry for entry, value in self.numbers if entry.current() != value]
        return changed

    def restore(self) -> list[str]:
        """Put back what changed; returns the names of changed buffers with no copy (too large)."""
        lost = []
        for entry, tensor, version, copy in self.buffers:
            module = entry.owner()
            if module is None:
                continue
            if module._buffers.get(entry.name) is not tensor:
                module._buffers[entry.name] = tensor  # replaced by a new tensor (a rotary cache)
            if tensor._version == version and not (_updated(entry) and copy is not None):
                continue
            if copy is None:
                lost.append(entry.name)
                continue
            with torch.no_grad():
                # batch norm's statistics without a version bump, as torch writes them: its backward may check it
                (tensor.data if entry.unversioned else tensor).copy_(copy)
        for entry, value in self.numbers:
            module = entry.owner()
            if module is not None and value is not None and vars(module).get(entry.name) != value:
                object.__setattr__(module, entry.name, value)
        return lost


def _updated(entry: _Entry) -> bool:
    """Whether an unversioned buffer may have been written: its module trains (in eval, batch norm reads it only)."""
    return entry.unversioned and (module := entry.owner()) is not None and module.training


def _copy(tensor: torch.Tensor, limit: int | None) -> torch.Tensor | None:
    if limit is None:
        return tensor.detach().clone()
    return None if tensor.numel() * tensor.element_size() > limit else tensor.detach().to("cpu", copy=True)


@contextlib.contextmanager
def _python_and_numpy_rng() -> Iterator[None]:
    """Put back the state of Python's `random` and numpy's global generator (numpy comes with transformers)."""
    states = random.getstate(), numpy.random.get_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])


@contextlib.contextmanager
def _every_layer_runs(model: nn.Module) -> Iterator[None]:
    """LayerDrop off (a module's `layerdrop`, a config's `layerdrop`, `encoder_layerdrop`, ...): a measuring step that
    skipped a layer priced it at nothing (Hubert at layerdrop=0.5: every layer's "none" at 0 bytes, the steps after at
    2.5x the budget). A training step runs at most every layer: it holds at most what was measured."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    dropped = [
        (owner, key, value)
        for owner in (*model.modules(), *configs.values())
        for key, value in list(getattr(owner, "__dict__", {}).items())
        if key.endswith("layerdrop") and type(value) is float and value > 0
    ]
    for owner, key, _ in dropped:
        object.__setattr__(owner, key, 0.0)
    try:
        yield
    finally:
        for owner, key, value in dropped:
            object.__setattr__(owner, key, value)


@contextlib.contextmanager
def model_left_as_it_was(model: nn.Module, *, copy_limit: int, what: str) -> Iterator[None]:
    """Run the body (training steps, every layer running: LayerDrop off) and put back, whatever happens: the
    parameters' gradients (the body starts with none), every module's buffers and int/float attributes, and the RNG of
    the CPU and the model's accelerator, and Python's and numpy's global RNG (some models draw there:
    Musicgen's LayerDrop from `random`, Wav2Vec2's SpecAugment from `numpy.random`). Buffers over
    `copy_limit` bytes are not copied; if one changed, a warning names it (`what` says who measured)."""
    grads = [(p, p.grad) for p in model.parameters()]
    snapshot = Watched(model.modules()).snapshot(copy=True, copy_limit=copy_limit)
    device = compute_device(model)
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if backend is not None and getattr(backend, "is_initialized", lambda: False)():
        index = device.index if device.index is not None else backend.current_device()
        rng = torch.random.fork_rng(devices=[index], device_type=device.type)
    else:
        rng = torch.random.fork_rng(devices=[])  # the CPU's generator only
    for param, _ in grads:
        param.grad = None
    failures: list[BaseException] = []
    with rng, _python_and_numpy_rng(), _every_layer_runs(model):
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
