"""Models placed by accelerate's big-model tools (`device_map`, `dispatch_model`, `cpu_offload`, `disk_offload`):
an offloaded weight is a `meta` tensor at rest, loaded onto its layer's execution device by the module's
`_hf_hook` (an `AlignDevicesHook`) for each forward and put back to meta after it. So the first parameter does not
say where the model computes, and such a weight cannot be swapped; read here, without importing accelerate."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def compute_device(model: nn.Module) -> torch.device:
    """Where the model's layers compute: an accelerator any parameter is on or any accelerate hook loads weights
    onto, else the CPU (a weight accelerate offloads is on `meta` at rest: measured there, a step held 0 bytes)."""
    for param in model.parameters():
        if param.device.type not in ("cpu", "meta"):
            return param.device
    for hook in _hooks(model):
        device = getattr(hook, "execution_device", None)
        if device is not None and (device := torch.device(device)).type not in ("cpu", "meta"):
            return device
    return torch.device("cpu")


def offloads_weights(module: nn.Module) -> bool:
    """Whether accelerate loads weights of `module` (or of a submodule) at each forward and offloads them after."""
    return any(getattr(hook, "offload", False) is True for hook in _hooks(module))


def _hooks(module: nn.Module) -> Iterator[Any]:
    """accelerate's hooks on `module` and its submodules (a `SequentialHook`'s one by one)."""
    for sub in module.modules():
        if (hook := getattr(sub, "_hf_hook", None)) is not None:
            yield from getattr(hook, "hooks", (hook,))
