"""`cm.plan_for_budget(batch, budget)`: the fastest per-layer map whose held activations fit.

How a budget becomes a map:

1. Measure, on the batch given. Each candidate policy runs on a group of layers at once (every
   layer, unless that does not fit on the device: then halves, quarters, ... down to single
   layers), the other layers recomputing: one step under `memory_report` gives the bytes each
   layer holds for backward after forward, on the device and in host memory, and the bytes
   held outside the layers (embeddings, logits, loss; they depend only on whether any layer is
   checkpointed). Then these maps are timed against "recompute everywhere", alternated over
   `repeats`, medians; a forward with a timer on each layer says how a group's time divides
   among its layers. Physics sets floors under the noise: recomputing a layer costs at least one
   forward of it, offloading at least recomputing, "selective" something. Candidates: "none",
   "selective", "recompute", and "offload" only when the model runs on an accelerator (on a CPU
   model there is no device memory for offload to free). Swapped layers are never "none".
   "none" is measured in two halves (the other half recomputing) and once on every layer: a
   "none" layer holds more while another layer is checkpointed on transformers 4.57 (checkpointing
   turns its KV cache off, the causal mask is then built and SDPA repeats grouped K/V), so the
   halves price mixed maps and the whole run prices the map that checkpoints nothing (offered
   only if that run fit on the device).
2. Choose. Otherwise a layer's held bytes depend on its own policy only (the measurement counts
   a layer's input for that layer, whatever produced it), so a map's bytes and time are sums over
   layers, with one exact correction: with offload, the input of the last checkpointed layer
   stays on the device (backward needs it first). Layer by layer, the planner keeps every combination no
   other beats in both bytes and time (combinations that may still owe the correction apart
   from those that do not), and picks the fastest whose device bytes, with the bytes outside
   the layers, fit the budget; on equal time, the one that holds more (fewer layers recomputed).
3. Hand back a config. The result is a `CheckpointConfig` naming every layer's policy in
   `layer_policies`, like any other config (saved, loaded, re-applied by routes); printing it
   shows the plan: per layer the policy, predicted bytes and time, and the totals.

Measuring leaves the model as it was: config and on/off state, gradients, buffers (an MoE
router's counters), the RNG state, the offload and swap counters. A model whose parameters
step their optimizer from a gradient hook (optimizer in backward) is refused: measuring would
train it. The prediction is checked in the suite against `cm.memory_report` after
`cm.enable(planned)` (within 5%, and within the budget).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .arguments import parse_bytes
from .config import CheckpointConfig
from .display import render_table
from .policies import LayerProfile, policy

if TYPE_CHECKING:
    from .model import CheckpointedModel

logger = logging.getLogger("remat")

CANDIDATES = ("none", "selective", "recompute", "offload")
_FRONT_LIMIT = 20_000  # combinations kept per layer; far above what identical layers produce
_SELECTIVE_FLOOR = 0.01  # of a layer's forward: what "selective" recomputes costs something
_BUFFER_COPY_LIMIT = 64 * 2**20  # larger buffers are weights (quantized models), not counters
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(frozen=True)
class LayerChoice:
    index: int
    name: str
    policy: str
    device_bytes: int
    host_bytes: int
    seconds: float


class PlannedConfig(CheckpointConfig):
    """What `plan_for_budget` returns: a `CheckpointConfig` (equal to, saved and loaded like, the
    plain config with the same fields) that also remembers its prediction; `str()` shows it."""

    choices: tuple[LayerChoice, ...]
    outside_bytes: int
    budget: int
    base_seconds: float
    notes: tuple[str, ...]

    @classmethod
    def of(cls, config: CheckpointConfig, **prediction: Any) -> PlannedConfig:
        planned = cls(**{name: getattr(config, name) for name in config.to_dict()})
        for key, value in prediction.items():
            object.__setattr__(planned, key, value)
        return planned

    @property
    def predicted_device_bytes(self) -> int:
        return self.outside_bytes + sum(c.device_bytes for c in self.choices)

    @property
    def predicted_host_bytes(self) -> int:
        return sum(c.host_bytes for c in self.choices)

    @property
    def predicted_seconds(self) -> float:
        return self.base_seconds + sum(c.seconds for c in self.choices)

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f}"
        rows = [
            (str(c.index), c.name, c.policy, mib(c.device_bytes), mib(c.host_bytes), f"{c.seconds * 1e3:+.1f}")
            for c in self.choices
        ]
        rows.append(("", "outside layers", "", mib(self.outside_bytes), "0.00", ""))
        totals = (mib(self.predicted_device_bytes), mib(self.predicted_host_bytes))
        rows.append(("", "total (predicted)", "", *totals, f"{self.predicted_seconds * 1e3:.1f} per step"))
        header = ("index", "name", "policy", "held MiB (device)", "held MiB (host)", "step ms")
        lines = [render_table(header, rows), f"budget {mib(self.budget)} MiB of held activations on the device"]
        return "\n".join([*lines, *self.notes])


def plan_for_budget(
    cm: CheckpointedModel, batch: Mapping[str, Any], budget: int | str, repeats: int = 3
) -> PlannedConfig:
    """See the module docstring. Raises ValueError naming the smallest budget that fits when
    none of the maps does."""
    from .model import controller_of

    limit = parse_bytes(budget, "budget")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    state = controller_of(cm)
    if not state.is_enabled or state.inference or not cm.model.training:
        raise RuntimeError("plan_for_budget measures training steps: call cm.enable() and cm.for_training() first")
    stepping = [n for n, p in cm.model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
    if stepping:
        raise RuntimeError(
            f"plan_for_budget runs training steps, and {stepping[0]} (and {len(stepping) - 1} more) has a "
            "post-accumulate-grad hook (an optimizer stepping in backward): measuring would train the model. "
            "Plan before registering those hooks"
        )
    device = next(cm.model.parameters()).device
    config = state.config
    candidates = [
        name
        for name in CANDIDATES
        if not (name == "offload" and device.type == "cpu")
        and not (policy(name).needs_non_reentrant and config.use_reentrant)
    ]
    notes = []
    if device.type == "cpu":
        notes.append("offload not considered: the model runs on the CPU, so it would free no device memory")
    if config.use_reentrant and "selective" not in candidates:
        notes.append("selective not considered: it needs use_reentrant=False")
    with _left_as_it_was(cm):
        measured = _Measurement(cm, dict(batch), candidates, repeats)
    notes += measured.notes
    swapped = {p.index for p in state.checkpoint_map if p.swapped}
    options = [
        [n for n in candidates if n in p.held and not (n == "none" and p.index in swapped)] for p in measured.profiles
    ]
    names = [p.name for p in state.checkpoint_map]
    front = _front(measured.profiles, options)
    choices = _fastest_fitting(front, measured.profiles, limit, measured.outside, names, measured.alone)
    if choices is None:
        smallest = min(_total(s, measured.outside, measured.alone) for s in front)
        raise ValueError(
            f"no map fits a budget of {limit} bytes ({limit / 2**20:.1f} MiB) for this model and batch: the smallest "
            f"is {smallest} bytes ({smallest / 2**20:.1f} MiB), {measured.outside[True] / 2**20:.1f} MiB of it "
            "outside the layers (embeddings, logits, loss), which no checkpointing policy changes"
        )
    planned = config.replace(layer_policies={c.index: c.policy for c in choices}, offload=False)
    checkpointing = _checkpoints([c.policy for c in choices])
    return PlannedConfig.of(
        planned,
        choices=tuple(choices),
        outside_bytes=measured.outside[checkpointing],
        budget=limit,
        base_seconds=measured.base_seconds,
        notes=tuple(notes),
    )


# -- measuring --------------------------------------------------------------------------------


class _Measurement:
    """Per-layer profiles (bytes held, seconds added, per policy), the bytes held outside the
    layers by whether any layer is checkpointed, and the step time with nothing checkpointed."""

    def __init__(self, cm: CheckpointedModel, batch: dict[str, Any], candidates: Sequence[str], repeats: int):
        self.cm, self.batch, self.notes = cm, batch, []
        n = len(cm.checkpoint_map)
        self.base = cm.config.replace(offload=False, layer_policies=dict.fromkeys(range(n), "recompute"))
        self.outside = {False: 0, True: 0}
        held: dict[str, dict[int, tuple[int, int]]] = {}
        groups: dict[str, list[list[int]]] = {}
        everything = self._held(list(range(n)), "recompute")  # what the others do while a group is measured
        if everything is None:
            raise RuntimeError(
                "plan_for_budget: even with every layer recomputed, one step of this batch does not fit on the "
                "device; no map can fit it (try a smaller batch)"
            )
        held["recompute"], groups["recompute"] = everything, [list(range(n))]
        for name in candidates:
            if name == "recompute":
                continue
            # What a "none" layer holds can depend on whether any layer is checkpointed (transformers
            # 4.57 keeps more then): measured in two halves for maps that checkpoint something, and
            # on its own for the map that checkpoints nothing.
            halves = [list(range(n // 2)), list(range(n // 2, n))] if name == "none" and n > 1 else [list(range(n))]
            held[name], groups[name] = self._held_in_groups(name, halves)
        # {}: the map that checkpoints nothing is not offered (it did not fit, or layers are swapped)
        swapping = any(p.swapped for p in cm.checkpoint_map)
        self.alone = {} if swapping else (self._held(list(range(n)), "none") if n > 1 else held["none"]) or {}
        forward = self._forward_seconds()
        seconds = self._seconds(groups, forward, repeats)
        inputs = held["recompute"]
        self.profiles = [
            LayerProfile(
                index=i,
                input_bytes=sum(inputs[i]),
                held={name: held[name][i] for name in candidates if i in held[name]},
                seconds={name: seconds[name][i] for name in candidates if i in held[name]},
            )
            for i in range(n)
        ]

    def _config(self, layers: Sequence[int], name: str) -> CheckpointConfig:
        return self.base.replace(layer_policies={**self.base.layer_policies, **dict.fromkeys(layers, name)})

    def _held(self, layers: list[int], name: str) -> dict[int, tuple[int, int]] | None:
        """One step with `layers` under `name`, the others recomputing; None if it runs out of memory."""
        self.cm.enable(self._config(layers, name))
        report = _fitting(lambda: self.cm.memory_report(self.batch), self.cm)
        self.cm.model.zero_grad(set_to_none=True)
        if report is None:
            return None
        checkpointing = any(plan.checkpointed for plan in self.cm.checkpoint_map)
        self.outside[checkpointing] = max(self.outside[checkpointing], report.outside_device_bytes)
        return {i: (report.layers[i].device_bytes, report.layers[i].host_bytes) for i in layers}

    def _held_in_groups(self, name: str, start: list[list[int]]) -> tuple[dict[int, tuple[int, int]], list[list[int]]]:
        held: dict[int, tuple[int, int]] = {}
        done: list[list[int]] = []
        pending = [list(group) for group in start if group]
        while pending:
            layers = pending.pop(0)
            found = self._held(layers, name)
            if found is not None:
                held.update(found)
                done.append(layers)
            elif len(layers) > 1:
                half = len(layers) // 2
                pending += [layers[:half], layers[half:]]
            else:
                self.notes.append(f"layer {layers[0]} cannot run {name!r} on this device with this batch")
        if len(done) > len(start):
            self.notes.append(f"{name!r} on those layers at once ran out of memory: measured in {len(done)} groups")
        return held, done

    def _forward_seconds(self) -> list[float]:
        """Each layer's forward time (timers on its entry and exit, in a forward without grad)."""
        cm = self.cm
        device = next(cm.model.parameters()).device
        spent = [0.0] * len(cm.layers)
        started: dict[int, float] = {}
        handles = []
        for i, layer in enumerate(cm.layers):

            def enter(module: Any, args: Any, i: int = i) -> None:
                _synchronize(device)
                started[i] = time.perf_counter()

            def leave(module: Any, args: Any, output: Any, i: int = i) -> None:
                _synchronize(device)
                spent[i] += time.perf_counter() - started.pop(i, time.perf_counter())

            handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
        cm.enable(self.base)
        try:
            with torch.no_grad():
                cm(**self.batch)
        finally:
            for handle in handles:
                handle.remove()
        return spent

    def _seconds(
        self, groups: dict[str, list[list[int]]], forward: list[float], repeats: int
    ) -> dict[str, dict[int, float]]:
        """Seconds each policy adds per layer, from steps timed against "recompute everywhere"."""
        maps = {
            (name, tuple(layers)): self._config(layers, name)
            for name in groups
            if name != "recompute"  # the baseline itself
            for layers in groups[name]
        }
        times: dict[Any, list[float]] = {key: [] for key in [*maps, "base"]}
        for _ in range(repeats):
            for key, config in [*maps.items(), ("base", self.base)]:
                self.cm.enable(config)
                times[key].append(_timed_step(self.cm, self.batch))
        base = statistics.median(times["base"])
        change = {key: statistics.median(values) - base for key, values in times.items() if key != "base"}

        def spread(name: str) -> dict[int, float]:
            """The change of each group, shared among its layers by their forward time."""
            out = {}
            for layers in groups[name]:
                total = sum(forward[i] for i in layers) or 1.0
                for i in layers:
                    out[i] = change[(name, tuple(layers))] * forward[i] / total
            return out

        saved_by_none = spread("none")  # negative: what not recomputing saves
        recompute = {i: max(-s, forward[i]) for i, s in saved_by_none.items()}  # at least one more forward
        recompute.update({i: forward[i] for i in range(len(forward)) if i not in recompute})
        self.base_seconds = base - sum(recompute.values())
        out: dict[str, dict[int, float]] = {"none": dict.fromkeys(range(len(forward)), 0.0), "recompute": recompute}
        for name in groups:
            if name in out:
                continue
            measured = {i: recompute[i] + s for i, s in spread(name).items()}
            floor = {"offload": lambda i: recompute[i], "selective": lambda i: _SELECTIVE_FLOOR * forward[i]}
            lowest = floor.get(name, lambda i: 0.0)
            out[name] = {i: max(value, lowest(i)) for i, value in measured.items()}
        return out


def _fitting(run: Callable[[], Any], cm: CheckpointedModel) -> Any:
    """`run()`, or None if the device ran out of memory (what it allocated is given back)."""
    try:
        return run()
    except _OUT_OF_MEMORY:
        cm.model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def _timed_step(cm: CheckpointedModel, batch: dict[str, Any]) -> float:
    device = next(cm.model.parameters()).device
    _synchronize(device)
    start = time.perf_counter()
    cm(**batch).loss.backward()
    _synchronize(device)
    seconds = time.perf_counter() - start
    cm.model.zero_grad(set_to_none=True)
    return seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _left_as_it_was(cm: CheckpointedModel) -> Iterator[None]:
    """Measuring runs training steps: put back the config and on/off state, gradients, buffers,
    the RNG state and the offload and swap counters, whatever happens (each restored on its own,
    so one that fails does not keep the others from being put back)."""
    from .model import controller_of

    state = controller_of(cm)
    config, off_by = state.config, state.off_by
    grads = [(p, p.grad) for p in cm.model.parameters()]
    buffers = [
        (module, name, buffer, buffer._version, _small_copy(buffer))
        for module in cm.model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
    numbers = [  # int and float attributes: counters a forward advances (see `remat.recompute._LayerState`)
        (module, key, value)
        for module in cm.model.modules()
        for key, value in vars(module).items()
        if type(value) in (int, float)
    ]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    offload_stats = copy.deepcopy(dict(state.offloader.stats))
    swap_stats = {i: copy.copy(e.stats) for i, e in state.swapper.layers.items()}
    swap_peak = state.swapper.peak_resident_bytes
    cm.model.zero_grad(set_to_none=True)

    def grads_back() -> None:
        for param, grad in grads:
            param.grad = grad

    def buffers_back() -> None:
        for module, name, buffer, version, value in buffers:
            if module._buffers.get(name) is not buffer:
                module._buffers[name] = buffer  # replaced by a new tensor (a rotary cache, say)
            if buffer._version != version:
                if value is None:
                    logger.warning(
                        "plan_for_budget: buffer %s changed while measuring and is too large to restore", name
                    )
                else:
                    with torch.no_grad():
                        buffer.copy_(value)

    def numbers_back() -> None:
        for module, key, value in numbers:
            if vars(module).get(key) != value:
                object.__setattr__(module, key, value)

    def rng_back() -> None:
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    def counters_back() -> None:
        state.offloader.stats.clear()
        state.offloader.stats.update(offload_stats)
        for index, stats in swap_stats.items():
            if index in state.swapper.layers:
                state.swapper.layers[index].stats = stats
        state.swapper.peak_resident_bytes = swap_peak

    def config_back() -> None:
        state.replan(config, off_by=off_by, cause="plan_for_budget() (restoring)")

    try:
        yield
    finally:
        failures = []
        for restore in (grads_back, buffers_back, numbers_back, rng_back, counters_back, config_back):
            try:
                restore()
            except Exception as err:
                failures.append(err)
        if failures:
            raise failures[0]


def _small_copy(buffer: torch.Tensor) -> torch.Tensor | None:
    """A host copy of a buffer to restore it from, unless it is large (weights kept as buffers)."""
    if buffer.numel() * buffer.element_size() > _BUFFER_COPY_LIMIT:
        return None
    return buffer.detach().to("cpu", copy=True)


# -- choosing ---------------------------------------------------------------------------------

# A combination: device bytes counted so far, bytes still owed if its last checkpointed layer is
# offloaded and no later layer is checkpointed (that input then stays on the device), time, the
# policies chosen so far.
_State = tuple[int, int, float, tuple[str, ...]]


def _front(profiles: Sequence[LayerProfile], options: Sequence[Sequence[str]]) -> list[_State]:
    """Every combination that no other beats in bytes and time, layer by layer."""
    last = len(profiles) - 1
    front: list[_State] = [(0, 0, 0.0, ())]
    for profile, names in zip(profiles, options, strict=True):
        grown = []
        for name in names:
            cost = policy(name).cost(profile)
            if not policy(name).checkpointed:
                grown += [(b + cost.device_bytes, owed, t + cost.seconds, (*c, name)) for b, owed, t, c in front]
                continue
            # A checkpointed layer settles what the previous one owed. An offloaded layer owes its
            # input, except the last layer, whose measurement already has its input on the device.
            # (What it owes is what went to the host: an input under offload_min_bytes never left.)
            owes = min(profile.input_bytes, cost.host_bytes) if name == "offload" and profile.index != last else 0
            grown += [(b + cost.device_bytes, owes, t + cost.seconds, (*c, name)) for b, _, t, c in front]
        front = _undominated(grown)
    return front


def _undominated(states: list[_State]) -> list[_State]:
    """Per amount owed: sorted by bytes, each strictly faster than every state with fewer bytes
    (of two states as fast, the one holding less serves every budget the other does)."""
    kept: list[_State] = []
    for owed in sorted({s[1] for s in states}):
        group: list[_State] = []
        for state in sorted((s for s in states if s[1] == owed), key=lambda s: (s[0], s[2])):
            if not group or state[2] < group[-1][2]:
                group.append(state)
        if len(group) > _FRONT_LIMIT:  # thin evenly; the ends (least bytes, fastest) always stay
            step = len(group) / _FRONT_LIMIT
            group = [group[int(i * step)] for i in range(_FRONT_LIMIT)] + [group[-1]]
        kept += group
    return kept


def _fastest_fitting(
    front: list[_State],
    profiles: Sequence[LayerProfile],
    budget: int,
    outside: dict[bool, int],
    names: Sequence[str],
    alone: dict[int, tuple[int, int]],
) -> list[LayerChoice] | None:
    """The fastest combination whose device bytes, with what it owes and what is held outside the
    layers, fit `budget`; on equal time, the one that holds more (fewer layers recomputed).
    `alone`: what each layer holds when none is checkpointed ({} if that map is not offered)."""
    fitting = [state for state in front if _total(state, outside, alone) <= budget]
    if not fitting:
        return None
    _, _, _, chosen = min(fitting, key=lambda s: (s[2], -(s[0] + s[1])))
    predicted = _predict(profiles, chosen, names)
    if not _checkpoints(chosen):
        predicted = [LayerChoice(c.index, c.name, c.policy, *alone[c.index], c.seconds) for c in predicted]
    return predicted


def _total(state: _State, outside: dict[bool, int], alone: dict[int, tuple[int, int]]) -> float:
    """A combination's device bytes, with what it owes and the bytes held outside the layers."""
    bytes_, owed, _, chosen = state
    if not _checkpoints(chosen):  # priced by the run with nothing checkpointed, if it was offered
        return outside[False] + sum(d for d, _ in alone.values()) if len(alone) == len(chosen) else float("inf")
    return bytes_ + owed + outside[True]


def _checkpoints(chosen: Sequence[str]) -> bool:
    return any(policy(name).checkpointed for name in chosen)


def _predict(profiles: Sequence[LayerProfile], chosen: Sequence[str], names: Sequence[str]) -> list[LayerChoice]:
    out = []
    for profile, name in zip(profiles, chosen, strict=True):
        cost = policy(name).cost(profile)
        out.append(
            LayerChoice(profile.index, names[profile.index], name, cost.device_bytes, cost.host_bytes, cost.seconds)
        )
    checkpointed = [c for c in out if policy(c.policy).checkpointed]
    if checkpointed and checkpointed[-1].policy == "offload" and checkpointed[-1].index != len(out) - 1:
        # The last checkpointed layer's input stays on the device (measured on the last layer only).
        last = checkpointed[-1]
        moved = min(profiles[last.index].input_bytes, last.host_bytes)
        out[last.index] = LayerChoice(
            last.index, last.name, last.policy, last.device_bytes + moved, last.host_bytes - moved, last.seconds
        )
    return out
