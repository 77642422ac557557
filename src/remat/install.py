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

from .compat.transformers_compat import CACHE_ARGUMENTS, LAYER_FLAG, LAYER_FUNCTION
from .layers import DiscoveredLayer, calls_checkpoint_directly
from .patches import MISSING, restore_attributes
from .recompute import run_without_checkpoint
from .refs import Ref

logger = logging.getLogger("remat")

_warned: set[str] = set()


class _Installed:
    """Holds the module it installs on weakly (see `remat.refs`)."""

    def __init__(self, module: nn.Module):
        self._module = Ref(module)

    @property
    def module(self) -> nn.Module:
        return self._module.alive("a layer of the wrapped model no longer exists; wrap the model you train")


class FlagInstall(_Installed):
    """A GradientCheckpointingLayer: drive its own flag and function."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.saved = {key: module.__dict__.get(key, MISSING) for key in (LAYER_FLAG, LAYER_FUNCTION)}

    @property
    def was_checkpointing(self) -> bool:
        return self.saved[LAYER_FLAG] is True

    def set(self, enabled: bool, function: Any) -> None:
        # object.__setattr__ keeps these out of nn.Module's parameter/buffer bookkeeping.
        object.__setattr__(self.module, LAYER_FLAG, enabled)
        object.__setattr__(self.module, LAYER_FUNCTION, function)

    def restore(self) -> None:
        if self._module() is not None:
            restore_attributes(self.module, self.saved)


class HolderInstall(FlagInstall):
    """A module that holds the flag for its layers: on only where that cannot nest a checkpoint."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.safe = not calls_checkpoint_directly(module)

    def set(self, enabled: bool, function: Any) -> None:
        super().set(enabled and self.safe, run_without_checkpoint)


class ForwardInstall(_Installed):
    """A plain block: its forward, replaced on the instance, checkpoints through `function`.

    The replacement is a `CheckpointingForward` object naming the module it runs, so a deep copy
    or pickle of the model runs the copy; `nn.DataParallel` copies a module's `__dict__` into
    each replica, so the replica gets a forward of its own (`_replicate_for_data_parallel`)."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.saved = {key: module.__dict__.get(key, MISSING) for key in ("forward", "_replicate_for_data_parallel")}
        self.first_parameter = next(iter(inspect.signature(module.forward).parameters), None)
        self.enabled = False
        self.function: Any = run_without_checkpoint
        self.wrapper = CheckpointingForward(self, module)
        object.__setattr__(module, "forward", self.wrapper)
        object.__setattr__(module, "_replicate_for_data_parallel", _ReplicateWithForward(self, module))

    @property
    def was_checkpointing(self) -> bool:
        return False

    def set(self, enabled: bool, function: Any) -> None:
        self.enabled, self.function = enabled, function

    def original_forward(self, module: nn.Module) -> Any:
        """The forward the module had before remat, bound to `module` (a replica, or the module)."""
        saved = self.saved["forward"]
        return type(module).forward.__get__(module) if saved is MISSING else saved

    def run(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        original = self.original_forward(module)
        if not (self.enabled and module.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        dropped = [k for k, off in CACHE_ARGUMENTS.items() if kwargs.get(k) not in (None, off)]
        for key in dropped:
            kwargs[key] = CACHE_ARGUMENTS[key]
        if dropped and type(module).__name__ not in _warned:
            _warned.add(type(module).__name__)
            logger.warning(
                "%s: the KV cache is incompatible with checkpointing while training; set %s",
                type(module).__name__,
                ", ".join(f"{k}={CACHE_ARGUMENTS[k]}" for k in dropped),
            )
        if not args and self.first_parameter in kwargs:
            # The checkpoint saves (and offload moves) positional inputs: pass the hidden states so.
            args = (kwargs.pop(self.first_parameter),)
        return self.function(functools.partial(original, **kwargs), *args)

    def restore(self) -> None:
        # Switched off even if something patched `forward` after remat and still calls this wrapper.
        self.enabled, self.function = False, run_without_checkpoint
        module = self._module()
        if module is not None and module.__dict__.get("forward") is self.wrapper:
            restore_attributes(module, self.saved)


class _OnTheModule(_Installed):
    """What remat puts on a plain block (its `forward`, its `_replicate_for_data_parallel`). It
    lives on the module, so it holds the module and its `ForwardInstall` (which holds it) weakly:
    no reference cycle through the layer keeps the offloader's host memory alive. The install
    lives as long as the controller that made it, which the model's hooks keep alive."""

    def __init__(self, install: ForwardInstall, module: nn.Module):
        super().__init__(module)
        self._install = Ref(install)

    @property
    def install(self) -> ForwardInstall:
        return self._install.alive(
            "this layer's checkpointing was removed while it was still called; call the model again"
        )


class CheckpointingForward(_OnTheModule):
    """What a plain block's `forward` is while remat wraps it."""

    def __init__(self, install: ForwardInstall, module: nn.Module):
        super().__init__(install, module)
        self.__name__ = "forward"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        install, module = self._install(), self.module
        if install is None:  # remat was disabled, and something that kept this wrapper still calls it
            return type(module).forward(module, *args, **kwargs)
        return install.run(module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))


class _ReplicateWithForward(_OnTheModule):
    """`module._replicate_for_data_parallel()` for a wrapped plain block: torch's replica, whose
    forward runs the replica (the copied `__dict__` would run the original)."""

    def __call__(self) -> nn.Module:
        module = self.module
        replica = type(module)._replicate_for_data_parallel(module)
        object.__setattr__(replica, "forward", CheckpointingForward(self.install, replica))
        return replica


def installer_for(discovered: DiscoveredLayer) -> FlagInstall | ForwardInstall:
    if discovered.kind == "wrap":
        return ForwardInstall(discovered.module)
    if discovered.kind == "holder":
        return HolderInstall(discovered.module)
    return FlagInstall(discovered.module)
