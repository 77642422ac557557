"""Test doubles for remat's device seams, as `torch.testing` is for torch: used by remat's tests
and by anyone testing code that uses remat on a machine without a GPU. remat itself never
imports this module.

`SimulatedTransport` plays a device/host pair on the CPU through the whole transport protocol
(`remat.transport.Transport`): copies are real, so results are exact; every copy is logged in
order; pinning can be made to fail; and the buffers it allocated can be counted while alive,
so a test can check that host memory really is given back.

`measure_held_activations` and `measure_step_peak` check a plan's bytes on a real step of the
map enabled now: the activations a forward leaves for backward, as remat counts them
(`remat.measure`, the count the planner's profile steps were measured with); the peak of a whole
training step as torch's own `MemTracker` counts it. `MemTracker` alone fails on any model with frozen
parameters (a LoRA model: it hooks every parameter's gradient, and torch refuses a hook on a
tensor that does not require grad); `measure_step_peak` gives it no-op handles for those,
which changes nothing it counts (a frozen parameter never gets a gradient). Checked against
torch 2.13.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .compat.transformers_compat import has_activation_checkpointing_names
from .errors import ConfigError
from .measure import held_bytes_after, weight_storages
from .transport import DoneEvent, Event, TensorMeta, as_bytes, from_bytes


def trainer_checkpointing_args(enabled: bool = True, kwargs: dict | None = None) -> dict[str, Any]:
    """The `TrainingArguments` keywords that ask Trainer for checkpointing on this transformers
    version (`activation_checkpointing*` from 5.23, `gradient_checkpointing*` before), for tests
    that run on every supported release."""
    if has_activation_checkpointing_names():
        return {"activation_checkpointing": enabled, "activation_checkpointing_kwargs": kwargs}
    return {"gradient_checkpointing": enabled, "gradient_checkpointing_kwargs": kwargs}


def _default_loss(outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    return outputs.loss


def _batch_device(batch: Mapping[str, Any]) -> torch.device:
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    if not tensors:
        raise ConfigError("the batch holds no tensor: pass the dict of tensors the model is called with")
    return tensors[0].device


def measure_held_activations(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor] = _default_loss,
) -> int:
    """The bytes a forward leaves alive for backward on the batch's device: every storage an op
    made during forward that is still alive once forward returns (each counted once; weights,
    buffers and host copies not counted). Compare it with a plan's `predicted_device_bytes`
    (`scope="activations"`). Runs one forward and backward; gradients are cleared after.

    Example::

        cm.enable(planned)
        assert measure_held_activations(cm, batch) <= planned.budget
    """
    device = _batch_device(batch)
    loss, held = held_bytes_after(lambda: loss_fn(model(**batch), batch), weight_storages(model), device)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


class _NoHook:
    def remove(self) -> None:
        pass


def measure_step_peak(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor] = _default_loss,
) -> int:
    """The peak bytes on the batch's device of one whole training step (forward, backward and,
    given an `optimizer`, its step) as torch's `MemTracker` counts them: weights, gradients,
    optimizer state, the batch and every op's output while alive. Works on LoRA and other models
    with frozen parameters, where `MemTracker` alone fails. Compare it with a plan's
    `predicted_peak_bytes` (`scope="step"`, profiled with the same optimizer).

    This is a real step: the optimizer updates the trainable weights. The count is of a step like
    every one after the first, as remat predicts it: an optimizer with no state yet takes one
    step first, not counted, to make it. Gradients are cleared after.

    Example::

        cm.enable(planned)  # planned = profile.plan("20GiB", scope="step"), profiled with optimizer
        print(measure_step_peak(cm, batch, optimizer), planned.predicted_peak_bytes)
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    device = _batch_device(batch)
    if optimizer is not None and not optimizer.state:
        loss_fn(model(**batch), batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracked = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    tracker.track_external(model, *([optimizer] if optimizer is not None else []), *tracked)
    with tracker:
        for parameter in model.parameters():
            if not parameter.requires_grad:  # MemTracker would hook its gradient; torch refuses
                tracker._param_to_grad_hook_handles[parameter] = (_NoHook(), _NoHook())
        loss = loss_fn(model(**batch), batch)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(snapshot.get(device, {}).get("Total", 0))


class SimulatedTransport:
    """A device/host pair played on the CPU: `handles` every tensor, so the "offload" policy
    moves inputs through it as it would on an accelerator."""

    def __init__(self, *, pin_fails: bool = False):
        self.pin_fails = pin_fails
        # ("to_host" | "to_device", layer index) or ("fetch", None), in order
        self.log: list[tuple[str, int | None]] = []
        self.allocations = 0
        self.cache_emptied = 0
        self.live_when_emptied: list[int] = []  # allocated buffers still alive at each return_freed_host_memory
        self._allocated: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> buffer, dropped when it dies

    def handles(self, tensor: torch.Tensor) -> bool:
        return True

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        if self.pin_fails:
            raise RuntimeError("simulated: cannot pin host memory")
        self.allocations += 1
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        key = id(buffer)
        self._allocated[key] = weakref.ref(buffer, lambda _, key=key: self._allocated.pop(key, None))
        return buffer

    def live_buffers(self) -> int:
        """How many buffers `allocate_host` gave out that something still references."""
        return sum(ref() is not None for ref in list(self._allocated.values()))

    def return_freed_host_memory(self) -> None:
        self.cache_emptied += 1
        self.live_when_emptied.append(self.live_buffers())

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, layer: int) -> Event:
        dst[: src.nbytes].copy_(as_bytes(src))
        self.log.append(("to_host", layer))
        return DoneEvent()

    def to_device(self, src: torch.Tensor, meta: TensorMeta, layer: int) -> tuple[torch.Tensor, Event]:
        self.log.append(("to_device", layer))
        return from_bytes(src.clone(), meta), DoneEvent()

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        dst.copy_(src)
        self.log.append(("fetch", None))
        return DoneEvent()
