"""`cm.plan_for_budget(batch, budget)`: the fastest per-layer map whose held activations fit.

How a budget becomes a map:

1. Measure. Each candidate policy runs on every layer at once, on the batch given: one step
   under `memory_report` gives the bytes each layer holds for backward after forward (on the
   device and in host memory) and the bytes held outside the layers (embeddings, logits,
   loss); then the candidates' steps are timed, alternated over `repeats`, medians. A
   forward with a timer on each layer says how the step's time divides among the layers, and a
   policy's extra time is shared out accordingly. What is held outside the layers depends only
   on whether any layer is checkpointed (a checkpoint keeps the position ids it was called
   with), so it is taken from the "none" run for a map without checkpoints, from the others for
   a map with some. Candidates: "none", "selective",
   "recompute", and "offload" only when the model runs on an accelerator (on a CPU model there
   is no device memory for offload to free: it would hold what recompute holds). Swapped layers
   are never "none".
2. Choose. A layer's held bytes depend on its own policy only (the measurement counts a layer's
   input for that layer, whatever produced it), so a map's bytes and time are sums over layers.
   The planner keeps, layer by layer, every combination that is not beaten in both bytes and
   time, and picks the fastest whose device bytes, with the bytes outside the layers, fit the
   budget. One correction is applied exactly: with offload, the input of the last checkpointed
   layer stays on the device (backward needs it first).
3. Hand back a config. The result is a `CheckpointConfig` naming every layer's policy in
   `layer_policies`, like any other config (saved, loaded, re-applied by routes); printing it
   shows the plan: per layer the policy, predicted bytes and time, and the totals.

The measuring leaves the model as it was: config and on/off state, gradients, buffers (an MoE
router's counters) and the RNG state are put back. The prediction is checked in the suite
against `cm.memory_report` after `cm.enable(planned)` (within 5%, and within the budget).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .arguments import parse_bytes
from .config import CheckpointConfig
from .display import render_table
from .policies import LayerProfile, policy

if TYPE_CHECKING:
    from .model import CheckpointedModel

CANDIDATES = ("none", "selective", "recompute", "offload")
_FRONT_LIMIT = 20_000  # combinations kept per layer; far above what identical layers produce


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
    from .model import state_of

    limit = parse_bytes(budget, "budget")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    state = state_of(cm)
    if not state.is_enabled or state.inference or not cm.model.training:
        raise RuntimeError("plan_for_budget measures training steps: call cm.enable() and cm.for_training() first")
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
        profiles, outside, base = _measure(cm, dict(batch), candidates, repeats)
    swapped = {p.index for p in state.checkpoint_map if p.swapped}
    options = [[n for n in candidates if not (n == "none" and p.index in swapped)] for p in profiles]
    choices = _choose(profiles, options, limit, outside, [p.name for p in state.checkpoint_map])
    if choices is None:
        smallest = outside[True] + _smallest(profiles, options)
        outside = outside[True]
        raise ValueError(
            f"no map fits a budget of {limit} bytes ({limit / 2**20:.1f} MiB) for this model and batch: the smallest "
            f"is {smallest} bytes ({smallest / 2**20:.1f} MiB), {outside / 2**20:.1f} MiB of it outside the layers "
            "(embeddings, logits, loss), which no checkpointing policy changes"
        )
    planned = config.replace(layer_policies={c.index: c.policy for c in choices}, offload=False)
    checkpointing = any(policy(c.policy).checkpointed for c in choices)
    return PlannedConfig.of(
        planned,
        choices=tuple(choices),
        outside_bytes=outside[checkpointing],
        budget=limit,
        base_seconds=base,
        notes=tuple(notes),
    )


# -- measuring --------------------------------------------------------------------------------


def _measure(
    cm: CheckpointedModel, batch: dict[str, Any], candidates: Sequence[str], repeats: int
) -> tuple[list[LayerProfile], dict[bool, int], float]:
    """Per-layer profiles, the bytes held outside the layers (by whether any layer is
    checkpointed), and the step time with no layer checkpointed."""
    n = len(cm.checkpoint_map)
    base = cm.config.replace(offload=False)
    configs = {name: base.replace(layer_policies=dict.fromkeys(range(n), name)) for name in candidates}
    held: dict[str, list[tuple[int, int]]] = {}
    outside = {False: 0, True: 0}
    for name, config in configs.items():
        cm.enable(config)
        report = cm.memory_report(batch)
        _drop_grads(cm)
        held[name] = [(layer.device_bytes, layer.host_bytes) for layer in report.layers]
        checkpointing = any(plan.checkpointed for plan in cm.checkpoint_map)  # swapped layers always are
        outside[checkpointing] = max(outside[checkpointing], report.outside_device_bytes)
    outside[False] = outside[False] or outside[True]
    cm.enable(configs["none"])
    shares = _forward_shares(cm, batch)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, config in configs.items():
            cm.enable(config)
            times[name].append(_timed_step(cm, batch))
    medians = {name: statistics.median(values) for name, values in times.items()}
    inputs = held.get("recompute", held[candidates[-1]])
    profiles = [
        LayerProfile(
            index=i,
            input_bytes=inputs[i][0] + inputs[i][1],
            held={name: held[name][i] for name in candidates},
            seconds={name: max(0.0, medians[name] - medians["none"]) * shares[i] for name in candidates},
        )
        for i in range(n)
    ]
    return profiles, outside, medians["none"]


def _timed_step(cm: CheckpointedModel, batch: dict[str, Any]) -> float:
    device = next(cm.model.parameters()).device
    _synchronize(device)
    start = time.perf_counter()
    cm(**batch).loss.backward()
    _synchronize(device)
    seconds = time.perf_counter() - start
    _drop_grads(cm)
    return seconds


def _forward_shares(cm: CheckpointedModel, batch: dict[str, Any]) -> list[float]:
    """How one forward's time divides among the layers (timers on each layer's entry and exit)."""
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
    try:
        with torch.no_grad():
            cm(**batch)
    finally:
        for handle in handles:
            handle.remove()
    total = sum(spent)
    return [s / total if total > 0 else 1 / len(spent) for s in spent]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drop_grads(cm: CheckpointedModel) -> None:
    for param in cm.model.parameters():
        param.grad = None


@contextlib.contextmanager
def _left_as_it_was(cm: CheckpointedModel) -> Iterator[None]:
    """Measuring runs training steps: put back the config and on/off state, gradients, buffers
    and the RNG state, whatever happens."""
    from .model import state_of

    state = state_of(cm)
    config, off_by = state.config, state.off_by
    grads = [(p, p.grad) for p in cm.model.parameters()]
    buffers = [(b, b.detach().clone()) for b in cm.model.buffers()]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    _drop_grads(cm)
    try:
        yield
    finally:
        state.replan(config, off_by=off_by, cause="plan_for_budget() (restoring)")
        for param, grad in grads:
            param.grad = grad
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


# -- choosing ---------------------------------------------------------------------------------


def _smallest(profiles: Sequence[LayerProfile], options: Sequence[Sequence[str]]) -> int:
    return sum(
        min(policy(name).cost(p).device_bytes for name in names) for p, names in zip(profiles, options, strict=True)
    )


def _choose(
    profiles: Sequence[LayerProfile],
    options: Sequence[Sequence[str]],
    budget: int,
    outside: dict[bool, int],
    names: Sequence[str],
) -> list[LayerChoice] | None:
    """The fastest combination whose predicted device bytes, with those held outside the
    layers, fit `budget` (None if none does).

    A front of combinations, extended layer by layer, keeping only those no other combination
    beats in both bytes and time. Its members are then tried from the most bytes (the fastest)
    down, with the exact prediction (the offload correction), until one fits.
    """
    front: list[tuple[int, float, tuple[str, ...]]] = [(0, 0.0, ())]
    for profile, names_here in zip(profiles, options, strict=True):
        costs = [(name, policy(name).cost(profile)) for name in names_here]
        grown = [(b + c.device_bytes, t + c.seconds, (*chosen, name)) for b, t, chosen in front for name, c in costs]
        front = _undominated(grown)
    for _, _, chosen in sorted(front, key=lambda s: (-s[0], s[1])):
        picked = _predict(profiles, chosen, names)
        checkpointing = any(policy(c.policy).checkpointed for c in picked)
        if outside[checkpointing] + sum(c.device_bytes for c in picked) <= budget:
            return picked
    return None


def _undominated(states: list[tuple[int, float, tuple[str, ...]]]) -> list[tuple[int, float, tuple[str, ...]]]:
    """Sorted by bytes, each strictly faster than every state with fewer bytes."""
    kept: list[tuple[int, float, tuple[str, ...]]] = []
    for state in sorted(states, key=lambda s: (s[0], s[1])):
        if not kept or state[1] < kept[-1][1]:
            kept.append(state)
    if len(kept) > _FRONT_LIMIT:  # thin evenly; the ends (least bytes, fastest) always stay
        step = len(kept) / _FRONT_LIMIT
        kept = [kept[int(i * step)] for i in range(_FRONT_LIMIT)] + [kept[-1]]
    return kept


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
        moved = profiles[last.index].input_bytes
        out[last.index] = LayerChoice(
            last.index, last.name, last.policy, last.device_bytes + moved, max(0, last.host_bytes - moved), last.seconds
        )
    return out
