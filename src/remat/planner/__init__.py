"""The planner: measure a profile once, then choose maps for any budget without running the model.

    profile = cm.profile(batch)                  # a few training steps, with a progress bar
    planned = profile.plan("6GiB")               # the fastest map whose held activations fit
    planned = profile.plan("20GiB", scope="step", tokens=8192)   # (scope="step" needs optimizer=)
    profile.frontier(); profile.plot()           # every undominated map; a matplotlib Figure

Four rooms with one job each:

- `measuring`: the training steps (bytes per layer and policy; the step's peak, in `peak`; time
  as counted FLOPs times a measured rate, in `timing`), and putting the model back as it was.
- `chooser`: a pure function of the measurements (no torch, no model): every undominated
  combination of per-layer policies, the fastest one that fits a budget, the frontier.
- `profile`: `Profile` (measurements + `plan` / `frontier` / `plot`) and `PlannedConfig`, the
  `CheckpointConfig` a plan is, which remembers its prediction and prints it.
- `state`: `ModelState`, the state of the model a profile holds for: a plan from a profile of
  another state is refused (`StaleProfileError`, a ValueError naming what changed).

The planner is handed the wrapper's controller (`remat.controller.Controller`), never the
wrapper: data flows down from `remat.model`.

What a plan promises: its predicted held activations (`planned.predicted_device_bytes`), and
with `scope="step"` the peak of a whole step as `MemTracker` counts it (`predicted_peak_bytes`),
match a measurement of the planned map within a few percent and fit the budget. How time is
priced: `timing`; what profiling costs: `measuring` and the README.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from .chooser import LayerChoice, Measurements, Outside, Plan, StepMemory
from .measuring import Controlled, ProfileOptions, check_measurable, measure
from .profile import PlannedConfig, Profile
from .state import ModelState


def profile_model(state: Controlled, batch: Mapping[str, Any], options: ProfileOptions) -> Profile:
    """Measure the controller's model on `batch` (see `remat.planner.measuring`) and return the
    `Profile`. Refuses before any work what cannot be measured."""
    batch = dict(batch)
    check_measurable(state, batch, options.loss_fn, "profile")
    config = state.config
    measured = ModelState.of(state.model, config, len(state.checkpoint_map))
    started = time.perf_counter()
    measurements, notes = measure(state, batch, options)
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


__all__ = [
    "LayerChoice",
    "Measurements",
    "ModelState",
    "Outside",
    "Plan",
    "PlannedConfig",
    "Profile",
    "ProfileOptions",
    "StepMemory",
    "profile_model",
]
