"""`CheckpointedModel`: owns a model and keeps its per-layer checkpoint map true.

The wrapper follows PEFT's `PeftModel`: an `nn.Module` that holds the model as `.model`,
delegates unknown attributes to it (with a recursion guard) and forwards calls. What it adds is
the map: discover the layers, plan them from the config, install exactly what the plan says,
and route every other way of touching checkpointing (transformers' enable/disable methods,
Trainer, PEFT) back into the plan. The controller and the installing live in `remat.controller`;
this class is the public face: arguments checked, then delegated.

A wrapper is a real object: `forward` is a method of the class, and everything installed on the
model points at this wrapper's own controller, so `copy.deepcopy(cm)` is independent, pickling works,
and `nn.DataParallel` replicas each run their own replica (block swap refuses the three: its
parameters hold placeholders). Offload and swap state live in one `Offloader` and one
`WeightSwapper` per wrapper, so several wrapped models never share anything.

One model, one wrapper: a wrapper whose model another wrapper took (after this one was disabled)
stays replaced (`remat.controller`). Leaving remat is `disable()`, or `merge_and_unload()` /
`unload()`, which disable first so the model PEFT returns carries nothing of remat.
transformers' Trainer given the wrapper itself would save it as an unknown module (every weight,
no config): the wrapper answers the first question Trainer asks of its model with an error that
names `RematTrainer` (see `transformers_compat.TRAINER_PROBE`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from .arguments import WrapperOptions
from .compat.tested_versions import warn_if_untested
from .compat.transformers_compat import TRAINER_PROBE, pretrained_model_class
from .config import OFFLOAD_IS_A_POLICY, CheckpointConfig
from .controller import Controller, swap_targets
from .display import describe_map
from .errors import ConfigError, ConfigTypeError, StateError
from .layers import Discovery, discover_layers
from .offload import LayerOffloadStats, Offloader, Transport
from .persistence import load_checkpointed_model, save_checkpointed_model
from .plan import CheckpointMap, plan_layers
from .refs import LocalRef
from .swap import LayerSwapStats, WeightMover, WeightSwapper, check_swappable

if TYPE_CHECKING:
    import torch

    from .loss import LossFn
    from .planner import Profile
    from .report import MemoryReport

logger = logging.getLogger("remat")


def _plain_trainer_refusal(model: nn.Module) -> str:
    """The error a plain Trainer given the wrapper gets: the line that works, and a word about
    `peft_config` only when one was passed (TRL then put adapter layers into the model already)."""
    trainer = _trainer_being_built()
    if trainer in (None, "Trainer"):
        works = "remat.RematTrainer(model=cm, ...)"
    else:
        works = f"remat.remat_trainer_class({trainer})(model=cm, ...)"
    message = (
        f"{trainer or 'Trainer'}(model=cm) would save every weight of the wrapper and no checkpoint_config.json; "
        f"use {works}"
    )
    if not _is_peft_model(model) and _has_adapter_layers(model):
        message += (
            ". Your peft_config already put adapters into cm's model: build the model and the wrapper again, then "
            f"{works.replace('...', 'peft_config=...')}"
        )
    return message


def _trainer_being_built() -> str | None:
    """The class name of the Trainer whose `__init__` is asking (for the error to name it)."""
    frame = inspect.currentframe()
    try:
        for _ in range(30):
            if frame is None:
                return None
            owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
            mro = type(owner).__mro__ if owner is not None else ()
            if any(c.__name__ == "Trainer" and c.__module__ == "transformers.trainer" for c in mro):
                return type(owner).__name__
            frame = frame.f_back
        return None
    finally:
        del frame


def _is_peft_model(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _has_adapter_layers(model: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(module, BaseTunerLayer) for module in model.modules())


def _check_model(model: Any) -> None:
    if isinstance(model, CheckpointedModel):
        raise ConfigTypeError("this model is already a CheckpointedModel; wrap the original model once")
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(f"CheckpointedModel wraps a torch.nn.Module, got {type(model).__name__}: pass the model")
    pretrained = pretrained_model_class()
    if not any(isinstance(m, pretrained) for m in model.modules()):
        raise ConfigTypeError(
            f"CheckpointedModel wraps a transformers PreTrainedModel or a peft PeftModel over one; "
            f"{type(model).__name__} contains no PreTrainedModel"
        )
    owner = model.__dict__.get("_remat_owner")
    if owner is not None and not owner.orphaned:
        raise ConfigError("this model is already wrapped by another CheckpointedModel; call its disable() first")


def _with_fields(config: CheckpointConfig, fields: dict[str, Any], call: str) -> CheckpointConfig:
    """`config` with the CheckpointConfig fields given as keywords to `call` changed (the
    constructor's and `enable`'s first guess, `CheckpointedModel(model, every_n_layers=2)`)."""
    if not fields:
        return config
    if "offload" in fields:
        raise ConfigTypeError(f"{call}(offload=...) is gone: {OFFLOAD_IS_A_POLICY}")
    names = [f.name for f in dataclasses.fields(CheckpointConfig)]
    unknown = [name for name in fields if name not in names]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {close[0]}=?)" if close else ""
        extra = "".join(f", {name}" for name in WrapperOptions.names()) if call == "CheckpointedModel" else ""
        raise ConfigTypeError(
            f"{call}() got an unexpected keyword argument {unknown[0]!r}{hint}; it takes the fields of "
            f"CheckpointConfig ({', '.join(names)}){extra}"
        )
    return config.replace(**fields)


def controller_of(cm: CheckpointedModel) -> Controller:
    """The controller behind a wrapper (`remat.controller.Controller`): how remat's own modules
    (the memory report, Trainer support) and tests reach the map, the offloader and the swapper
    without reading the wrapper's private attributes."""
    return cm._controller


class CheckpointedModel(nn.Module):
    """A model whose activation checkpointing is decided layer by layer by `config`.

    Args:
        model: a transformers `PreTrainedModel`, or a peft `PeftModel` over one. It is kept as
            `cm.model`, unchanged in type, parameter names and parameter objects.
        config: the `CheckpointConfig`; the default checkpoints every layer.
        offload_transport: how the "offload" policy moves bytes between device and host. The
            default picks one per device (CUDA: side stream and pinned memory; CPU: nothing to
            move). A `remat.testing.SimulatedTransport` plays a device/host pair on the CPU.
        swap_mover: how block swap copies weights host to device; the default picks one from the
            weights' device (CUDA: pinned host copies and a side stream; CPU: plain copies).
        layer_class: the class (or class name, or several) of the model's repeated block, for
            models where discovery cannot decide (see `remat.layers`). A name that matches no
            module of the model is an error.
        offload_host_budget: pinned host memory offload may hold at once in this process, in
            bytes or as a size like "8GiB"; default: half the host's memory divided among the
            processes on the host (`LOCAL_WORLD_SIZE`). Past it, buffers are pageable (one warning).
        **fields: fields of `CheckpointConfig`, as a shorthand: `CheckpointedModel(model,
            every_n_layers=2)` is `CheckpointedModel(model, CheckpointConfig(every_n_layers=2))`;
            given with `config`, they change those fields of it (`config.replace(...)`).

    Every argument is checked here, before anything changes.

    Example::

        cm = CheckpointedModel(model, every_n_layers=2)  # or CheckpointConfig(every_n_layers=2) as config
        print(cm.checkpoint_map)
        loss = cm(**batch).loss
        with cm.for_inference():
            tokens = cm.generate(**prompt)
    """

    def __init__(
        self,
        model: nn.Module,
        config: CheckpointConfig | None = None,
        *,
        offload_transport: Transport | None = None,
        swap_mover: WeightMover | None = None,
        layer_class: str | type | Sequence[str | type] | None = None,
        offload_host_budget: int | str | None = None,
        _prepared: tuple[Discovery, CheckpointMap] | None = None,
        **fields: Any,
    ):
        warn_if_untested()  # once per process: torch or transformers outside the tested range
        config = CheckpointConfig() if config is None else config
        if isinstance(config, CheckpointConfig):  # anything else is refused below, naming the type
            config = _with_fields(config, fields, "CheckpointedModel")
        options = WrapperOptions(offload_transport, swap_mover, layer_class, offload_host_budget)
        if _prepared is None:  # every check before anything changes
            discovery = self._discover(model, options, config)
            checkpoint_map = self._plan(model, discovery, config)
        else:
            discovery, checkpoint_map = _prepared
        orphan = model.__dict__.get("_remat_owner")
        if orphan is not None:
            logger.warning(
                "this model still carries the checkpointing of a CheckpointedModel that no longer exists (dropped, "
                "or the model is a copy of a wrapped one); the new wrapper takes over and replaces it"
            )
            orphan_config, orphan_off_by = orphan.config, orphan.off_by
            orphan.disable()  # its swapped weights come home before the new map checks and swaps them
        super().__init__()
        self.model = model
        offloader = Offloader(config.offload_min_bytes, offload_transport, options.host_budget())
        # A plain attribute (not a submodule): the controller holds the model weakly.
        self._controller = Controller(model, config, discovery, checkpoint_map, offloader, WeightSwapper(swap_mover))
        self._controller.wrapper = LocalRef(self)
        try:
            self._controller.enable(config, planned=checkpoint_map)
        except BaseException:
            if orphan is not None:  # refused: the model keeps the checkpointing it had
                orphan.enable(orphan_config, off_by=orphan_off_by, cause="a refused takeover (restoring)")
            raise

    @staticmethod
    def _discover(model: nn.Module, options: WrapperOptions, config: Any = None) -> Discovery:
        """Every check of the arguments that needs no plan, with nothing changed; then the layers."""
        _check_model(model)
        if config is not None and not isinstance(config, CheckpointConfig):
            raise ConfigTypeError(f"config must be a CheckpointConfig, got {type(config).__name__}: pass one")
        options.host_budget()
        return discover_layers(model, options.layer_class)

    @staticmethod
    def _plan(model: nn.Module, discovery: Discovery, config: CheckpointConfig) -> CheckpointMap:
        """The map, with the swap it asks for checked (a plan the constructor is handed ready)."""
        checkpoint_map = plan_layers(config, discovery.names)
        check_swappable(swap_targets(discovery, checkpoint_map), model)
        return checkpoint_map

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A deep copy or an unpickled wrapper owns the copy of the controller it carries."""
        super().__setstate__(state)
        self._controller.wrapper = LocalRef(self)

    def __copy__(self) -> CheckpointedModel:
        """Refused: a shallow copy would share this wrapper's model and controller, so two
        wrappers would claim one map (and ownership would follow whichever was made last)."""
        raise ConfigTypeError(
            "copy.copy(cm) would make a second wrapper sharing cm's model and map; a model has one wrapper. Use cm "
            "itself, or copy.deepcopy(cm) for an independent wrapper over a copy of the model"
        )

    # -- delegation (PEFT's pattern) -----------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("model", "_controller"):  # not set yet: no recursion through self.model
                raise
            if name == TRAINER_PROBE:
                raise ConfigTypeError(_plain_trainer_refusal(self.model)) from None
            if name == "plan_for_budget":
                raise AttributeError(
                    "cm.plan_for_budget(batch, budget) is gone: "
                    "cm.profile(batch, ...).plan(budget, scope=..., tokens=...)"
                ) from None
            return getattr(self.model, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped model. A plain method, so `torch.compile(cm)` traces it like any module."""
        return self.model(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """torch's `nn.Module.compile(...)` (same arguments), applied to the wrapped model:
        `cm.model.compile(...)`. cm's forward calls cm.model, and a trainer given cm trains
        cm.model, so both run compiled. `disable()` leaves the compile in place (it is the model's)."""
        self.model.compile(*args, **kwargs)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """The wrapped model's DDP ignore list (swapped frozen weights), under this module's names."""
        names = self.model.__dict__.get("_ddp_params_and_buffers_to_ignore")
        if names is None:
            raise AttributeError("_ddp_params_and_buffers_to_ignore")
        return ["model." + name for name in names]

    # -- public state --------------------------------------------------------------------------

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        """The current `CheckpointConfig`. `cm.config` is the wrapped model's own config (delegated,
        as `PeftModel.config` is), which Trainer, TRL and PEFT read and write."""
        return self._controller.config

    @property
    def checkpoint_map(self) -> CheckpointMap:
        """The per-layer plan, in layer order. It is what runs whenever the model trains; while
        the wrapper is disabled nothing runs, and the map says so when printed."""
        controller = self._controller
        if controller.is_enabled:
            return controller.checkpoint_map
        why = "replaced by another CheckpointedModel" if controller.replaced else controller.disabled_by
        return controller.checkpoint_map.switched_off(why)

    @property
    def is_enabled(self) -> bool:
        """True while remat's shims are installed (between `enable()` and `disable()`)."""
        return self._controller.is_enabled

    @property
    def layers(self) -> list[nn.Module]:
        """The discovered layers, index i being `checkpoint_map[i]`."""
        return [layer.module for layer in self._controller.discovery.layers]

    # -- enable / disable ----------------------------------------------------------------------

    def enable(self, config: CheckpointConfig | None = None, **fields: Any) -> CheckpointedModel:
        """Turn checkpointing on, with `config` if given (else the current one). Returns self.
        A refused config (bad layer indices, a swap that cannot be made) changes nothing.

        Keywords are `CheckpointConfig` fields changed on that config: `cm.enable(every_n_layers=3)`
        is `cm.enable(cm.checkpoint_config.replace(every_n_layers=3))` (the other fields, `layer_policies`
        included, stay as they are)."""
        config = self._controller.config if config is None else config
        if not isinstance(config, CheckpointConfig):
            raise ConfigTypeError(
                f"config must be a CheckpointConfig, got {type(config).__name__}: "
                "cm.enable(CheckpointConfig(...)), or fields as keywords, cm.enable(every_n_layers=3)"
            )
        self._controller.enable(_with_fields(config, fields, "enable"))
        return self

    def disable(self) -> CheckpointedModel:
        """Remove everything remat installed: flags, functions, routes, hooks. Returns self.

        The model is left as it was before wrapping (same parameters and state_dict, no hooks);
        `enable()` installs the shims again.
        """
        self._controller.disable()
        return self

    # -- training / inference ------------------------------------------------------------------

    def for_inference(self) -> CheckpointedModel:
        """Eval mode with checkpointing off, so generation can use its cache. The map is kept.

        Usable as a context manager: ``with cm.for_inference(): ...`` returns on exit to the mode
        before the call (training, usually), each module's train/eval flag included; blocks nest.
        """
        self._controller.set_mode(inference=True)
        return self

    def for_training(self) -> CheckpointedModel:
        """Training mode with the map applied exactly as it is. Returns self (a context manager too)."""
        self._controller.set_mode(inference=False)
        return self

    def __enter__(self) -> CheckpointedModel:
        self._controller.enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._controller.exit()

    @property
    def offload_stats(self) -> dict[int, LayerOffloadStats]:
        """Per layer index: bytes offloaded, bytes kept on the device and why, copies made,
        summed since the wrapper was made (or `reset_offload_stats()`)."""
        return dict(self._controller.offloader.stats)

    def reset_offload_stats(self) -> None:
        self._controller.offloader.reset_stats()

    @property
    def swap_stats(self) -> dict[int, LayerSwapStats]:
        """Per swapped layer: how many times its weights were fetched, and the bytes, summed since
        the layer was swapped (or `reset_swap_stats()`)."""
        return {i: e.stats for i, e in self._controller.swapper.layers.items()}

    def reset_swap_stats(self) -> None:
        self._controller.swapper.reset_stats()

    def summary(self) -> str:
        """The map's table with what offload and block swap did per layer (headed by a line
        saying remat is off while the wrapper is disabled)."""
        return describe_map(self.checkpoint_map, self._controller.offloader.stats, self.swap_stats)

    # -- leaving remat -------------------------------------------------------------------------

    def merge_and_unload(self, *args: Any, **kwargs: Any) -> nn.Module:
        """PEFT's `merge_and_unload` (arguments go to PEFT) on a plain model: remat is disabled
        first, so the returned model carries nothing of remat (no flag, shim, route or override)
        and trains as transformers would. This wrapper stays disabled: its adapters are gone."""
        return self._leave("merge_and_unload", args, kwargs)

    def unload(self, *args: Any, **kwargs: Any) -> nn.Module:
        """PEFT's `unload` (the base model without the adapters), like `merge_and_unload`."""
        return self._leave("unload", args, kwargs)

    def _leave(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module:
        method = getattr(self.model, name, None)  # a PeftModel forwards it to its tuner
        if method is None:
            raise AttributeError(
                f"cm.{name}() is PEFT's, and cm.model is a {type(self.model).__name__}, not a PeftModel: there are no "
                "adapters to unload. cm.disable() leaves the model as it was before wrapping"
            )
        controller = self._controller
        was_enabled, config = controller.is_enabled, controller.config
        controller.disable(cause=f"cm.{name}()")
        try:
            result = method(*args, **kwargs)
        except BaseException:
            if was_enabled:  # PEFT refused: the wrapper is back as it was
                controller.enable(config)
            raise
        if was_enabled:
            logger.warning(
                "cm.%s(): remat is now disabled on this wrapper (the adapters it was planned with are gone); the "
                "returned model is plain. Wrap it again to checkpoint it: "
                "CheckpointedModel(model, cm.checkpoint_config)",
                name,
            )
        return result

    # -- measurement ---------------------------------------------------------------------------

    def memory_report(self, batch: Mapping[str, Any], *, loss_fn: LossFn | None = None) -> MemoryReport:
        """Run one training step on `batch` and measure, per layer: bytes held for backward after
        forward (device / host), resident weight bytes, and how often the layer ran (2 means
        recomputed); the weights total counts every parameter and buffer of the model
        (embeddings and head in "outside layers"). The loss is the model's (`outputs.loss`, from
        labels in the batch) or `loss_fn(outputs, batch)`. No optimizer step is taken.

        Everything is left as it was, as `profile` leaves it: the gradients (accumulated ones
        included: a report between two micro-batches changes nothing the next optimizer step
        sees), `offload_stats` and `swap_stats` (the report's step is not counted), buffers and
        counters of the modules, the RNG, train/eval flags; tensors of the batch that require
        grad (a soft prompt) get no gradient."""
        from .report import memory_report_leaving_state

        if self._controller.inference or not self.model.training:
            raise StateError("memory_report measures a training step: call cm.for_training() first")
        return memory_report_leaving_state(self._controller, dict(batch), loss_fn)

    def profile(
        self,
        batch: Mapping[str, Any],
        *,
        loss_fn: LossFn | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        progress: bool = True,
        repeats: int = 3,
    ) -> Profile:
        """Measure this model on `batch` once, for plans at any budget without running it again:
        `profile.plan(budget, scope="activations" | "step", tokens=None)` returns the fastest map
        whose held activations (or, with `scope="step"`, the peak of a whole training step) fit
        `budget` (bytes, or a size like "6GiB"), a `CheckpointConfig` that prints its prediction,
        for `cm.enable(planned)`; also `profile.frontier()`, `profile.plot()`. A few training
        steps (13.6 steps' worth on the benchmark's small preset with `repeats=3`, 14.5 with an
        optimizer; a progress bar unless `progress=False`). `loss_fn(outputs, batch)` gives the
        loss for a model whose output has none; `optimizer` adds the peak of a whole step (for
        `scope="step"`). Everything is left as it was: the model (config, gradients, buffers,
        counters, RNG), the optimizer, tensors outside the model. See `remat.planner`."""
        from .planner import ProfileOptions, profile_model

        return profile_model(self._controller, batch, ProfileOptions(loss_fn, optimizer, progress, repeats))

    # -- save / load ---------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write the adapters exactly as PEFT writes them (when the model is a PeftModel; keyword
        arguments go to PEFT) and `checkpoint_config.json`, into `save_directory`, touching no
        other file there. A crash at any moment leaves the previous save or this one, never a
        mix. `is_main_process=False` writes nothing. A plain base model saves the config alone:
        its weights are the user's to save."""
        save_checkpointed_model(self._controller, save_directory, **kwargs)

    @classmethod
    def from_pretrained(
        cls, model: nn.Module, path: str | os.PathLike, is_trainable: bool = True, **kwargs: Any
    ) -> CheckpointedModel:
        """Load the adapters saved at `path` (all of them) and the checkpoint config into `model`
        and wrap it. `model` is the base model, or a PeftModel whose adapters of the same names
        and structure then receive the saved weights. Anything that does not fit (other layers,
        adapter files that are not the ones the config was saved with, an adapter of another
        structure) is refused before anything changes. `is_trainable=False` loads for inference
        (`for_inference()`); the map is applied whenever the model trains. Keyword arguments go
        to PEFT, except the constructor's own (`remat.arguments.WrapperOptions`)."""
        return load_checkpointed_model(cls, model, path, is_trainable=is_trainable, **kwargs)

    def extra_repr(self) -> str:
        return f"checkpoint_config={self._controller.config!r}, map={self.checkpoint_map!r}, enabled={self.is_enabled}"
