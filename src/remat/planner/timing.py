"""Pricing time: what each policy adds to a step, as counted work times one timed rate (README, "How it
prices time"). Wall clocks move on a busy machine (three profiles priced a recompute at +66, +84 and +545 ms a
layer), so every price is a count and only the rate is timed: `FlopTally` counts each layer's work (FLOPs by
torch's formulas, the other ops' bytes and launches at the device's fixed `Balance`); the rate is the median
seconds per unit of work over the layer calls `LayerClock` times. "selective" also pays its policy's cost per
dispatched op; "offload" a recompute plus its timed copies. A checkpoint costs more than its timed calls (pack
and unpack hooks, RNG state; tiny layers: 4.4-4.9 ms a layer whole against 1.8 ms timed), so prices are scaled
by one factor, `whole`, from the steps timed without layer timers, which also give the step with nothing
recomputed. Noise thus moves every price alike (offload's copies aside): counts fix the ranking of maps.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..compat.accelerator import is_accelerator, timing_event
from ..errors import StateError
from ..memory_errors import OutOfMemoryError
from .chooser import TimePrices

CALLS = 2  # timed per layer and step: the forward, and backward's recompute
Held = dict[str, dict[int, tuple[int, int]]]  # policy -> layer -> (device, host) bytes held
Seconds = dict[str, dict[int, float]]  # policy -> layer -> seconds added
Runs = list[tuple[dict[int, str], float, list[list[float]] | None]]  # (map, step seconds, layer timings)
Priced = tuple[Seconds, float, TimePrices, list[str]]


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile): half the values lie between the outer two."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


class Balance(NamedTuple):
    """A device's time, in FLOPs, for moving a byte, launching an op, and an op under "selective"'s policy (a
    dispatch mode). Fixed per device kind, never timed, so the prices' ratios are counts."""

    flops_per_byte: float
    flops_per_op: float
    flops_per_policed_op: float


# cpu: fitted on an idle 2-core x86, torch 2.13, to the benchmark's tiny and small presets (150 GFLOP/s, 10 GB/s for
# small ops, 37 us an op, 21 us more under selective; benchmarks/RESULTS.md). cuda: H100/H200 datasheets (bf16, HBM3),
# ~1 us a launch, the policy hidden behind queued kernels; not measured here.
BALANCES = {
    "cpu": Balance(flops_per_byte=15.0, flops_per_op=5.5e6, flops_per_policed_op=3.1e6),
    "cuda": Balance(flops_per_byte=250.0, flops_per_op=1e9, flops_per_policed_op=0.0),
}


class Work(NamedTuple):
    """FLOPs (torch's formulas); bytes read and written by the other non-view ops; ops launched
    (views aside); every op dispatched (views too: what a dispatch mode sees)."""

    flops: int = 0
    bytes: int = 0
    ops: int = 0
    dispatched: int = 0

    def units(self, balance: Balance) -> float:
        return self.flops + self.bytes * balance.flops_per_byte + self.ops * balance.flops_per_op


def _hook_layers(layers: Sequence[nn.Module], on_call: Callable[..., None]) -> list[Any]:
    """`on_call(i, child, start)` before and after each layer and each of its direct children: transformers
    checkpoints a layer's `forward` inside the hooks on the layer itself, so its children show the recompute."""
    handles = []
    for i, layer in enumerate(layers):
        for module, child in ((layer, False), *((c, True) for c in layer.children())):
            handles.append(module.register_forward_pre_hook(functools.partial(on_call, i, child, True)))
            handles.append(module.register_forward_hook(functools.partial(on_call, i, child, False), always_call=True))
    return handles


class FlopTally(TorchDispatchMode):
    """Counts one training step's `Work` per layer: in its forward (the layer's first call) and in backward's recompute
    (its children's calls after that forward: what torch really runs again). Runs every op as it is."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self._formulas = flop_registry
        self.forward = [[0, 0, 0, 0] for _ in layers]
        self.recomputed = [[0, 0, 0, 0] for _ in layers]
        self._phase = [0] * len(layers)  # 0 before the forward, 1 in it, 2 after it
        self._counting: list[int] | None = None
        self._handles = _hook_layers(layers, self._hook)

    def _hook(self, i: int, child: bool, start: bool, *_: Any) -> None:
        if child:
            if self._phase[i] == 2:  # after the forward: a recompute
                self._counting = self.recomputed[i] if start else None
        elif start and self._phase[i] == 0 and self._counting is None:
            self._phase[i], self._counting = 1, self.forward[i]
        elif not start and self._phase[i] == 1:
            self._phase[i], self._counting = 2, None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counts = self._counting
        if counts is not None:
            counts[3] += 1
            formula = self._formulas.get(func._overloadpacket)
            if formula is not None:
                counts[0] += int(formula(*args, **kwargs, out_val=out))
            elif not func.is_view:
                leaves = tree_leaves((args, kwargs, out))
                counts[1] += sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor))
            counts[2] += not func.is_view
        return out

    def work(self) -> tuple[list[Work], list[Work]]:
        return [Work(*c) for c in self.forward], [Work(*c) for c in self.recomputed]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class Counts(NamedTuple):
    """Work per layer of its forward, of a recompute, of "selective" (empty: could not run)."""

    forward: list[Work]
    recompute: list[Work]
    selective: list[Work]


def timed_policies(names: Sequence[str]) -> list[str]:
    """The timed maps, every layer under one policy: "none" and "recompute" give the rate and `whole`. "selective"
    is priced by counts only: timed with them, any error in its price went into every map's base."""
    return [name for name in ("none", "recompute") if name in names] or ["recompute"]


def price_time(steps: Any, names: list[str], held: Held, repeats: int) -> Priced:
    """Seconds each policy adds per layer over "none", the step's with nothing recomputed, the prices, notes."""
    n = steps.n
    modules = [layer.module for layer in steps.state.discovery.layers]

    def counted(policies: dict[int, str]) -> tuple[list[Work], list[Work]] | None:
        tally = FlopTally(modules)
        try:
            return None if steps.timed(policies, tally) is None else tally.work()
        finally:
            tally.remove()

    found = counted(dict.fromkeys(range(n), "recompute"))
    if found is None:
        raise OutOfMemoryError(
            "profiling: counting its ops, the step with every layer recomputed ran out of memory. Profile a smaller "
            "batch"
        ) from steps.out_of_memory
    forward, recompute = found
    selective: list[Work] = []
    if "selective" in names and (found := counted({i: "selective" for i in held["selective"]})) is not None:
        # what it repeats, and the policy's own cost on each op, forward and recompute
        selective = [r._replace(dispatched=f.dispatched + r.dispatched) for f, r in zip(*found, strict=True)]
    # a layer not measured under its policy (swapped, for "none"; out of memory measuring it) recomputes instead
    pick = lambda p, i: p if i in held.get(p, {}) else "recompute"
    maps = [{i: pick(policy, i) for i in range(n)} for policy in timed_policies(names)]
    clock = LayerClock(modules, steps.device)
    runs: Runs = []
    offloaded: list[float] = []
    for repeat in range(repeats):
        for k, policies in enumerate(maps):
            # every other step (alternating per repeat) without the layer timers, which no real step runs: the base
            hooked = (k + repeat) % 2 == 0
            while (seconds := steps.timed(policies, clock.step() if hooked else contextlib.nullcontext())) is None:
                # out of memory: half of its "none" layers recompute, for this step and the repeats
                nones = [i for i, p in policies.items() if p == "none"]
                if not nones:
                    break
                policies = maps[k] = {**policies, **dict.fromkeys(nones[len(nones) // 2 :], "recompute")}
            if seconds is not None:
                runs.append((policies, seconds, clock.last if hooked else None))
        if "offload" in names:
            seconds = steps.timed({i: "offload" for i in held["offload"]}, contextlib.nullcontext())
            if seconds is not None:
                offloaded.append(seconds)
    if not runs:
        raise OutOfMemoryError(
            "profiling: every timed step ran out of memory. Profile with a smaller batch"
        ) from steps.out_of_memory
    balance = BALANCES.get(steps.device.type, BALANCES["cuda"])
    return _prices(n, names, held, Counts(forward, recompute, selective), balance, runs, offloaded)


def _prices(
    n: int, names: list[str], held: Held, counts: Counts, balance: Balance, runs: Runs, offloaded: list[float]
) -> Priced:
    notes: list[str] = []
    forward = [max(1.0, w.units(balance)) for w in counts.forward]
    # a recompute torch was not seen running (nothing counted after the forward): the forward
    repeated = [r.units(balance) or f for r, f in zip(counts.recompute, forward, strict=True)]
    rates: list[float] = []
    for policies, _, calls in runs:
        for i, (first, second) in enumerate(calls or ()):
            if policies[i] in ("none", "recompute") and first is not None:
                rates.append(first / forward[i])
            if policies[i] == "recompute" and second is not None:
                rates.append(second / repeated[i])
    if not rates:
        raise StateError(
            "profiling: no layer's forward was timed (does the model skip every layer?); profile a batch that runs them"
        )
    low, rate, high = quartiles(rates)
    rate = max(rate, 1e-18)
    recompute = {i: rate * repeated[i] for i in range(n)}
    out: Seconds = {"none": dict.fromkeys(range(n), 0.0), "recompute": recompute}
    selective = [w.units(balance) + w.dispatched * balance.flops_per_policed_op for w in counts.selective]
    if "selective" in names:
        if not selective:
            notes.append("time: the selective recompute of these layers could not be counted; priced as a recompute")
        out["selective"] = {i: rate * selective[i] if selective else recompute[i] for i in held["selective"]}
    # the steps timed without hooks, if any: what recomputing adds to them whole, and the step with nothing recomputed
    plain = [run for run in runs if run[2] is None] or runs
    added = lambda policies: sum(out.get(p, recompute)[i] for i, p in policies.items())
    whole = _whole(plain, added)
    if whole is None:
        whole = 1.0
        notes.append(
            "time: the steps with layers recomputed were not measured slower than those without (a busy machine?): "
            "a recompute is priced by its timed calls alone"
        )
    for name in ("recompute", "selective"):
        out[name] = {i: seconds * whole for i, seconds in out.get(name, {}).items()}
    recompute = out["recompute"]
    bases = [seconds - added(policies) for policies, seconds, _ in plain]
    base_low, base, base_high = quartiles(bases)
    if "offload" in names:
        inputs = {i: max(1, sum(held["recompute"].get(i, (1, 0)))) for i in held["offload"]}
        beyond = statistics.median(offloaded) - base - sum(recompute.values()) if offloaded else 0.0
        total = sum(inputs.values())
        out["offload"] = {i: recompute[i] + max(0.0, beyond) * inputs[i] / total for i in held["offload"]}
    prices = TimePrices(
        flops=tuple(w.flops for w in counts.recompute),
        selective_flops=tuple(w.flops for w in counts.selective) if selective else None,
        work=tuple(repeated),
        selective_work=tuple(selective) if selective else None,
        seconds_per_flop=rate * whole,
        rate_range=(low * whole, high * whole),
        base_range=(max(0.0, base_low), max(0.0, base_high)),
        samples=len(rates),
        steps=len(runs),
        whole=whole,
    )
    return out, max(0.0, base), prices, notes


def _whole(plain: Runs, added: Callable[[dict[int, str]], float]) -> float | None:
    """What the maps' prices add to a step measured whole, over those prices: the least-squares slope of each map's
    median step time against its prices; None where the prices do not differ or the slope is not positive."""
    times: dict[tuple[tuple[int, str], ...], list[float]] = {}
    for policies, seconds, _ in plain:
        times.setdefault(tuple(sorted(policies.items())), []).append(seconds)
    try:
        xs, ys = zip(*((added(dict(key)), statistics.median(seconds)) for key, seconds in times.items()), strict=True)
        slope = statistics.linear_regression(xs, ys).slope
    except statistics.StatisticsError:  # fewer than two maps, or all priced alike
        return None
    return slope if slope > 0 else None


class LayerClock:
    """Times in `step()` each layer's forward and recompute, the calls `FlopTally` counts: CUDA events on an accelerator
    (nothing synchronizes mid-step), else the host clock. `last`: per layer, [forward, recompute] seconds or None."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device):
        self.events = is_accelerator(device)  # the accelerator's events; a CPU's clock
        self.layers = list(layers)
        self.last: list[list[Any]] = []
        self._marks: list[list[Any]] = [[] for _ in layers]  # forward start, end; recompute start, end

    def _now(self) -> Any:
        return timing_event() if self.events else time.perf_counter()

    def _hook(self, i: int, child: bool, start: bool, *_: Any) -> None:
        marks = self._marks[i]
        if not child:
            if len(marks) == (0 if start else 1):  # the layer's first call only
                marks.append(self._now())
        elif len(marks) == (2 if start else 3):  # after the forward: the recompute starts
            marks.append(self._now())
        elif not start and len(marks) == 4:  # a later child ends: the recompute goes on
            marks[3] = self._now()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        for marks in self._marks:
            marks.clear()
        handles = _hook_layers(self.layers, self._hook)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self.last = [[self._seconds(marks, call) for call in range(CALLS)] for marks in self._marks]

    def _seconds(self, marks: list[Any], call: int) -> float | None:
        if len(marks) < 2 * call + 2:
            return None
        start, end = marks[2 * call], marks[2 * call + 1]
        return start.elapsed_time(end) / 1e3 if self.events else end - start
