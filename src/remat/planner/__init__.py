"""The planner: measure a profile once, then choose maps for any budget without running the model.

    profile = cm.profile(batch)                  # a few training steps, with a progress bar
    planned = profile.plan("6GiB")               # the fastest map whose held activations fit
    planned = profile.plan("20GiB", scope="step", tokens=8192)   # (scope="step" needs optimizer=)
    profile.frontier(); profile.plot()           # every undominated map; a matplotlib Figure

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

from .chooser import LayerChoice, Measurements, Outside, Plan, StepMemory
from .measuring import Controlled, ProfileOptions, check_measurable, measure
from .profile import PlannedConfig, Profile
from .state import ModelState, StaleProfileError


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

    from ..integrations.transformers_compat import ENABLE_ROUTES

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
    "StaleProfileError",
    "StepMemory",
    "profile_model",
]
