"""`cm.memory_report(batch)`: one training step, measured layer by layer.

For each layer it gives the bytes that backward holds after forward, split by where they live
(the model's device, or host memory when the model is on an accelerator), the bytes of weights
resident in the layer, and how many times the layer ran during the step (2 = recomputed).

How bytes are attributed: every tensor an op produces during forward is recorded with the layer
that was running (see `remat.measure`). After forward, the tensors still alive are what backward
holds. A checkpointed layer holds its inputs, so the storages of its positional inputs are
counted for that layer; every other storage counts for the layer that produced it, or for
"outside layers" (embeddings, the final norm, logits, the loss). Each storage counts once, so
the layers and "outside layers" add up to the total exactly.

Weights: the bytes of parameters and buffers resident where they are (a swapped layer's
frozen weights wait in host memory and count only their placeholders), per layer, for the rest
of the model ("outside layers": embeddings, the final norm, the head), and in total: every
parameter and buffer of the model, each storage once.

On CUDA the allocator's figure for the same step (`torch.cuda.memory_allocated` after forward,
minus before) is reported beside the attributed total.

What `cm.memory_report` runs is `memory_report_leaving_state`: the step, with everything it
changed put back (gradients, accumulated ones included; the offload and swap counters; buffers
and counters of the modules; RNG). `memory_report` alone leaves the step's gradients and
counters, for the planner, which steps an optimizer on them and puts everything back itself.

The report is handed the wrapper's controller (anything with the attributes of `Measured`), not
the wrapper: rooms below the wrapper never reach back up into it. The step's loss and inputs are
settled by `remat.loss` (a `loss_fn` for models without `.loss`; tensors of the batch that
require grad, a soft prompt, keep their gradients).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .display import mib, render_table
from .loss import LossFn, check_loss_source, own_inputs, step_loss
from .measure import LiveStorages, storage_key, weight_storages
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
    """What one training step held, per layer and in total. `str()` renders a table.

    Held bytes (`device_bytes`, `host_bytes`, `total_bytes`): activations alive after forward,
    which backward needs, in the layers and outside them; each storage once. Weights
    (`weight_bytes`): every parameter and buffer of the model resident where it is, each
    storage once: the layers' (`LayerMemory.weight_bytes`) and the rest of the model's
    (`outside_weight_bytes`: embeddings, final norm, head)."""

    layers: tuple[LayerMemory, ...]
    outside_device_bytes: int
    outside_host_bytes: int
    device: str
    loss: float
    allocator_bytes: int | None = None
    swapped_weight_peak_bytes: int = 0
    swap_pool_bytes: int = 0
    notes: tuple[str, ...] = field(default=())
    outside_weight_bytes: int = 0  # parameters and buffers outside every layer
    model_weight_bytes: int | None = None  # every parameter and buffer of the model, each storage once

    @property
    def device_bytes(self) -> int:
        return self.outside_device_bytes + sum(layer.device_bytes for layer in self.layers)

    @property
    def host_bytes(self) -> int:
        return self.outside_host_bytes + sum(layer.host_bytes for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    @property
    def weight_bytes(self) -> int:
        """Every parameter and buffer of the model, resident where it is, each storage once:
        the layers' and the rest of the model's (embeddings, final norm, head)."""
        if self.model_weight_bytes is not None:
            return self.model_weight_bytes
        return self.outside_weight_bytes + sum(layer.weight_bytes for layer in self.layers)

    def __str__(self) -> str:
        rows = [
            (
                str(layer.index),
                layer.name,
                layer.policy,
                "yes" if layer.swapped else "no",
                str(layer.runs),
                mib(layer.device_bytes, 3),
                mib(layer.host_bytes, 3),
                mib(layer.weight_bytes, 3),
                str(layer.weight_fetches) if layer.swapped else "",
                layer.offload,
            )
            for layer in self.layers
        ]
        outside = [mib(b, 3) for b in (self.outside_device_bytes, self.outside_host_bytes, self.outside_weight_bytes)]
        rows.append(("", "outside layers", "", "", "", *outside, "", ""))
        total = [mib(b, 3) for b in (self.device_bytes, self.host_bytes, self.weight_bytes)]
        rows.append(("", "total (whole model)", "", "", "", *total, "", ""))
        header = ("index", "name", "policy", "swapped", "runs", "held MiB (device)", "held MiB (host)", "weights MiB")
        header += ("weight fetches", "offload")
        lines = [
            render_table(header, rows),
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
        lines.extend(self.notes)
        return "\n".join(lines)


class _RunCounter:
    """Counts how often each layer's body starts: the first child to run marks a start."""

    def __init__(self, layers: list[nn.Module]):
        self.runs = [0] * len(layers)
        self._first: list[nn.Module | None] = [None] * len(layers)
        self._handles = []
        for i, layer in enumerate(layers):
            for child in layer.children():
                self._handles.append(child.register_forward_pre_hook(self._hook(i, child)))

    def _hook(self, i: int, child: nn.Module):
        def hook(module: nn.Module, args: Any) -> None:
            if self._first[i] is None:
                self._first[i] = child
            if self._first[i] is child:
                self.runs[i] += 1

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _LayerScopes:
    """Tracks which layer is running (innermost) and the storages of each layer's inputs."""

    def __init__(self, layers: list[nn.Module]):
        self.stack: list[int] = []
        # Weak references, resolved to storages after forward: a storage address recorded now
        # could be reused by another tensor before forward ends.
        self._inputs: list[list[weakref.ref[torch.Tensor]]] = [[] for _ in layers]
        self._outputs: list[weakref.ref[torch.Tensor]] = []
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._enter(i)))
            self._handles.append(layer.register_forward_hook(self._leave(i), always_call=True))

    def current(self) -> int | None:
        return self.stack[-1] if self.stack else None

    def _enter(self, i: int):
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(i)
            self._inputs[i].extend(weakref.ref(v) for v in args if isinstance(v, torch.Tensor))

        return hook

    def _leave(self, i: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] == i:
                self.stack.pop()
            self._outputs.extend(weakref.ref(v) for v in tree_flatten(output)[0] if isinstance(v, torch.Tensor))

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    @staticmethod
    def _storages(refs: list[weakref.ref[torch.Tensor]]) -> set[int]:
        keys = (storage_key(t) for t in (ref() for ref in refs) if t is not None)
        return {key[0] for key in keys if key is not None}

    def inputs(self, i: int) -> set[int]:
        """Storages of layer i's positional inputs that are still alive."""
        return self._storages(self._inputs[i])

    def outputs(self) -> set[int]:
        """Storages of the layers' outputs that are still alive."""
        return self._storages(self._outputs)


def memory_report_leaving_state(state: Measured, batch: dict[str, Any], loss_fn: LossFn | None = None) -> MemoryReport:
    """`memory_report`, with everything the step changed put back, whatever happens (what
    `cm.memory_report` runs): the parameters' gradients (accumulated ones included: a report
    between two micro-batches changes nothing the next optimizer step sees), buffers and int/float
    counters of the modules, the RNG (`remat.snapshot.model_left_as_it_was`), the offload and
    swap counters (`offload_stats` stay sums since the wrapper was made or reset). The step
    changes no train/eval flag."""
    with (
        counters_left_as_they_were(state),
        model_left_as_it_was(state.model, copy_limit=BUFFER_COPY_LIMIT, what="memory_report"),
    ):
        return memory_report(state, batch, loss_fn)


@contextlib.contextmanager
def counters_left_as_they_were(state: Measured) -> Iterator[None]:
    """The offload and swap counters (and the swap's resident peak) put back, whatever happens:
    a report's or a profile's steps are not the user's training."""
    offload_stats = copy.deepcopy(dict(state.offloader.stats))
    swap_stats = {i: copy.copy(e.stats) for i, e in state.swapper.layers.items()}
    swap_peak = state.swapper.peak_resident_bytes
    try:
        yield
    finally:
        state.offloader.stats.clear()
        state.offloader.stats.update(offload_stats)
        for index, stats in swap_stats.items():
            if index in state.swapper.layers:
                state.swapper.layers[index].stats = stats
        state.swapper.peak_resident_bytes = swap_peak


def memory_report(state: Measured, batch: dict[str, Any], loss_fn: LossFn | None = None) -> MemoryReport:
    """Run one training step of the controller's model on `batch` (forward, backward; no
    optimizer step) and measure it. The step's gradients are left in place, as after any
    backward, and the offload and swap counters hold the step's counts (the planner steps an
    optimizer on them); `memory_report_leaving_state` puts everything back. Tensors of the batch
    that require grad get none (see `remat.loss`)."""
    model = state.model
    check_loss_source(model, batch, loss_fn, "memory_report")
    batch = own_inputs(batch)
    layers = [layer.module for layer in state.discovery.layers]
    plans = list(state.checkpoint_map)
    param = next(model.parameters())
    device = param.device
    swapper = state.swapper if state.swapper.layers else None
    before_fetches = {i: (e.stats.fetches, e.stats.bytes_fetched) for i, e in swapper.layers.items()} if swapper else {}
    if swapper is not None:
        swapper.peak_resident_bytes = swapper.resident_bytes
    state.offloader.reset_stats()
    scopes = _LayerScopes(layers)
    counter = _RunCounter(layers)
    exclude = set(weight_storages(model))
    on_cuda = device.type == "cuda"
    try:
        if on_cuda:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
        with LiveStorages(scopes.current) as tracker:
            loss = step_loss(model, batch, loss_fn)
        allocator = None
        if on_cuda:
            torch.cuda.synchronize(device)
            allocator = torch.cuda.memory_allocated(device) - before
        gc.collect()
        offloaded = state.offloader.live_host_bytes()  # host buffers come from the transport, not from ops
        exclude |= state.offloader.host_storages()
        held: dict[int, tuple[int, int | None, bool]] = {}  # storage -> (bytes, layer, on host)
        for tensor, layer in tracker.alive():
            key = storage_key(tensor)
            if key is None or key[0] in exclude or key[0] == 0:
                continue
            on_host = tensor.device.type == "cpu" and device.type != "cpu"
            if key[0] not in held or key[1] > held[key[0]][0]:
                held[key[0]] = (key[1], layer, on_host)
        # A layer's output is held by whoever consumes it: the next layer (below) or the head.
        for ptr in scopes.outputs() & held.keys():
            size, _, on_host = held[ptr]
            held[ptr] = (size, None, on_host)
        for index in range(len(plans)):
            for ptr in scopes.inputs(index) & held.keys():
                size, _, on_host = held[ptr]
                held[ptr] = (size, index, on_host)
        loss.backward()
    finally:
        scopes.remove()
        counter.remove()

    device_by_layer = [0] * len(layers)
    host_by_layer = [offloaded.get(i, 0) for i in range(len(layers))]
    outside = [0, 0]
    for size, layer, on_host in held.values():
        if layer is None:
            outside[on_host] += size
        elif on_host:
            host_by_layer[layer] += size
        else:
            device_by_layer[layer] += size
    rows = tuple(
        LayerMemory(
            plan.index,
            plan.name,
            plan.policy,
            plan.swapped,
            device_by_layer[i],
            host_by_layer[i],
            sum(weight_storages(layers[i]).values()),
            counter.runs[i],
            *_fetched_since(swapper, i, before_fetches),
            _offload_note(state.offloader.stats.get(i)),
        )
        for i, plan in enumerate(plans)
    )
    every_weight = weight_storages(model)
    in_layers: set[int] = set()
    for layer in layers:
        in_layers |= weight_storages(layer).keys()
    outside_weights = sum(size for ptr, size in every_weight.items() if ptr not in in_layers)
    notes = []
    if device.type == "cpu" and not offloaded:
        notes.append("the model runs on the CPU: there is no separate host memory, so nothing is offloaded")
    return MemoryReport(
        rows,
        outside[0],
        outside[1],
        str(device),
        loss.item(),
        allocator,
        swapper.peak_resident_bytes if swapper else 0,
        swapper.pool_bytes if swapper else 0,
        tuple(notes),
        outside_weights,
        sum(every_weight.values()),
    )


def _offload_note(stats: Any) -> str:
    if stats is None:
        return ""
    parts = [f"out {mib(stats.offloaded_bytes, 3)} MiB"] if stats.offloaded_bytes else []
    parts += [f"kept {mib(nbytes, 3)} MiB: {why}" for why, nbytes in stats.kept_because.items()]
    return "; ".join(parts)


def _fetched_since(swapper: Any, index: int, before: dict[int, tuple[int, int]]) -> tuple[int, int]:
    if swapper is None or index not in swapper.layers:
        return 0, 0
    stats = swapper.layers[index].stats
    fetches, nbytes = before.get(index, (0, 0))
    return stats.fetches - fetches, stats.bytes_fetched - nbytes
