"""How a plan is put on one module, and taken off again.

Three kinds of module, one interface (`set(enabled, function)`, `restore()`), all on the
instance and all undone by `restore()`:

- `FlagInstall`, for transformers' `GradientCheckpointingLayer`s: set the layer's own
  `gradient_checkpointing` flag and `_gradient_checkpointing_func`. transformers then calls the
  function with the layer's forward (from `__call__` before 5.23, from `forward` since) and drops
  the KV cache for the step, as it always does.
- `ForwardInstall`, for plain blocks (remote code, old-format models): replace `forward` on the
  instance with one that checkpoints through the function while training with gradients, and
  drops the KV-cache arguments the way transformers does for its own layers.
- `HolderInstall`, for modules that only carry the flag: transformers reads it to turn
  `use_cache` off while training. Their function is a pass-through, so a holder whose loop calls
  `self._gradient_checkpointing_func(layer.__call__, ...)` never nests a checkpoint around a
  layer; a holder whose code calls torch's checkpoint itself keeps its flag off.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
from torch import nn

from .layers import DiscoveredLayer, calls_checkpoint_directly
from .recompute import run_without_checkpoint

logger = logging.getLogger("remat")

_FLAG = "gradient_checkpointing"
_FUNC = "_gradient_checkpointing_func"
_MISSING = object()
# The KV-cache arguments transformers' own layers drop while checkpointing, with their "off" values.
_CACHE_ARGUMENTS = {
    "use_cache": False,
    "past_key_value": None,
    "past_key_values": None,
    "layer_past": None,
    "cache": None,
}
_warned: set[str] = set()


def _restore_attributes(module: Any, saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if value is _MISSING:
            module.__dict__.pop(key, None)
        else:
            object.__setattr__(module, key, value)


class InstancePatches:
    """Attributes set on single instances (never on a class), remembered so `undo()` puts each
    back exactly as it was, absent ones included."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, target: Any, name: str, value: Any) -> None:
        self._saved.append((target, name, target.__dict__.get(name, _MISSING)))
        # object.__setattr__ keeps these out of nn.Module's parameter/buffer bookkeeping.
        object.__setattr__(target, name, value)

    def undo(self) -> None:
        for target, name, previous in reversed(self._saved):
            _restore_attributes(target, {name: previous})
        self._saved.clear()


class FlagInstall:
    """A GradientCheckpointingLayer: drive its own flag and function."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.saved = {key: module.__dict__.get(key, _MISSING) for key in (_FLAG, _FUNC)}

    @property
    def was_checkpointing(self) -> bool:
        return self.saved[_FLAG] is True

    def set(self, enabled: bool, function: Any) -> None:
        # object.__setattr__ keeps these out of nn.Module's parameter/buffer bookkeeping.
        object.__setattr__(self.module, _FLAG, enabled)
        object.__setattr__(self.module, _FUNC, function)

    def restore(self) -> None:
        _restore_attributes(self.module, self.saved)


class HolderInstall(FlagInstall):
    """A module that holds the flag for its layers: on only where that cannot nest a checkpoint."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.safe = not calls_checkpoint_directly(module)

    def set(self, enabled: bool, function: Any) -> None:
        super().set(enabled and self.safe, run_without_checkpoint)


class ForwardInstall:
    """A plain block: its forward, replaced on the instance, checkpoints through `function`."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.saved = {"forward": module.__dict__.get("forward", _MISSING)}
        self.original = module.forward
        self.first_parameter = next(iter(inspect.signature(self.original).parameters), None)
        self.enabled = False
        self.function: Any = run_without_checkpoint
        run = self._forward

        @functools.wraps(self.original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return run(*args, **kwargs)

        self.wrapper = forward
        object.__setattr__(module, "forward", forward)

    @property
    def was_checkpointing(self) -> bool:
        return False

    def set(self, enabled: bool, function: Any) -> None:
        self.enabled, self.function = enabled, function

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.enabled and self.module.training and torch.is_grad_enabled()):
            return self.original(*args, **kwargs)
        dropped = [k for k, off in _CACHE_ARGUMENTS.items() if kwargs.get(k) not in (None, off)]
        for key in dropped:
            kwargs[key] = _CACHE_ARGUMENTS[key]
        if dropped and type(self.module).__name__ not in _warned:
            _warned.add(type(self.module).__name__)
            logger.warning(
                "%s: the KV cache is incompatible with checkpointing while training; set %s",
                type(self.module).__name__,
                ", ".join(f"{k}={_CACHE_ARGUMENTS[k]}" for k in dropped),
            )
        if not args and self.first_parameter in kwargs:
            # The checkpoint saves (and offload moves) positional inputs: pass the hidden states so.
            args = (kwargs.pop(self.first_parameter),)
        return self.function(functools.partial(self.original, **kwargs), *args)

    def restore(self) -> None:
        # Switched off even if something patched `forward` after remat and still calls this wrapper.
        self.enabled, self.function = False, run_without_checkpoint
        if self.module.__dict__.get("forward") is self.wrapper:
            _restore_attributes(self.module, self.saved)


def installer_for(discovered: DiscoveredLayer) -> FlagInstall | ForwardInstall:
    if discovered.kind == "wrap":
        return ForwardInstall(discovered.module)
    if discovered.kind == "holder":
        return HolderInstall(discovered.module)
    return FlagInstall(discovered.module)
