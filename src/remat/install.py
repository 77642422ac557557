"""How a plan is put on one module (`set(enabled, function)`) and taken off (`restore()`), on the
instance: a transformers layer's own flag, a plain block's `forward`, or a holder's flag."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from .compat.transformers_compat import CACHE_ARGUMENTS, LAYER_FLAG, LAYER_FUNCTION
from .layers import DiscoveredLayer, calls_checkpoint_directly
from .recompute import run_without_checkpoint
from .refs import MISSING, Ref, restore_attributes

logger = logging.getLogger("remat")

_warned: set[tuple[str, str]] = set()


class _Installed:
    """Holds the module it installs on weakly (see `remat.refs`)."""

    def __init__(self, module: nn.Module):
        self._module = Ref(module)

    @property
    def module(self) -> nn.Module:
        return self._module.alive("a layer of the wrapped model no longer exists; wrap the model you train")


class _WhileGradientsAreOn:
    """A checkpointed layer's flag, true only while gradients are on. transformers before 5.24 asks the flag and
    train mode only, and drops the KV cache for a flagged layer (and holder) even under `no_grad`: generation in train
    mode (TRL's, between steps; a swapped layer stays checkpointed through `gradient_checkpointing_disable()`) ran
    without its cache and gave other tokens (5.17: a crash). 5.24 asks `torch.is_grad_enabled()` itself."""

    def __bool__(self) -> bool:
        return torch.is_grad_enabled()

    def __repr__(self) -> str:
        return "True (while gradients are on)"


CHECKPOINTING = _WhileGradientsAreOn()


class FlagInstall(_Installed):
    """A `GradientCheckpointingLayer`: its own flag and function, which transformers calls. A `holder` (its flag
    turns `use_cache` off) gets a pass-through function, its flag on only where that cannot nest a checkpoint."""

    def __init__(self, module: nn.Module, holder: bool = False):
        super().__init__(module)
        self.saved = {key: module.__dict__.get(key, MISSING) for key in (LAYER_FLAG, LAYER_FUNCTION)}
        if isinstance(self.saved[LAYER_FLAG], _WhileGradientsAreOn):  # a copy of a layer another wrapper flagged
            self.saved = dict.fromkeys(self.saved, MISSING)  # (a deep copy appended): not the model's own, undone
        self.was_checkpointing = self.saved[LAYER_FLAG] is True
        self.holder, self.nests = holder, holder and calls_checkpoint_directly(module)

    def set(self, enabled: bool, function: Any) -> None:
        if self.holder:
            enabled, function = enabled and not self.nests, run_without_checkpoint
        object.__setattr__(self.module, LAYER_FLAG, CHECKPOINTING if enabled else False)  # not in nn.Module's books
        object.__setattr__(self.module, LAYER_FUNCTION, function)

    def restore(self) -> None:
        if self._module() is not None:
            restore_attributes(self.module, self.saved)


class ForwardInstall(_Installed):
    """A plain block whose forward, replaced on the instance, checkpoints through `function` while training,
    dropping the KV cache as transformers does; a deep copy, pickle or DataParallel replica runs its own."""

    was_checkpointing = False

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.saved = {key: module.__dict__.get(key, MISSING) for key in ("forward", "_replicate_for_data_parallel")}
        self.first_parameter = next(iter(inspect.signature(module.forward).parameters), None)
        self.enabled, self.function = False, run_without_checkpoint
        self.wrapper = CheckpointingForward(self, module)
        object.__setattr__(module, "forward", self.wrapper)
        object.__setattr__(module, "_replicate_for_data_parallel", self.wrapper.replicate)

    def set(self, enabled: bool, function: Any) -> None:
        self.enabled, self.function = enabled, function

    def run(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """`module` (this block or a replica) through its own forward, checkpointed while training."""
        saved = self.saved["forward"]
        original = type(module).forward.__get__(module) if saved is MISSING else saved
        if not (self.enabled and module.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        _drop_cache_updated_in_place(module, kwargs)
        if not args and self.first_parameter in kwargs:
            # The checkpoint saves (and offload moves) positional inputs: pass the hidden states so.
            args = (kwargs.pop(self.first_parameter),)
        return self.function(original, *args, **kwargs)

    def restore(self) -> None:
        # Switched off even if something patched `forward` after remat and still calls this wrapper.
        self.enabled, self.function = False, run_without_checkpoint
        if (module := self._module()) is not None and module.__dict__.get("forward") is self.wrapper:
            restore_attributes(module, self.saved)


def _drop_cache_updated_in_place(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """A cache object the block updates in place would be updated again by the recompute: dropped, with the
    cache arguments, as transformers' layers do. A block asked only for `use_cache` (GPT-2's pre-4.35 format)
    returns its keys and values as new outputs, which the model's loop may read: the call is left as it is."""
    passed = [kwargs.get(k) for k, off in CACHE_ARGUMENTS.items() if off is None]
    in_place = any(v is not None and not isinstance(v, (tuple, list)) for v in passed)  # a legacy tuple is only read
    asked = kwargs.get("use_cache") not in (None, False)
    name = type(module).__name__
    if in_place:
        dropped = [k for k in CACHE_ARGUMENTS if kwargs.get(k) not in (None, CACHE_ARGUMENTS[k])]
        kwargs.update({key: CACHE_ARGUMENTS[key] for key in dropped})
        _warn_once(
            (name, "dropped"),
            "%s: the KV cache is incompatible with checkpointing while training (the recompute would update it "
            "again); remat passes %s: set them so yourself to silence this",
            name,
            ", ".join(f"{k}={CACHE_ARGUMENTS[k]}" for k in dropped),
        )
    elif asked:
        _warn_once(
            (name, "kept"),
            "%s: use_cache=True while training: the block returns its keys and values, held until the model's "
            "output is dropped (remat leaves the call as the model made it); set use_cache=False to free them "
            "(model.config.use_cache = False, or in the call)",
            name,
        )


def _warn_once(key: tuple[str, str], message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


class CheckpointingForward(_Installed):
    """A plain block's `forward` while remat wraps it. It lives on the module, so it holds the module and its
    `ForwardInstall` weakly: no cycle keeps host memory alive (the model's hooks keep the install alive)."""

    def __init__(self, install: ForwardInstall, module: nn.Module):
        super().__init__(module)
        self._install = Ref(install)
        self.__name__ = "forward"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        install, module = self._install(), self.module
        if install is None:  # remat was disabled, and something that kept this wrapper still calls it
            return type(module).forward(module, *args, **kwargs)
        return install.run(module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def replicate(self) -> nn.Module:
        """The block's `_replicate_for_data_parallel`: torch's replica, whose forward runs the replica."""
        install = self._install.alive("this layer's checkpointing was removed while still in use; call the model again")
        replica = type(self.module)._replicate_for_data_parallel(self.module)
        object.__setattr__(replica, "forward", CheckpointingForward(install, replica))
        return replica


def installer_for(found: DiscoveredLayer) -> FlagInstall | ForwardInstall:
    return ForwardInstall(found.module) if found.kind == "wrap" else FlagInstall(found.module, found.kind == "holder")
