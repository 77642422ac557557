"""`cm.memory_report(batch)`: one training step, measured layer by layer. Every op's output is recorded with the layer
running (`remat.measure`). A checkpointed layer holds its positional inputs, so their storages count for it; every
other storage for the layer that made it, or "outside layers" (embeddings, final norm, logits, loss): each once, so
rows add up to the total. Reads the wrapper's controller (`Measured`): rooms below the wrapper never reach back up."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .compat.accelerator import memory_allocated, synchronize
from .compat.dispatch import compute_device
from .display import mib, render_table
from .loss import LossFn, check_loss_source, own_inputs, step_backward, step_loss
from .measure import LiveStorages, storage_keys, weight_storages
from .snapshot import model_left_as_it_was

BUFFER_COPY_LIMIT = 64 * 2**20  # larger buffers are weights (quantized models), not counters: not copied


class Measured(Protocol):
    """What the report and the planner read of a wrapper's controller (`remat.controller`)."""

    model: nn.Module
    checkpoint_map: Any  # remat.plan.CheckpointMap
    discovery: Any  # remat.layers.Discovery: .layers[i].module
    offloader: Any  # remat.offload.Offloader
    swapper: Any  # remat.swap.WeightSwapper
    inference: bool


@dataclass(frozen=True)
class LayerMemory:
    index: int
    name: str
    policy: str
    swapped: bool
    device_bytes: int
    host_bytes: int
    weight_bytes: int
    runs: int
    weight_fetches: int = 0
    weight_bytes_fetched: int = 0
    offload: str = ""  # what the offload policy did with this layer's inputs in the step, and why


@dataclass(frozen=True)
class MemoryReport:
    """What one training step held, per layer and in total; `str()` renders a table. Held bytes (`device_bytes`,
    `host_bytes`, `total_bytes`): activations alive after forward, which backward needs. Weights (`weight_bytes`): every
    parameter and buffer resident where it is (a swapped layer's frozen weights wait on the host), the layers' and the
    rest's (`outside_weight_bytes`: embeddings, final norm, head). Each storage counts once."""

    layers: tuple[LayerMemory, ...]
    outside_device_bytes: int
    outside_host_bytes: int
    device: str
    loss: float
    allocator_bytes: int | None = None
    swapped_weight_peak_bytes: int = 0
    swap_pool_bytes: int = 0
    notes: tuple[str, ...] = field(default=())
    outside_weight_bytes: int = 0
    weight_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        return self.outside_device_bytes + sum(layer.device_bytes for layer in self.layers)

    @property
    def host_bytes(self) -> int:
        return self.outside_host_bytes + sum(layer.host_bytes for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    def __str__(self) -> str:
        rows = []
        for m in self.layers:
            figures = (mib(b, 3) for b in (m.device_bytes, m.host_bytes, m.weight_bytes))
            swapped, fetches = ("yes", str(m.weight_fetches)) if m.swapped else ("no", "")
            rows.append((str(m.index), m.name, m.policy, swapped, str(m.runs), *figures, fetches, m.offload))
        outside = (self.outside_device_bytes, self.outside_host_bytes, self.outside_weight_bytes)
        total = (self.device_bytes, self.host_bytes, self.weight_bytes)
        for name, held in (("outside layers", outside), ("total (whole model)", total)):
            rows.append(("", name, "", "", "", *(mib(b, 3) for b in held), "", ""))
        header = ("index", "name", "policy", "swapped", "runs", "held MiB (device)", "held MiB (host)", "weights MiB")
        lines = [
            render_table((*header, "weight fetches", "offload"), rows),
            "held: activations kept for backward after forward; weights: every parameter and buffer resident where "
            "it is (outside layers: embeddings, final norm, head), each storage once",
            f"device: {self.device}, loss {self.loss:.4f}",
        ]
        if self.swap_pool_bytes:
            lines.append(
                f"block swap: swapped weights resident at peak {mib(self.swapped_weight_peak_bytes, 3)} MiB "
                f"(slot pool {mib(self.swap_pool_bytes, 3)} MiB); weights column: resident after the step"
            )
        if self.allocator_bytes is not None:
            lines.append(f"CUDA allocator, allocated after forward minus before: {mib(self.allocator_bytes, 3)} MiB")
        return "\n".join(lines + list(self.notes))


class _LayerHooks:
    """Which layer runs (innermost), how often each body starts (its first child to run marks it), and weak references
    to the layers' inputs and outputs, resolved after forward (an address recorded during it could be reused)."""

    def __init__(self, layers: list[nn.Module]):
        self.stack: list[int] = []
        self.runs = [0] * len(layers)
        self._first: dict[int, nn.Module] = {}
        self.inputs: list[list[weakref.ref[torch.Tensor]]] = [[] for _ in layers]
        self.outputs: list[weakref.ref[torch.Tensor]] = []
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(partial(self._enter, i)))
            self._handles.append(layer.register_forward_hook(partial(self._leave, i), always_call=True))
            self._handles += [c.register_forward_pre_hook(partial(self._start, i, c)) for c in layer.children()]

    def current(self) -> int | None:
        return self.stack[-1] if self.stack else None

    def _enter(self, i: int, module: nn.Module, args: Any) -> None:
        self.stack.append(i)
        self.inputs[i] += [weakref.ref(v) for v in args if isinstance(v, torch.Tensor)]

    def _leave(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1] == i:
            self.stack.pop()
        self.outputs += [weakref.ref(v) for v in tree_flatten(output)[0] if isinstance(v, torch.Tensor)]

    def _start(self, i: int, child: nn.Module, module: nn.Module, args: Any) -> None:
        if self._first.setdefault(i, child) is child:
            self.runs[i] += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _alive_storages(refs: Iterable[weakref.ref[torch.Tensor]]) -> set[int]:
    return {ptr for t in (ref() for ref in refs) if t is not None for ptr, _ in storage_keys(t)}


def memory_report_leaving_state(
    state: Measured, batch: Mapping[str, Any], loss_fn: LossFn | None = None
) -> MemoryReport:
    """`memory_report` with everything the step changed put back, whatever happens (`cm.memory_report`): gradients
    (accumulated ones too: a report between micro-batches changes nothing the optimizer sees), module buffers and
    counters, RNG, the offload and swap counters."""
    model_kept = model_left_as_it_was(state.model, copy_limit=BUFFER_COPY_LIMIT, what="memory_report")
    with counters_left_as_they_were(state), model_kept:
        return memory_report(state, batch, loss_fn)


@contextlib.contextmanager
def counters_left_as_they_were(state: Measured) -> Iterator[None]:
    """The offload and swap counters (and the swap's resident peak) put back, whatever happens: a report's or a
    profile's steps are not the user's training."""
    offload_stats = copy.deepcopy(dict(state.offloader.stats))
    swap_stats = {i: copy.copy(e.stats) for i, e in state.swapper.layers.items()}
    swap_peak = state.swapper.peak_resident_bytes
    try:
        yield
    finally:
        state.offloader.stats.clear()
        state.offloader.stats.update(offload_stats)
        for index in swap_stats.keys() & state.swapper.layers.keys():  # layers still swapped
            state.swapper.layers[index].stats = swap_stats[index]
        state.swapper.peak_resident_bytes = swap_peak


def memory_report(state: Measured, batch: Mapping[str, Any], loss_fn: LossFn | None = None) -> MemoryReport:
    """Run one training step (forward, backward) and measure it, leaving its gradients and counters for the planner,
    which steps an optimizer on them and puts everything back itself."""
    model, offloader, swapper = state.model, state.offloader, state.swapper
    check_loss_source(model, batch, loss_fn, "memory_report")
    batch = own_inputs(batch)
    layers = [layer.module for layer in state.discovery.layers]
    device = compute_device(model)
    offloader.reset_stats()
    swapper.reset_stats()
    exclude = set(weight_storages(model))
    hooks = _LayerHooks(layers)
    try:
        synchronize(device)
        before = memory_allocated(device)
        with LiveStorages(hooks.current) as tracker:
            loss = step_loss(model, batch, loss_fn)
        synchronize(device)
        allocator = None if before is None else memory_allocated(device) - before
        gc.collect()
        offloaded = offloader.live_host_bytes()  # host buffers come from the transport, not from ops
        held = tracker.held(exclude | offloader.host_storages())  # storage -> (bytes, layer, device)
        # A layer's output is held by whoever consumes it: the next layer (its inputs, after) or the head.
        for owner, refs in [(None, hooks.outputs), *enumerate(hooks.inputs)]:
            for ptr in _alive_storages(refs) & held.keys():
                held[ptr] = (held[ptr][0], owner, held[ptr][2])
        step_backward(loss, model)
    finally:
        hooks.remove()
    by_layer = [[0, offloaded.get(i, 0)] for i in range(len(layers))]  # [device, host] bytes held
    outside = [0, 0]
    for size, layer, where in held.values():
        on_host = where.type == "cpu" and device.type != "cpu"
        (outside if layer is None else by_layer[layer])[on_host] += size
    rows = []
    for i, plan in enumerate(state.checkpoint_map):
        swap = swapper.layers.get(i)
        fetched = (swap.stats.fetches, swap.stats.bytes_fetched) if swap else (0, 0)
        weights = sum(weight_storages(layers[i]).values())
        row = (plan.index, plan.name, plan.policy, plan.swapped, *by_layer[i], weights, hooks.runs[i], *fetched)
        rows.append(LayerMemory(*row, _offload_note(offloader, i)))
    every_weight = weight_storages(model)
    in_layers = set().union(*(weight_storages(layer).keys() for layer in layers))
    weights = (sum(size for ptr, size in every_weight.items() if ptr not in in_layers), sum(every_weight.values()))
    swapping = (swapper.peak_resident_bytes, swapper.pool_bytes) if swapper.layers else (0, 0)
    on_cpu = "the model runs on the CPU: there is no separate host memory, so nothing is offloaded"
    notes = (on_cpu,) if device.type == "cpu" and not offloaded else ()
    return MemoryReport(tuple(rows), *outside, str(device), loss.item(), allocator, *swapping, notes, *weights)


def _offload_note(offloader: Any, index: int) -> str:
    """What the offload policy did with the layer's inputs in the step, and why."""
    stats = offloader.stats.get(index)
    if stats is None:
        return ""
    parts = [f"out {mib(stats.offloaded_bytes, 3)} MiB"] if stats.offloaded_bytes else []
    parts += [f"kept {mib(nbytes, 3)} MiB: {why}" for why, nbytes in stats.kept_because.items()]
    return "; ".join(parts)
