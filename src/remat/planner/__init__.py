"""The planner: measure a profile once (`cm.profile(batch)`), then choose maps for any budget without
running the model. `measuring` runs the steps (the peak in `peak`, time in `timing`); `chooser` is a
pure function of the measurements; `profile` holds them (`Profile`, `PlannedConfig`); `state` refuses
a plan for a model changed since. It is handed the wrapper's controller, never the wrapper."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..compat.transformers_compat import native_every_n
from ..head import every_label_counted
from .chooser import LayerChoice, Measurements
from .measuring import Controlled, ProfileOptions, check_measurable, measure
from .profile import PlannedConfig, Profile
from .state import ModelState


def profile_model(state: Controlled, batch: Mapping[str, Any], options: ProfileOptions) -> Profile:
    """Measure the controller's model on `batch` (`remat.planner.measuring`), refusing first what cannot be."""
    check_measurable(state, batch, options.loss_fn)  # (a dict of the model's inputs first)
    config = state.config
    batch = every_label_counted(batch) if config.head == "chunked" else dict(batch)
    measured = ModelState.of(state.model, config, len(state.checkpoint_map))
    started = time.perf_counter()
    measurements, notes = measure(state, batch, options)
    seconds = time.perf_counter() - started
    return Profile(measurements, config, tuple(notes), seconds, native_every_n(), state=measured, wrapper=state)


__all__ = ["LayerChoice", "Measurements", "ModelState", "PlannedConfig", "Profile", "ProfileOptions", "profile_model"]
