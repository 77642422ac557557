"""The peak of a whole training step as torch's `MemTracker` counts it (`scope="step"`): every storage alive on the
device (`remat.measure.LiveStorages`), without `MemTracker`'s attribution to modules, which made a step of the
benchmark's small preset ~15x slower. The suite checks it against `MemTracker` (tests/independent_memory.py)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..measure import LiveStorages

# For `ProfileOptions.optimizer`: measure the step's peak with no optimizer to step (a budget whose wrapper
# knows no optimizer plans the whole step all the same, and says its peak has no optimizer state).
WITHOUT_OPTIMIZER: Any = type("WithoutOptimizer", (), {"__repr__": lambda self: "WITHOUT_OPTIMIZER"})()
NO_OPTIMIZER_NOTE = "step peak: weights, gradients and activations; no optimizer state (none known)"
"""A profile measured `WITHOUT_OPTIMIZER` says so in its notes (its printouts and its refusals)."""


class StepPeak:
    """With an optimizer: a context for one measured step under a live count that also takes the optimizer's step, its
    state made first (as in every step after the first), then puts the parameters and the optimizer's state back (an
    MoE router's choices depend on the weights). `extra(report)`: the peak beyond the held activations until the
    optimizer steps; `optimizer_peak`: the optimizer step's own (`optimizer_steps`)."""

    def __init__(self, model: nn.Module, batch: Mapping[str, Any], optimizer: Any, device: torch.device):
        self.model, self.batch, self.optimizer, self.device = model, batch, optimizer, device
        self.tracker: Any = None
        self.fixed = 0  # bytes alive through any step on the device: weights, buffers, the optimizer's state
        self.gradients = 0  # the trainable weights' gradients' bytes on the device, which no token count changes
        self.optimizer_peak = 0  # the most any measured optimizer step peaked at (0: none measured)
        self._backward_peak: int | None = None  # the step's peak before its optimizer stepped

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Any]:
        optimizer = self.optimizer
        if optimizer is None:
            yield None
            return
        if optimizer is WITHOUT_OPTIMIZER:  # the step's peak all the same: weights, gradients, activations
            self.fixed = self._fixed([])
            self.tracker = LiveStorages(peak_on=self.device, known=self._known([]))
            with self.tracker:
                yield None
            return
        saved_state = copy.deepcopy(optimizer.state_dict())
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved = [p.detach().to("cpu", copy=True) for p in params]
        with _step_hooks_held(optimizer):
            if any(p not in optimizer.state for p in params if p.requires_grad):
                _make_state(optimizer, params)
            state = [t for values in optimizer.state.values() for t in values.values() if isinstance(t, torch.Tensor)]
            self.fixed = self._fixed(state)
            self.tracker = LiveStorages(peak_on=self.device, known=self._known(state))
            try:
                with self.tracker:
                    yield optimizer
            finally:
                with torch.no_grad():
                    for param, value in zip(params, saved, strict=True):
                        param.copy_(value)
                optimizer.load_state_dict(saved_state)

    def _known(self, state: list[torch.Tensor]) -> list[torch.Tensor]:
        """What exists before the step: weights, buffers, gradients, the optimizer's `state`, the batch."""
        known = [*self.model.parameters(), *self.model.buffers(), *state, *self.batch.values()]
        known += [p.grad for p in self.model.parameters() if p.grad is not None]
        return [t for t in known if isinstance(t, torch.Tensor)]

    def _fixed(self, state: list[torch.Tensor]) -> int:
        """The bytes on the device that no batch changes (the batch and gradients left out; `gradients` counted)."""
        trained = [p for p in self.model.parameters() if p.requires_grad and p.device.type == self.device.type]
        self.gradients = sum(p.numel() * p.element_size() for p in trained)
        known = [*self.model.parameters(), *self.model.buffers(), *state]
        return LiveStorages(peak_on=self.device, known=known).current

    def optimizer_steps(self) -> None:
        """Called before the optimizer's step: the peak so far is backward's, and the step's own (weights, gradients,
        state and its temporaries, the activations freed) is kept apart. A map's peak is the larger of the two, and
        only backward's grows with the tokens: taken as one, a profile whose short steps peaked in the optimizer
        priced steps of 2x its tokens flat (1.11-1.30x under on a full fine-tune)."""
        if self.tracker is not None:
            self._backward_peak, self.tracker.peak = self.tracker.peak, self.tracker.current

    def extra(self, report: Any) -> int | None:
        if self.tracker is None:
            return None
        peak, self.tracker = self.tracker.peak, None
        if (backward := self._backward_peak) is not None:
            self.optimizer_peak, self._backward_peak = max(self.optimizer_peak, peak), None
            peak = backward
        return peak - report.device_bytes


@contextlib.contextmanager
def _step_hooks_held(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The optimizer's own step hooks (an EMA of the weights, a step counter) do not see the measuring steps, whose
    parameters and state are put back: each stands aside (a no-op in its place, so order and handles hold) and comes
    back unless its handle removed it meanwhile. (torch's global optimizer hooks are not remat's to hold.)"""
    held = {}
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if isinstance(hooks := getattr(optimizer, name, None), dict):
            held[name] = dict(hooks)
            hooks.update(dict.fromkeys(hooks, lambda *_: None))
    try:
        yield
    finally:
        for name, saved in held.items():
            hooks = getattr(optimizer, name)
            hooks.update({key: hook for key, hook in saved.items() if key in hooks})


def _make_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """One optimizer step on zero gradients, so that its state exists (what it moves is put back)."""
    grads = [p.grad for p in params]
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
