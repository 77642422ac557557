"""Timing the maps of a profile: what each policy adds to a step, per layer.

Maps with one policy on every layer (where it may go) are timed against "recompute everywhere",
alternated over the repeats, medians (one noisy repeat moves nothing). A timer on each layer
(CUDA events on an accelerator, so nothing synchronizes mid-step; the host clock on a CPU) gives
each layer's forward time, the median over every timed step, pooled over identical layers; it
divides a map's change among the layers. Physics sets floors under the noise: recomputing a layer
costs at least one forward of it, offloading at least recomputing, "selective" something; the
step with nothing recomputed is never below zero.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

SELECTIVE_FLOOR = 0.01  # of a layer's forward: what "selective" recomputes costs something


def layer_seconds(
    steps: Any, names: list[str], held: dict[str, dict[int, tuple[int, int]]], swapped: set[int], repeats: int
) -> tuple[dict[str, dict[int, float]], float]:
    """Seconds each policy adds per layer over "none", and the step time with nothing recomputed."""
    n = steps.n
    maps = {
        name: {i: name for i in range(n) if i in held[name] and not (name == "none" and i in swapped)}
        for name in names
        if name != "recompute"
    }
    clock = LayerClock([layer.module for layer in steps.state.discovery.layers], steps.device)
    times: dict[str, list[float]] = {key: [] for key in ["recompute", *maps]}
    try:
        for _ in range(repeats):
            for key in times:
                seconds = steps.timed(maps.get(key, {}), clock)
                if seconds is not None:
                    times[key].append(seconds)
    finally:
        clock.remove()
    if not times["recompute"]:
        raise RuntimeError("profiling: the step with every layer recomputed ran out of memory while timed")
    base = statistics.median(times["recompute"])
    forward = pooled(clock.forward_seconds(), [layer.module for layer in steps.state.discovery.layers])
    change = {key: statistics.median(values) - base for key, values in times.items() if values and key in maps}

    def spread(name: str) -> dict[int, float]:
        """The change of a map, shared among its layers by their forward time."""
        layers = maps[name]
        total = sum(forward[i] for i in layers) or 1.0
        return {i: change.get(name, 0.0) * forward[i] / total for i in layers}

    # recomputing a layer costs at least one forward of it
    saved = spread("none") if "none" in maps else {}
    recompute = {i: max(-saved.get(i, 0.0), forward[i]) for i in range(n)}
    base_seconds = max(0.0, base - sum(recompute.values()))
    out: dict[str, dict[int, float]] = {"none": dict.fromkeys(range(n), 0.0), "recompute": recompute}
    floors = {"offload": lambda i: recompute[i], "selective": lambda i: SELECTIVE_FLOOR * forward[i]}
    for name in maps:
        if name == "none":
            continue
        lowest = floors.get(name, lambda i: 0.0)
        out[name] = {i: max(recompute[i] + s, lowest(i)) for i, s in spread(name).items()}
    return out, base_seconds


def pooled(seconds: list[float], layers: Sequence[nn.Module]) -> list[float]:
    """Identical layers (same class, same parameter shapes and dtypes) run the same ops: each
    gets the median forward time of its kind, so noise does not price them differently."""
    kinds: dict[Any, list[int]] = {}
    for i, layer in enumerate(layers):
        shapes = tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in layer.parameters())
        kinds.setdefault((type(layer), shapes), []).append(i)
    out = list(seconds)
    for members in kinds.values():
        typical = statistics.median(seconds[i] for i in members)
        for i in members:
            out[i] = typical
    return out


class LayerClock:
    """Each layer's forward time in the timed steps: the first call of a layer in a step is its
    forward (later ones are backward's recomputes). CUDA events on an accelerator (nothing
    synchronizes mid-step), the host clock on a CPU."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device):
        self.cuda = device.type == "cuda"
        self.samples: list[list[float]] = [[] for _ in layers]
        self._marks: list[list[Any]] = [[] for _ in layers]
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._mark(i)))
            self._handles.append(layer.register_forward_hook(self._mark(i, end=True), always_call=True))

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _mark(self, i: int, end: bool = False) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if len(self._marks[i]) < 2 and (end or not self._marks[i]):
                self._marks[i].append(self._now())

        return hook

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        for marks in self._marks:
            marks.clear()
        yield
        for i, marks in enumerate(self._marks):
            if len(marks) == 2:
                start, end = marks
                self.samples[i].append(start.elapsed_time(end) / 1e3 if self.cuda else end - start)

    def forward_seconds(self) -> list[float]:
        return [statistics.median(s) if s else 0.0 for s in self.samples]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
