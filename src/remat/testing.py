"""Test doubles and checks for code that uses remat, as `torch.testing` is for torch (remat itself never imports this
module): a transport played on the CPU, and a plan's bytes counted on a real step."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .arguments import check_optimizer
from .compat.transformers_compat import has_activation_checkpointing_names
from .errors import ConfigError
from .loss import LossFn, check_step_batch, step_loss
from .measure import held_bytes_after, weight_storages
from .transport import CpuTransport, Event, TensorMeta

_NO_HOOK = SimpleNamespace(remove=lambda: None)  # a hook handle whose removal changes nothing


def trainer_checkpointing_args(enabled: bool = True, kwargs: dict | None = None) -> dict[str, Any]:
    """The `TrainingArguments` keywords asking Trainer for checkpointing on this transformers (renamed in 5.23)."""
    prefix = "activation" if has_activation_checkpointing_names() else "gradient"
    return {f"{prefix}_checkpointing": enabled, f"{prefix}_checkpointing_kwargs": kwargs}


def _batch_device(batch: Mapping[str, Any], what: str) -> torch.device:
    check_step_batch(batch, what)
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    if not tensors:
        raise ConfigError("the batch holds no tensor: pass the dict of tensors the model is called with")
    return tensors[0].device


def measure_held_activations(model: nn.Module, batch: Mapping[str, Any], *, loss_fn: LossFn | None = None) -> int:
    """The bytes forward leaves alive for backward on the batch's device, as remat counts them (`remat.measure`;
    weights, buffers and host copies not counted): compare with a plan's `predicted_device_bytes`
    (`scope="activations"`), e.g. `cm.enable(planned); assert measure_held_activations(cm, batch) <=
    planned.planned_budget`. Runs one step; gradients are cleared after."""
    device = _batch_device(batch, "measure_held_activations")
    loss, held = held_bytes_after(lambda: step_loss(model, batch, loss_fn), weight_storages(model), device)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


def measure_step_peak(
    model: nn.Module, batch: Mapping[str, Any], optimizer: Optimizer | None = None, *, loss_fn: LossFn | None = None
) -> int:
    """The peak bytes on the batch's device of one real training step (forward, backward, the `optimizer`'s step) as
    `MemTracker` counts them, also with frozen parameters, where `MemTracker` alone fails: compare with a plan's
    `predicted_peak_bytes` (`scope="step"`). An optimizer with no state first takes an uncounted step to make it, as
    remat predicts a step after the first. Gradients are cleared after."""
    from torch.distributed._tools.mem_tracker import MemTracker

    device = _batch_device(batch, "measure_step_peak")
    optimizer = check_optimizer(optimizer)
    optimizers = [optimizer] if optimizer is not None else []
    if optimizer is not None and not optimizer.state:
        step_loss(model, batch, loss_fn).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, *optimizers, *(v for v in batch.values() if isinstance(v, torch.Tensor)))
    with tracker:
        for parameter in model.parameters():
            # MemTracker hooks every gradient, and torch refuses a hook on a frozen parameter (LoRA):
            # handles that remove nothing change nothing it counts. Checked against torch 2.13.
            if not parameter.requires_grad:
                tracker._param_to_grad_hook_handles[parameter] = (_NO_HOOK, _NO_HOOK)
        step_loss(model, batch, loss_fn).backward()
        for each in optimizers:
            each.step()
    for each in optimizers:
        each.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return int(tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0))


class SimulatedTransport(CpuTransport):
    """A device/host pair played on the CPU: `handles` every tensor, so "offload" moves inputs through it as on an
    accelerator, with real copies logged in order, pinning that can be made to fail, and a count of its buffers still
    alive (host memory given back)."""

    def __init__(self, *, pin_fails: bool = False):
        self.pin_fails = pin_fails
        self.log: list[tuple[str, int | None]] = []  # ("to_host" | "to_device", layer) or ("fetch", None)
        self.allocations = self.cache_emptied = 0
        self.live_when_emptied: list[int] = []  # allocated buffers alive at each return_freed_host_memory
        self._allocated: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> buffer, dropped when it dies

    def handles(self, tensor: torch.Tensor) -> bool:
        return True

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        if self.pin_fails:
            raise RuntimeError("simulated: cannot pin host memory")
        self.allocations += 1
        buffer = super().allocate_host(nbytes)
        key = id(buffer)
        self._allocated[key] = weakref.ref(buffer, lambda _, key=key: self._allocated.pop(key, None))
        return buffer

    def live_buffers(self) -> int:
        """How many buffers `allocate_host` gave out that something still references."""
        return sum(ref() is not None for ref in list(self._allocated.values()))

    def return_freed_host_memory(self) -> None:
        self.cache_emptied += 1
        self.live_when_emptied.append(self.live_buffers())

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        event = super().to_host(src, dst, layer)
        self.log.append(("to_host", layer))
        return event

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        self.log.append(("to_device", layer))
        return super().to_device(src, meta, layer)

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        event = super().fetch(dst, src)
        self.log.append(("fetch", None))
        return event
