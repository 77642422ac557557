"""The planner: measure a profile once, then choose maps for any budget without running the model.

    profile = cm.profile(batch)                  # a few training steps, with a progress bar
    planned = profile.plan("6GiB")               # the fastest map whose held activations fit
    planned = profile.plan("20GiB", scope="step", tokens=8192)   # (scope="step" needs optimizer=)
    profile.frontier(); profile.plot()           # every undominated map; a matplotlib Figure
    planned = cm.plan_for_budget(batch, "6GiB")  # the one-line form: profile, then plan

Four rooms with one job each:

- `measuring`: the training steps (bytes per layer and policy from `remat.report`, at two
  lengths when the batch is plain text; the step's peak counted as torch's `MemTracker` counts it, in `peak`;
  time as counted FLOPs times a measured rate, in `timing`), and putting the model back as it was
  afterwards (`remat.snapshot`).
- `chooser`: a pure function of the measurements (no torch, no model): every undominated
  combination of per-layer policies, the fastest one that fits a budget, the frontier.
- `profile`: `Profile` (measurements + `plan` / `frontier` / `plot`) and `PlannedConfig`, the
  `CheckpointConfig` a plan is, which remembers its prediction and prints it.
- `state`: `ModelState`, the state of the model a profile holds for (dtypes, devices, trainable
  parameters, adapters, swapped layers, the settings that change a measurement): a plan from a
  profile of another state is refused (`StaleProfileError`, a ValueError naming what changed).
  Plans are built on the wrapper's current config, so applying one keeps block swap and offload
  settings made since the profile.

The planner is handed the wrapper's controller (`remat.controller.Controller`), never the
wrapper: data flows down from `remat.model`.

What a plan promises: its predicted held activations (`planned.predicted_device_bytes`) match a
measurement of the planned map within a few percent, and fit the budget; with `scope="step"`,
the same for the peak of a whole step as `MemTracker` counts it (`predicted_peak_bytes`).
Time (`predicted_seconds`) is counts (the FLOPs a recompute repeats) times a rate measured on
the machine, so recompute and none rank alike however busy it was (selective's share is measured,
and moves with the noise); `predicted_seconds_range` is its spread.
For `tokens` other than the profiled batch's, bytes and seconds are scaled in proportion to the
tokens (see `Measurements.scaled`).

Cost: 4 memory steps (one more for offload on an accelerator), the same 4 again at half the
sequence length when the batch is plain text, 2 counted steps (FLOPs) and `repeats` x 3 timed
steps: 19 forwards with the default `repeats=3` (what that costs in steps and seconds: the
README, `python benchmarks/pareto.py --preset small --cost-only`, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ..arguments import parse_bytes, parse_count
from ..errors import ConfigError, ConfigTypeError
from ..loss import LossFn
from ..measure import weight_storages
from .chooser import SCOPES, LayerChoice, Measurements, Outside, Plan, StepMemory
from .measuring import Controlled, check_measurable, measure
from .profile import PlannedConfig, Profile
from .state import ModelState


def profile_model(
    state: Controlled,
    batch: Mapping[str, Any],
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    progress: bool = True,
    repeats: int = 3,
) -> Profile:
    """Measure the controller's model on `batch` (see `remat.planner.measuring`) and return the
    `Profile`. Refuses before any work what cannot be measured."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an int >= 1, got {repeats!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    batch = dict(batch)
    check_measurable(state, batch, loss_fn, "profile")
    config = state.config
    measured = ModelState.of(state.model, config, len(state.checkpoint_map))
    started = time.perf_counter()
    measurements, notes = measure(
        state, batch, loss_fn=loss_fn, optimizer=optimizer, repeats=repeats, progress=progress
    )
    seconds = time.perf_counter() - started
    return Profile(
        measurements, config, tuple(notes), seconds, native_every_n=_native_every_n(), state=measured, wrapper=state
    )


def _native_every_n() -> tuple[int, ...]:
    """The `every_n_layers` transformers' own enable offers on this version (every layer only,
    before 5.16): the native options `profile.plot()` marks."""
    import inspect

    import transformers

    from ..compat.transformers_compat import ENABLE_ROUTES

    routes = [getattr(transformers.PreTrainedModel, name, None) for name in ENABLE_ROUTES]
    takes = any(r is not None and "every_n_layers" in inspect.signature(r).parameters for r in routes)
    return (1, 2, 3, 4) if takes else (1,)


def plan_for_budget(
    state: Controlled,
    batch: Mapping[str, Any],
    budget: int | str,
    *,
    scope: str = "activations",
    tokens: int | None = None,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    progress: bool = True,
    repeats: int = 3,
) -> PlannedConfig:
    """`profile_model(...)` then `profile.plan(budget, scope=scope, tokens=tokens)`. A budget no
    map can meet (zero or negative), an unknown scope, or `scope="step"` without an optimizer is
    refused before measuring."""
    limit = parse_bytes(budget, "budget")
    if limit <= 0:
        raise ConfigError(f"budget must be more than 0 bytes, got {limit}: every map holds something")
    if scope not in SCOPES:
        raise ConfigError(f"scope must be one of {SCOPES}, got {scope!r}")
    if scope == "step":
        if optimizer is None:
            raise ConfigError('scope="step" bounds the whole training step, optimizer included: pass optimizer=')
        weights = _device_weight_bytes(state)
        if limit < weights:
            raise ConfigError(
                f"no map fits a step budget of {limit} bytes ({limit / 2**20:.1f} MiB): the weights alone take "
                f"{weights} bytes ({weights / 2**20:.1f} MiB) on the device; give a larger budget"
            )
    if tokens is not None:
        parse_count(tokens, "tokens", "batch x sequence length")
    found = profile_model(state, batch, loss_fn=loss_fn, optimizer=optimizer, progress=progress, repeats=repeats)
    return found.plan(limit, scope=scope, tokens=tokens)


def _device_weight_bytes(state: Controlled) -> int:
    """Parameters and buffers resident on the model's device (swapped weights wait on the host)."""
    return sum(weight_storages(state.model, next(state.model.parameters()).device).values())


__all__ = [
    "LayerChoice",
    "Measurements",
    "ModelState",
    "Outside",
    "Plan",
    "PlannedConfig",
    "Profile",
    "StepMemory",
    "plan_for_budget",
    "profile_model",
]
