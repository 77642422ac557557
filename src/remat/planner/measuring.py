"""Measuring a profile: a few training steps under chosen maps, then put back as it was.

What is measured, on the batch given (`measure`):

1. Bytes. One step with every layer recomputed gives each layer's input (what a checkpointed
   layer keeps at the least) and the bytes outside the layers while something is checkpointed.
   Then each other policy runs on every layer, spread over as few steps as there are policies:
   step k gives layer i the policy number (i + k) of them, so every step is a mixed map (a
   "none" layer holds more while another layer is checkpointed on transformers 4.57: its KV
   cache is off, the causal mask is built, SDPA repeats grouped K/V) and every (layer, policy)
   pair is seen once. A map that runs out of memory is split: by policy, then halves of its
   layers, down to single layers. "offload" runs on every layer at once, so that the last
   checkpointed layer is the last layer (whose input stays on the device). One step with
   nothing checkpointed prices that map on its own (offered only if it fit, and no layer is
   swapped). Each of these is one `remat.report.memory_report`.
2. The step's peak, with `optimizer`: each of those steps runs under torch's `MemTracker`
   (weights, gradients, optimizer state, activations and temporaries) and takes an optimizer
   step too, with the optimizer's state already made (as in every step after the first). What
   the peak holds beyond the held activations depends, measured on Llama and Qwen3, only on the
   last layer's policy (the peak comes early in backward, at the head and the last layer) and
   on whether anything is checkpointed: it is kept per (last layer's policy, checkpointing)
   (`chooser.StepMemory`).
3. Time. Maps with one policy on every layer (where it may go) are timed against "recompute
   everywhere", alternated over `repeats`, medians. A timer on each layer (CUDA events on an
   accelerator, so nothing synchronizes mid-step) gives each layer's forward time, the median
   over every timed step; it divides a map's change among the layers. Physics sets floors under
   the noise: recomputing a layer costs at least one forward of it, offloading at least
   recomputing, "selective" something; no predicted time is negative.

Everything is put back afterwards (`remat.snapshot.model_left_as_it_was` for gradients, buffers,
counters and RNG; here the config and on/off state, the offload and swap counters, and the
optimizer's state and the parameters it stepped). Tensors of the batch that require grad get
fresh leaves (`remat.loss.own_inputs`), so a soft prompt's gradient is never touched.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..config import CheckpointConfig
from ..loss import LossFn, check_loss_source, own_inputs, step_loss
from ..policies import LayerProfile, policy
from ..report import Measured, memory_report
from ..snapshot import model_left_as_it_was
from .chooser import Measurements, Outside, StepMemory

CANDIDATES = ("none", "selective", "recompute", "offload")
SELECTIVE_FLOOR = 0.01  # of a layer's forward: what "selective" recomputes costs something
BUFFER_COPY_LIMIT = 64 * 2**20  # larger buffers are weights (quantized models), not counters
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class Controlled(Measured, Protocol):
    """What measuring reads and changes of a wrapper's controller (`remat.controller.Controller`)."""

    config: CheckpointConfig
    off_by: str | None

    @property
    def is_enabled(self) -> bool: ...

    def enable(self, config: CheckpointConfig) -> None: ...

    def replan(self, config: CheckpointConfig, off_by: str | None, cause: str) -> None: ...


def check_measurable(state: Controlled, batch: Mapping[str, Any], loss_fn: LossFn | None, what: str) -> None:
    """Everything that refuses a measurement, before any work."""
    model = state.model
    if not state.is_enabled or state.inference or not model.training:
        raise RuntimeError(f"{what} measures training steps: call cm.enable() and cm.for_training() first")
    stepping = [n for n, p in model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
    if stepping:
        raise RuntimeError(
            f"{what} runs training steps, and {stepping[0]} (and {len(stepping) - 1} more) has a "
            "post-accumulate-grad hook (an optimizer stepping in backward): measuring would train the model. "
            "Plan before registering those hooks"
        )
    check_loss_source(model, batch, loss_fn, what)


def batch_tokens(batch: Mapping[str, Any]) -> int:
    """Batch x sequence length: of `input_ids`, else of `inputs_embeds` (its last dimension is the
    hidden size), else of the first tensor with two dimensions or more."""
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeds = batch.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor):
        return embeds.numel() // embeds.shape[-1]
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0] * value.shape[1]
    return 1


def candidates(state: Controlled) -> tuple[list[str], list[str]]:
    """The policies worth measuring on this model, and notes on those left out."""
    device = next(state.model.parameters()).device
    reentrant = state.config.use_reentrant
    names = [
        name
        for name in CANDIDATES
        if not (name == "offload" and device.type == "cpu") and not (policy(name).needs_non_reentrant and reentrant)
    ]
    notes = []
    if device.type == "cpu":
        notes.append("offload not considered: the model runs on the CPU, so it would free no device memory")
    if reentrant and "selective" not in names:
        notes.append("selective not considered: it needs use_reentrant=False")
    return names, notes


class _Steps:
    """Runs the measuring steps on the controller's model, counting them on a progress bar."""

    def __init__(self, state: Controlled, batch: dict[str, Any], loss_fn: LossFn | None, optimizer: Any, bar: Any):
        self.state, self.batch, self.loss_fn, self.bar = state, batch, loss_fn, bar
        self.model = state.model
        self.device = next(self.model.parameters()).device
        self.peak = _PeakFactory(self.model, batch, optimizer, self.device)
        self.extras: dict[tuple[str, bool], int] = {}  # (last layer's policy, checkpointing) -> peak - held
        self.n = len(state.checkpoint_map)
        self.base = state.config.replace(offload=False, layer_policies=dict.fromkeys(range(self.n), "recompute"))

    def use(self, policies: Mapping[int, str]) -> None:
        self.state.enable(self.base.replace(layer_policies={**self.base.layer_policies, **policies}))

    def held(self, policies: Mapping[int, str]) -> Any:
        """One step under `policies` (the other layers recomputing), measured by the memory
        report (under a MemTracker, with the optimizer's step, when there is an optimizer); None
        if it ran out of memory."""
        self.use(policies)
        try:
            with self.peak() as optimizer:
                report = memory_report(self.state, self.batch, self.loss_fn)
                if optimizer is not None:
                    optimizer.step()
            extra = self.peak.extra(report)
            if extra is not None:
                plans = list(self.state.checkpoint_map)
                key = (plans[-1].policy, any(plan.checkpointed for plan in plans))
                self.extras[key] = max(self.extras.get(key, extra), extra)
        except OUT_OF_MEMORY:
            report = None
            _give_back_memory()
        self.model.zero_grad(set_to_none=True)
        self.bar.update(1)
        return report

    def timed(self, policies: Mapping[int, str], clock: _LayerClock) -> float | None:
        self.use(policies)
        try:
            _synchronize(self.device)
            start = time.perf_counter()
            with clock.step():
                step_loss(self.model, self.batch, self.loss_fn).backward()
            _synchronize(self.device)
            seconds = time.perf_counter() - start
        except OUT_OF_MEMORY:
            seconds = None
            _give_back_memory()
        self.model.zero_grad(set_to_none=True)
        self.bar.update(1)
        return seconds


def measure(
    state: Controlled,
    batch: Mapping[str, Any],
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 3,
    progress: bool = True,
) -> tuple[Measurements, list[str]]:
    """See the module docstring. Returns the measurements, and notes on what was left out or
    done differently."""
    from transformers.utils.logging import tqdm

    names, notes = candidates(state)
    n = len(state.checkpoint_map)
    swapped = {p.index for p in state.checkpoint_map if p.swapped}
    rotation = [name for name in names if name not in ("recompute", "offload")] or ["none"]
    rotation = rotation if len(rotation) > 1 else [*rotation, "recompute"]
    timed_maps = [name for name in names if name != "recompute"]
    memory_steps = 1 + len(rotation) + ("offload" in names) + (n > 1 and not swapped)
    total = memory_steps + repeats * (1 + len(timed_maps))
    with (
        tqdm(total=total, desc="remat: profiling", disable=not progress, leave=False) as bar,
        _left_as_it_was(state),
    ):
        steps = _Steps(state, own_inputs(batch), loss_fn, optimizer, bar)
        measured = _measure(steps, names, rotation, swapped, repeats, notes)
    return measured, notes


def _measure(
    steps: _Steps,
    names: list[str],
    rotation: list[str],
    swapped: set[int],
    repeats: int,
    notes: list[str],
) -> Measurements:
    n = steps.n
    everything = range(n)
    held: dict[str, dict[int, tuple[int, int]]] = {name: {} for name in names}
    outside = {True: 0, False: 0}

    def record(report: Any, policies: Mapping[int, str]) -> None:
        checkpointing = any(plan.checkpointed for plan in steps.state.checkpoint_map)
        outside[checkpointing] = max(outside[checkpointing], report.outside_device_bytes)
        for i, name in policies.items():
            held[name][i] = (report.layers[i].device_bytes, report.layers[i].host_bytes)

    everything_recomputed = dict.fromkeys(everything, "recompute")
    report = steps.held({})
    if report is None:
        raise RuntimeError(
            "profiling: even with every layer recomputed, one step of this batch does not fit on the device; "
            "no map can fit it (try a smaller batch)"
        )
    record(report, everything_recomputed)
    inputs = {i: sum(held["recompute"][i]) for i in everything}
    pending = [
        {
            i: rotation[(i + k) % len(rotation)]
            for i in everything
            if not (i in swapped and rotation[(i + k) % len(rotation)] == "none")
        }
        for k in range(len(rotation))
    ]
    if "offload" in names:
        pending.append(dict.fromkeys(everything, "offload"))
    split = False
    while pending:
        policies = {i: name for i, name in pending.pop(0).items() if name != "recompute"}
        if not policies:
            continue
        report = steps.held(policies)
        if report is not None:
            record(report, policies)
            continue
        by_policy = sorted(set(policies.values()))
        if len(by_policy) > 1:
            pending += [{i: p for i, p in policies.items() if p == name} for name in by_policy]
        elif len(policies) > 1:
            layers = sorted(policies)
            half = len(layers) // 2
            pending += [{i: policies[i] for i in layers[:half]}, {i: policies[i] for i in layers[half:]}]
        else:
            ((i, name),) = policies.items()
            notes.append(f"layer {i} cannot run {name!r} on this device with this batch")
        split = True
    if split:
        notes.append("some maps ran out of memory: measured in smaller groups of layers")
    # The map that checkpoints nothing, priced by its own run: not offered with swapped layers.
    alone: dict[int, tuple[int, int]] | None = None
    if not swapped and "none" in names:
        if n > 1:
            report = steps.held(dict.fromkeys(everything, "none"))
            if report is not None:
                alone = {i: (layer.device_bytes, layer.host_bytes) for i, layer in enumerate(report.layers)}
                outside[False] = report.outside_device_bytes
        elif 0 in held["none"]:
            alone = {0: held["none"][0]}
            # n == 1: the rotation's "none" run checkpointed nothing
    seconds, base_seconds = _seconds(steps, names, held, swapped, repeats)
    options = tuple(
        tuple(name for name in names if i in held[name] and not (name == "none" and i in swapped)) for i in everything
    )
    profiles = tuple(
        LayerProfile(
            index=i,
            input_bytes=inputs[i],
            held={name: held[name][i] for name in names if i in held[name]},
            seconds={name: seconds[name][i] for name in names if i in held[name]},
        )
        for i in everything
    )
    step = StepMemory(dict(steps.extras)) if steps.extras else None
    return Measurements(
        layers=profiles,
        names=tuple(p.name for p in steps.state.checkpoint_map),
        options=options,
        outside=Outside(outside[True], outside[False]),
        alone=None if alone is None else tuple(alone[i] for i in everything),
        base_seconds=base_seconds,
        tokens=batch_tokens(steps.batch),
        step=step,
    )


def _seconds(
    steps: _Steps, names: list[str], held: dict[str, dict[int, tuple[int, int]]], swapped: set[int], repeats: int
) -> tuple[dict[str, dict[int, float]], float]:
    """Seconds each policy adds per layer over "none", and the step time with nothing recomputed."""
    n = steps.n
    maps = {
        name: {i: name for i in range(n) if i in held[name] and not (name == "none" and i in swapped)}
        for name in names
        if name != "recompute"
    }
    clock = _LayerClock([layer.module for layer in steps.state.discovery.layers], steps.device)
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
    forward = _pooled(clock.forward_seconds(), [layer.module for layer in steps.state.discovery.layers])
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


def _pooled(seconds: list[float], layers: Sequence[nn.Module]) -> list[float]:
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


class _LayerClock:
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


class _PeakFactory:
    """With an optimizer: a context for one measured step under torch's `MemTracker` that also
    takes the optimizer step, then puts the parameters and the optimizer's state back at once
    (later steps run on the same weights: an MoE router's choices depend on them);
    `extra(report)` is then the peak beyond the held activations."""

    def __init__(self, model: nn.Module, batch: Mapping[str, Any], optimizer: Any, device: torch.device):
        self.model, self.batch, self.optimizer, self.device = model, batch, optimizer, device
        self.tracker: Any = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Any]:
        if self.optimizer is None:
            yield None
            return
        optimizer = self.optimizer
        saved_state = copy.deepcopy(optimizer.state_dict())
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved = [p.detach().to("cpu", copy=True) for p in params]
        if any(p not in optimizer.state for p in params if p.requires_grad):
            _make_state(optimizer, params)  # as in every step after the first
        tracker = frozen_aware_mem_tracker(self.model)
        inputs = [v for v in self.batch.values() if isinstance(v, torch.Tensor)]
        tracker.track_external(self.model, optimizer, *inputs)
        self.tracker = tracker
        try:
            with tracker:
                yield optimizer
        finally:
            with torch.no_grad():
                for param, value in zip(params, saved, strict=True):
                    param.copy_(value)
            optimizer.load_state_dict(saved_state)

    def extra(self, report: Any) -> int | None:
        if self.tracker is None:
            return None
        peak = peak_bytes(self.tracker, self.device)
        self.tracker = None
        return peak - report.device_bytes


def _make_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """One optimizer step on zero gradients, so that its state exists (the parameters it moves,
    weight decay, and the state itself are put back after the measured step)."""
    grads = [(p, p.grad) for p in params]
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for p, grad in grads:
            p.grad = grad


class _NoHook:
    def remove(self) -> None:
        pass


def frozen_aware_mem_tracker(model: nn.Module) -> Any:
    """torch's `MemTracker`, usable on a model with frozen parameters (LoRA): as of torch 2.13 it
    registers a gradient hook on every parameter a module has, which torch refuses for one that
    does not require grad. Frozen parameters are marked as hooked already (with hooks that do
    nothing); they get no gradient, so nothing is missed."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):
        def __enter__(self) -> Any:
            for param in model.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
            return super().__enter__()

    return _Tracker()


def peak_bytes(tracker: Any, device: torch.device) -> int:
    """The peak `MemTracker` counted on `device` (all categories)."""
    snapshot = tracker.get_tracker_snapshot("peak")
    for where, counts in snapshot.items():
        if torch.device(where).type == device.type:
            return int(counts.get("Total", sum(counts.values())))
    return 0


@contextlib.contextmanager
def _left_as_it_was(state: Controlled) -> Iterator[None]:
    """Measuring runs training steps: put back, whatever happens, what `model_left_as_it_was`
    puts back, and the config and on/off state and the offload and swap counters (each restored
    on its own). The optimizer's state is put back after each step that used it (`_PeakFactory`)."""
    config, off_by = state.config, state.off_by
    offload_stats = copy.deepcopy(dict(state.offloader.stats))
    swap_stats = {i: copy.copy(e.stats) for i, e in state.swapper.layers.items()}
    swap_peak = state.swapper.peak_resident_bytes

    def counters_back() -> None:
        state.offloader.stats.clear()
        state.offloader.stats.update(offload_stats)
        for index, stats in swap_stats.items():
            if index in state.swapper.layers:
                state.swapper.layers[index].stats = stats
        state.swapper.peak_resident_bytes = swap_peak

    def config_back() -> None:
        state.replan(config, off_by=off_by, cause="profile() (restoring)")

    failures: list[BaseException] = []
    try:
        with model_left_as_it_was(state.model, copy_limit=BUFFER_COPY_LIMIT, what="profile"):
            yield
    finally:
        for restore in (counters_back, config_back):
            try:
                restore()
            except Exception as err:
                failures.append(err)
    if failures:
        raise failures[0]


def _give_back_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
