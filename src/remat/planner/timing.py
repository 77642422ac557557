"""Pricing time: what each policy adds to a step, from counts turned into seconds by one rate.

A busy machine makes every wall-clock figure move: three profiles that priced a recompute by
differences of step times gave +66, +84 and +545 ms a layer and three different frontiers. So
a price is what can be counted, times a rate:

- Counted (`FlopTally`, one step with every layer recomputed, under a dispatch mode that uses
  torch's own FLOP formulas, `torch.utils.flop_counter`): each layer's forward FLOPs, which is
  what recomputing it repeats, and the FLOPs of the ops "selective" does not keep (what it
  repeats). Identical layers get identical counts; nothing about them is timed apart.
- One rate, seconds per FLOP of a layer's forward: the median over every layer's forward and
  recompute in every timed step (all layers pooled: dozens of samples, so a slow minority moves
  nothing), with its quartiles as the spread.
- "recompute" costs one forward: `rate x FLOPs`. "selective" costs the share of that forward it
  repeats, measured (its recomputes are mostly small elementwise ops, whose time FLOPs do not
  count): the median over its layers of (forward beyond a plain forward + its recompute) /
  FLOPs, divided by the rate; never below its counted FLOPs, never above a whole recompute.
  "offload" costs a recompute and the copies out and back (on an accelerator: the median of
  steps with every layer offloaded, beyond their prediction as recompute, shared by input bytes).
- The step with nothing recomputed: the median over the timed steps of the step's time less
  its map's prices, with quartiles.

The timed steps are mixed maps: step k gives layer i the policy number (i + k) of the timed ones
(alternated over `repeats`), so every policy is timed in every step, against the same load. A
map's predicted time is the base plus its layers' prices, so the ranking of maps is fixed by the
counts and by one measured share (selective's): noise in the rate moves every map alike. A
timer on each layer (CUDA events on an accelerator, so nothing synchronizes mid-step; the host
clock on a CPU) gives each call's time: the first call of a layer in a step is its forward,
the second its recompute in backward (seen on layers transformers checkpoints; a layer remat
wraps itself shows no recompute, and its "selective" is then priced as a whole recompute).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import StateError
from .chooser import TimePrices

CALLS = 2  # timed per layer and step: the forward, and backward's recompute


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile): half the values lie between the outer two."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


class FlopTally(TorchDispatchMode):
    """Counts FLOPs as torch's `FlopCounterMode` does (its formulas, per op; ops without one
    count nothing) in one training step: per layer, in its forward (the layer's first call) and
    in backward's recompute of it (its children's calls after that forward: what torch really
    runs again, which may stop before the layer's last ops when backward needs nothing from
    them). Runs every op as it is (no decomposition: the step computes what it always does)."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self._formulas = flop_registry
        self.forward = [0] * len(layers)
        self.recomputed = [0] * len(layers)
        self._phase = [0] * len(layers)  # 0 before the forward, 1 in it, 2 after it
        self._counting: tuple[list[int], int] | None = None
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer(i, start=True)))
            self._handles.append(layer.register_forward_hook(self._layer(i, start=False), always_call=True))
            for child in layer.children():
                self._handles.append(child.register_forward_pre_hook(self._child(i, start=True)))
                self._handles.append(child.register_forward_hook(self._child(i, start=False), always_call=True))

    def _layer(self, i: int, start: bool) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if start and self._phase[i] == 0 and self._counting is None:
                self._phase[i], self._counting = 1, (self.forward, i)
            elif not start and self._phase[i] == 1:
                self._phase[i], self._counting = 2, None

        return hook

    def _child(self, i: int, start: bool) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if self._phase[i] == 2:  # after the forward: a recompute
                self._counting = (self.recomputed, i) if start else None

        return hook

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self._formulas.get(func._overloadpacket)
        if formula is not None and self._counting is not None:
            counts, i = self._counting
            counts[i] += int(formula(*args, **kwargs, out_val=out))
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def kinds(layers: Sequence[nn.Module]) -> list[int]:
    """Per layer, the number of its kind: identical layers (same class, same parameter shapes and
    dtypes) run the same ops and share a kind."""
    seen: dict[Any, int] = {}
    out = []
    for layer in layers:
        shapes = tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in layer.parameters())
        out.append(seen.setdefault((type(layer), shapes), len(seen)))
    return out


def timed_maps(n: int, names: Sequence[str], swapped: set[int]) -> list[dict[int, str]]:
    """The mixed maps the timed steps run: step k gives layer i policy number (i + k) of the
    timed ones ("none", "selective", "recompute" where offered; a swapped layer recomputes
    where it would be "none")."""
    timed = [name for name in ("none", "selective", "recompute") if name in names] or ["recompute"]
    return [
        {
            i: ("recompute" if timed[(i + k) % len(timed)] == "none" and i in swapped else timed[(i + k) % len(timed)])
            for i in range(n)
        }
        for k in range(len(timed))
    ]


class Counts(NamedTuple):
    """FLOPs per layer: of its forward, of what a recompute of it repeats, and of what
    "selective" repeats (each from a counted step; zeros where the step could not run)."""

    forward: list[int]
    recompute: list[int]
    selective: list[int]


def price_time(
    steps: Any, names: list[str], held: dict[str, dict[int, tuple[int, int]]], swapped: set[int], repeats: int
) -> tuple[dict[str, dict[int, float]], float, TimePrices, list[str]]:
    """Seconds each policy adds per layer over "none", the step time with nothing recomputed,
    the rates and counts behind them, and notes. See the module docstring."""
    n = steps.n
    modules = [layer.module for layer in steps.state.discovery.layers]
    found = steps.counted(dict.fromkeys(range(n), "recompute"), FlopTally(modules))
    if found is None:
        raise StateError(
            "profiling: the step with every layer recomputed ran out of memory while counted; profile a smaller batch"
        )
    forward, recompute = found
    selective = [0] * n
    if "selective" in names:
        found = steps.counted({i: "selective" for i in held["selective"]}, FlopTally(modules))
        selective = found[1] if found is not None else selective
    counts = Counts(forward, recompute, selective)
    # a layer that cannot run a policy (it ran out of memory measuring it) recomputes instead
    maps = [
        {i: p if p == "recompute" or i in held.get(p, {}) else "recompute" for i, p in m.items()}
        for m in timed_maps(n, names, swapped)
    ]
    offloading = "offload" in names
    clock = LayerClock(modules, steps.device)
    runs: list[tuple[dict[int, str], float, list[list[float]]]] = []
    offloaded: list[float] = []
    try:
        for _ in range(repeats):
            for policies in maps:
                seconds = steps.timed(policies, clock)
                if seconds is not None:
                    runs.append((policies, seconds, clock.last))
            if offloading:
                seconds = steps.timed({i: "offload" for i in held["offload"]}, clock)
                if seconds is not None:
                    offloaded.append(seconds)
    finally:
        clock.remove()
    if not runs:
        raise StateError("profiling: every timed step ran out of memory; profile with a smaller batch")
    return _prices(n, names, held, counts, kinds(modules), runs, offloaded)


def _prices(
    n: int,
    names: list[str],
    held: dict[str, dict[int, tuple[int, int]]],
    counts: Counts,
    kind: list[int],
    runs: list[tuple[dict[int, str], float, list[list[float]]]],
    offloaded: list[float],
) -> tuple[dict[str, dict[int, float]], float, TimePrices, list[str]]:
    notes: list[str] = []
    forward = counts.forward
    repeated = [r or f for r, f in zip(counts.recompute, counts.forward, strict=True)]  # none seen: the forward
    counted = all(f > 0 for f in repeated)
    if not counted:  # a layer of ops with no FLOP formula: each layer's forward counts as one
        notes.append("time: some layers run no op torch counts FLOPs for; each layer's forward counts as one unit")
        forward = repeated = [1] * n
    rates: list[float] = []
    timed_selective: list[tuple[int, list[tuple[int, float, float]]]] = []  # per step: its rates' end, calls
    for policies, _, calls in runs:
        step_selective = []
        for i, (first, second) in enumerate(calls):
            policy = policies[i]
            if policy in ("none", "recompute") and first is not None and forward[i]:
                rates.append(first / forward[i])
            if policy == "recompute" and second is not None:
                rates.append(second / repeated[i])
            if policy == "selective" and first is not None and second is not None:
                step_selective.append((i, first, second))
        timed_selective.append((len(rates), step_selective))
    if not rates:
        raise StateError(
            "profiling: no layer's forward was timed (does the model skip every layer?); profile a batch that runs them"
        )
    low, rate, high = quartiles(rates)
    rate = max(rate, 1e-18)
    recompute = {i: rate * repeated[i] for i in range(n)}
    out: dict[str, dict[int, float]] = {"none": dict.fromkeys(range(n), 0.0), "recompute": recompute}
    share = _selective_share(timed_selective, rates, forward, repeated, rate) if "selective" in names else None
    if "selective" in names:
        if share is None:
            notes.append("time: the selective recompute of these layers could not be timed; priced as a recompute")
        # never below the FLOPs it repeats, never above a whole recompute
        floor = [counts.selective[i] / repeated[i] if counted else 0.0 for i in range(n)]
        out["selective"] = {
            i: recompute[i] * min(1.0, max(floor[i], 1.0 if share is None else share)) for i in held["selective"]
        }
    bases = [seconds - sum(out.get(p, recompute)[i] for i, p in policies.items()) for policies, seconds, _ in runs]
    base_low, base, base_high = quartiles(bases)
    if "offload" in names:
        inputs = {i: max(1, sum(held["recompute"].get(i, (1, 0)))) for i in held["offload"]}
        beyond = statistics.median(offloaded) - base - sum(recompute.values()) if offloaded else 0.0
        total = sum(inputs.values())
        out["offload"] = {i: recompute[i] + max(0.0, beyond) * inputs[i] / total for i in held["offload"]}
    prices = TimePrices(
        flops=tuple(repeated) if counted else None,
        selective_flops=tuple(counts.selective) if counted else None,
        seconds_per_flop=rate,
        rate_range=(low, high),
        selective_share=share,
        base_range=(max(0.0, base_low), max(0.0, base_high)),
        samples=len(rates),
        steps=len(runs),
    )
    return out, max(0.0, base), prices, notes


def _selective_share(
    timed: list[tuple[int, list[tuple[int, float, float]]]],
    rates: list[float],
    forward: list[int],
    repeated: list[int],
    rate: float,
) -> float | None:
    """What "selective" costs of a recompute, within each timed step and against that step's own
    rate (the same load): per selective layer, its forward beyond a plain forward (its FLOPs at
    the step's rate) plus its recompute, over a recompute's FLOPs at that rate; the median over
    steps. None when no selective recompute was timed."""
    shares, start = [], 0
    for end, calls in timed:
        step_rate = statistics.median(rates[start:end]) if end > start else rate
        start = end
        if calls:
            costs = [(first - forward[i] * step_rate + second) / repeated[i] for i, first, second in calls]
            shares.append(statistics.median(costs) / max(step_rate, 1e-18))
    return statistics.median(shares) if shares else None


class LayerClock:
    """Each layer's calls in a timed step: its forward (the layer's first call), and backward's
    recompute of it (from the first call of one of its children after that forward to the
    last: transformers checkpoints a layer's `forward`, inside the hooks on the layer itself,
    so its children are what shows the recompute). CUDA events on an accelerator (nothing
    synchronizes mid-step), the host clock on a CPU. `last` holds the step just timed: per
    layer, [forward seconds, recompute seconds], None where there was no such call."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device):
        self.cuda = device.type == "cuda"
        self.last: list[list[Any]] = []
        self._marks: list[list[Any]] = [[] for _ in layers]  # forward start, end; recompute start, end
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer(i, 0)))
            self._handles.append(layer.register_forward_hook(self._layer(i, 1), always_call=True))
            for child in layer.children():
                self._handles.append(child.register_forward_pre_hook(self._child(i, 2)))
                self._handles.append(child.register_forward_hook(self._child(i, 3), always_call=True))

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _layer(self, i: int, mark: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            marks = self._marks[i]
            if len(marks) == mark:  # the first call only
                marks.append(self._now())

        return hook

    def _child(self, i: int, mark: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            marks = self._marks[i]
            if len(marks) == mark:  # after the forward: the recompute starts
                marks.append(self._now())
            elif mark == 3 and len(marks) == 4:  # a later child ends: the recompute goes on
                marks[3] = self._now()

        return hook

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        for marks in self._marks:
            marks.clear()
        yield
        self.last = [[self._seconds(marks, call) for call in range(CALLS)] for marks in self._marks]

    def _seconds(self, marks: list[Any], call: int) -> float | None:
        if len(marks) < 2 * call + 2:
            return None
        start, end = marks[2 * call], marks[2 * call + 1]
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
