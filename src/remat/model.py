"""`CheckpointedModel`, the public face: an `nn.Module` delegating to its `.model` as PEFT's `PeftModel`
does. Arguments are checked here, before anything changes; the map and what is installed: `remat.controller`."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from .arguments import WrapperOptions, check_optimizer
from .compat.tested_versions import warn_if_untested
from .compat.transformers_compat import TRAINER_PROBE, pretrained_model_class
from .config import OFFLOAD_IS_A_POLICY, CheckpointConfig, refuse_unknown_fields
from .controller import Controller, owners_of, swap_targets
from .controller import controller_of_wrapper as controller_of  # noqa: F401 (tests reach the controller so)
from .display import describe_map
from .errors import ConfigError, ConfigTypeError, FrozenConfigError, StateError
from .layers import Discovery, discover_layers
from .offload import LayerOffloadStats, Offloader, Transport
from .persistence import load_checkpointed_model, save_checkpointed_model
from .persistence.pair_format import is_peft_model
from .plan import CheckpointMap, plan_layers
from .recompute import swappers_owed
from .refs import LocalRef
from .swap import LayerSwapStats, WeightMover, WeightSwapper, check_swappable

if TYPE_CHECKING:
    import torch

    from .budget import Receipt
    from .loss import LossFn
    from .planner import Profile
    from .report import MemoryReport

logger = logging.getLogger("remat")


def _plain_trainer_refusal(model: nn.Module) -> str:
    """A plain Trainer given the wrapper would save it as an unknown module: the error names the
    line that works, and says when TRL's `peft_config` already put adapters into the model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    trainer, frame = None, inspect.currentframe()
    try:  # the Trainer class whose `__init__` is asking, for the error to name it
        while frame is not None and trainer is None:
            owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
            if any(c.__name__ == "Trainer" and c.__module__ == "transformers.trainer" for c in type(owner).__mro__):
                trainer = type(owner).__name__
            frame = frame.f_back
    finally:
        del frame  # a frame held by a local of its own is a reference cycle
    works = f"remat.remat_trainer_class({trainer})" if trainer not in (None, "Trainer") else "remat.RematTrainer"
    works += "(model=cm, ...)"
    message = f"{trainer or 'Trainer'}(model=cm) would save every weight of the wrapper and no checkpoint_config.json"
    message += f"; use {works}"
    if not is_peft_model(model) and any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        message += (
            ". Your peft_config already put adapters into cm's model: build the model and the wrapper again, then "
            f"{works.replace('...', 'peft_config=...')}"
        )
    return message


_ENGINES = ("DataParallel", "DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine")


def _training_engine(model: nn.Module) -> str | None:
    """The name of the data-parallel wrapper `model` is (torch's, FSDP's first API, DeepSpeed's), compiled or not (as
    accelerate compiles after DDP), None if none: read by class name, so that no engine is imported to ask."""
    model = getattr(model, "_orig_mod", model)
    names = [k.__name__ for k in type(model).__mro__ if k.__name__ in _ENGINES]
    return names[0] if names and isinstance(getattr(model, "module", None), nn.Module) else None


def _with_fields(config: Any, fields: dict[str, Any], call: str) -> CheckpointConfig:
    """`config`, checked, with the CheckpointConfig fields given as keywords to `call` changed."""
    example = "CheckpointedModel(model, " if call == "CheckpointedModel" else "cm.enable("
    if not isinstance(config, CheckpointConfig):
        mixed_up = hasattr(config, "to_diff_dict")  # a transformers config: cm.config
        models = " (cm.config is the model's config; remat's is cm.checkpoint_config)" if mixed_up else ""
        raise ConfigTypeError(
            f"config must be a CheckpointConfig, got {type(config).__name__}: {example}CheckpointConfig(...)), or "
            f"fields as keywords, {example}every_n_layers=3){models}"
        )
    if "offload" in fields:
        raise ConfigTypeError(f"{call}(offload=...) is gone: {OFFLOAD_IS_A_POLICY}")
    if call != "CheckpointedModel" and (fixed := sorted(set(fields) & set(WrapperOptions.names()))):
        raise ConfigTypeError(
            f"{call}({fixed[0]}=...): {fixed[0]} is the wrapper's own, fixed when it is built; build another: "
            f"cm.disable(); cm = CheckpointedModel(cm.model, cm.checkpoint_config, {fixed[0]}=...)"
        )
    options = tuple(WrapperOptions.names()) if call == "CheckpointedModel" else ()
    refuse_unknown_fields(fields, f"{call}() got an unexpected keyword argument {{first!r}}{{hint}}", "=", options)
    return config.replace(**fields) if fields else config


class CheckpointedModel(nn.Module):
    """A model whose activation checkpointing is decided layer by layer by `config`.

    Args:
        model: a transformers `PreTrainedModel`, or a peft `PeftModel` over one, kept as `cm.model`.
        config: the `CheckpointConfig`; the default checkpoints every layer.
        offload_transport: how "offload" moves bytes (default: per device; `remat.testing.SimulatedTransport`).
        swap_mover: how block swap copies weights host to device (default: one per device).
        layer_class: the class(es), or name(s), of the repeated block where discovery cannot decide.
        offload_host_budget: pinned host bytes this wrapper's offload may hold, or "8GiB" (default: half the host's,
            shared by every wrapper of the process that takes the default).
        **fields: `CheckpointConfig` fields changed on `config`: `CheckpointedModel(model, every_n_layers=2)`.

    Raises `remat.RematError` subclasses (TypeError / ValueError) before anything changes.
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
        **fields: Any,
    ):
        # a load's discovery and map, made once (`remat.persistence`): kept out of the signature help() shows
        _prepared: tuple[Discovery, CheckpointMap] | None = fields.pop("_prepared", None)
        warn_if_untested()  # once per process: torch or transformers outside the tested range
        config = _with_fields(CheckpointConfig() if config is None else config, fields, "CheckpointedModel")
        options = WrapperOptions(offload_transport, swap_mover, layer_class, offload_host_budget)
        if _prepared is None:  # every check before anything changes
            discovery = self._discover(model, options)
            _prepared = (discovery, self._plan(model, discovery, config))
        if orphans := owners_of(model):  # none alive: `_discover` refused those
            logger.warning(
                "this model still carries the checkpointing of a CheckpointedModel that no longer exists (dropped, "
                "or the model is a copy of a wrapped one); the new wrapper takes over and replaces it"
            )
            for orphan in orphans:
                orphan.disable()  # its swapped weights come home before the new map checks and swaps them
        super().__init__()
        self.model = model
        offloader = Offloader(config.offload_min_bytes, offload_transport, options.host_budget())
        # A plain attribute (not a submodule): the controller holds the model weakly.
        self._controller = Controller(model, config, *_prepared, offloader, WeightSwapper(swap_mover))
        self._controller.wrapper = LocalRef(self)
        try:
            self._controller.replan(config, None, "enable()", install=True, planned=_prepared[1])
        except BaseException:
            for orphan in orphans:  # refused: the model keeps the checkpointing it had
                orphan.enable(orphan.config, off_by=orphan.off_by, cause="a refused takeover (restoring)")
            raise

    @staticmethod
    def _discover(model: nn.Module, options: WrapperOptions) -> Discovery:
        """Every check of the arguments that needs no plan, with nothing changed; then the layers."""
        if isinstance(model, CheckpointedModel):
            raise ConfigTypeError("this model is already a CheckpointedModel; wrap the original model once")
        if not isinstance(model, nn.Module):
            raise ConfigTypeError(f"CheckpointedModel wraps an nn.Module, got {type(model).__name__}: pass the model")
        if (engine := _training_engine(model)) is not None:
            inner = getattr(model, "_orig_mod", model).module
            raise ConfigTypeError(
                f"this {engine} already runs a CheckpointedModel: train it as it is, wrap nothing around it again"
                if isinstance(inner, CheckpointedModel)
                else f"CheckpointedModel wraps the model itself, not the {engine} around it (accelerator.prepare, DDP "
                "and DeepSpeed wrap it for training, and a save would not find the PeftModel inside): wrap first, then "
                "prepare the wrapper: cm = CheckpointedModel(model); prepared = accelerator.prepare(cm) (or DDP(cm))"
            )
        if not any(isinstance(m, pretrained_model_class()) for m in model.modules()):
            raise ConfigTypeError(
                f"CheckpointedModel wraps a transformers PreTrainedModel or a peft PeftModel over one; "
                f"{type(model).__name__} contains no PreTrainedModel"
            )
        if (owner := model.__dict__.get("_remat_owner")) is not None and owner.wrapper() is not None:  # not dropped
            raise ConfigError("this model is already wrapped by another CheckpointedModel; call its disable() first")
        if live := [owner for owner in owners_of(model) if owner.wrapper() is not None]:
            raise ConfigError(
                f"another CheckpointedModel wraps {type(live[0].model).__name__}, which shares this model's layers "
                f"({live[0].discovery.names[0]}, ...): a model inside this one, one around it (a PeftModel built "
                "after wrapping), or one beside it built from the same layer objects. A layer has one wrapper: "
                "call that wrapper's disable() first, then wrap the model you train (the PeftModel, if you added "
                "adapters). Nothing was changed"
            )
        options.host_budget()
        return discover_layers(model, options.layer_class)

    @staticmethod
    def _plan(model: nn.Module, discovery: Discovery, config: CheckpointConfig) -> CheckpointMap:
        checkpoint_map = plan_layers(config, discovery.names)
        check_swappable(swap_targets(discovery, checkpoint_map), model)
        return checkpoint_map

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A deep copy or an unpickled wrapper owns the copy of the controller it carries."""
        super().__setstate__(state)
        self._controller.wrapper = LocalRef(self)
        if self._controller.is_enabled:
            self._controller.claim_layers()

    def __copy__(self) -> CheckpointedModel:
        raise ConfigTypeError(
            "copy.copy(cm) would make a second wrapper sharing cm's model and map; a model has one wrapper. Use cm "
            "itself, or copy.deepcopy(cm) for an independent wrapper over a copy of the model"
        )

    @property  # type: ignore[override]
    def training(self) -> bool:
        """The wrapped model's mode: `for_inference()`, `for_training()` and a load switch it, not a flag of the
        wrapper's own (which read True inside `for_inference()`)."""
        model = self.__dict__.get("_modules", {}).get("model")
        return self.__dict__.get("_training", True) if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:  # nn.Module's `train()` sets it, then the model's through its children
        self.__dict__["_training"] = mode

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
                    "cm.plan_for_budget() is gone: cm.profile(batch, ...).plan(budget, scope=..., tokens=...)"
                ) from None
            return getattr(self.model, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped model. A plain method, so `torch.compile(cm)` traces it like any module."""
        return self.model(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """`cm.model.compile(...)`: cm and a trainer given cm run cm.model compiled; `disable()` leaves it."""
        self.model.compile(*args, **kwargs)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """The wrapped model's DDP ignore list (swapped frozen weights), under this module's names."""
        if (names := self.model.__dict__.get("_ddp_params_and_buffers_to_ignore")) is None:
            raise AttributeError("_ddp_params_and_buffers_to_ignore")
        return ["model." + name for name in names]

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        """The current `CheckpointConfig` (`cm.config` is the wrapped model's, as for `PeftModel`)."""
        return self._controller.config

    @checkpoint_config.setter
    def checkpoint_config(self, config: Any) -> None:
        raise FrozenConfigError(
            "cm.checkpoint_config is read-only: cm.enable(config) installs another config (or cm.enable(field=...) "
            "changes fields of the current one), planned and checked before anything changes"
        )

    @property
    def checkpoint_map(self) -> CheckpointMap:
        """The per-layer plan, in layer order; while disabled, printed as switched off."""
        controller = self._controller
        if controller.is_enabled:
            return controller.checkpoint_map
        why = "replaced by another CheckpointedModel" if controller.replaced else controller.disabled_by
        return controller.checkpoint_map.switched_off(why)

    @property
    def is_enabled(self) -> bool:
        """True between `enable()` and `disable()`."""
        return self._controller.is_enabled

    @property
    def layers(self) -> list[nn.Module]:
        """The discovered layers, index i being `checkpoint_map[i]`."""
        return [layer.module for layer in self._controller.discovery.layers]

    def enable(self, config: CheckpointConfig | None = None, **fields: Any) -> CheckpointedModel:
        """Turn checkpointing on with `config` (default: the current one), its fields changed by
        the keywords: `cm.enable(every_n_layers=3)`. Returns self; a refused config changes nothing."""
        self._controller.enable(_with_fields(self._controller.config if config is None else config, fields, "enable"))
        return self

    def disable(self) -> CheckpointedModel:
        """Remove everything remat installed, leaving the model as before wrapping. Returns self."""
        self._controller.disable()
        return self

    def for_inference(self) -> CheckpointedModel:
        """Eval mode with checkpointing off (generation uses its cache), the map kept; `with` restores the mode."""
        self._controller.set_mode(inference=True)
        return self

    def for_training(self) -> CheckpointedModel:
        """Training mode with the map applied. Returns self (a context manager too)."""
        self._controller.set_mode(inference=False)
        return self

    def __enter__(self) -> CheckpointedModel:
        self._controller.enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._controller.exit()

    @property
    def offload_stats(self) -> dict[int, LayerOffloadStats]:
        """Per layer: bytes offloaded and kept (and why), copies made, since made or reset: a copy, which later
        steps leave as it is (take one before and one after a step for its own)."""
        return copy.deepcopy(dict(self._controller.offloader.stats))

    def reset_offload_stats(self) -> None:
        """Start `offload_stats` from zero (measuring and `memory_report` never reset them)."""
        self._controller.offloader.reset_stats()

    @property
    def swap_stats(self) -> dict[int, LayerSwapStats]:
        """Per swapped layer: fetches and bytes, since the layer was swapped or reset: a copy, as `offload_stats`."""
        return {i: dataclasses.replace(e.stats) for i, e in self._controller.swapper.layers.items()}

    def set_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The optimizer whose state a `budget_scope="step"` budget counts in a step's peak: `RematTrainer` and TRL's
        trainers hand theirs over; a loop of your own calls this once it has made its optimizer (accelerate's
        prepared one too). A profile measured without it is measured again at the next training step. None forgets
        it; plans already made keep counting its state until the profile is measured again."""
        self._controller.budget.set_optimizer(check_optimizer(optimizer))

    def reset_swap_stats(self) -> None:
        """Start `swap_stats` from zero (measuring and `memory_report` never reset them)."""
        self._controller.swapper.reset_stats()

    @property
    def budget_receipts(self) -> list[Receipt]:
        """With `CheckpointConfig(budget=...)`: per plan a token bucket ran, in order, the plan, predicted bytes,
        training forwards run and (on an accelerator) the measured peak (`remat.budget.Receipt`). A bucket planned
        anew (another budget, a profile measured again) has a second receipt after its first."""
        return [dataclasses.replace(r) for r in self._controller.budget.history]

    def summary(self) -> str:
        """The map's table with what offload and block swap did per layer."""
        return describe_map(self.checkpoint_map, self._controller.offloader.stats, self.swap_stats)

    def merge_and_unload(self, *args: Any, **kwargs: Any) -> nn.Module:
        """PEFT's `merge_and_unload` after disabling remat: the model returned is plain, this wrapper stays off."""
        return self._leave("merge_and_unload", args, kwargs)

    def unload(self, *args: Any, **kwargs: Any) -> nn.Module:
        """PEFT's `unload`, like `merge_and_unload`."""
        return self._leave("unload", args, kwargs)

    def _leave(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module:
        if (method := getattr(self.model, name, None)) is None:  # a PeftModel forwards it to its tuner
            raise AttributeError(
                f"cm.{name}() is PEFT's, and cm.model is a {type(self.model).__name__}, not a PeftModel: there are no "
                "adapters to unload. cm.disable() leaves the model as it was before wrapping"
            )
        controller, was_enabled = self._controller, self._controller.is_enabled
        if owed := [i for i, layer in enumerate(controller.discovery.layers) if swappers_owed(layer.module)]:
            raise StateError(
                f"cm.{name}() now would replace layers {owed} under a checkpointed forward whose backward has not run "
                "(its recompute would run the unloaded model and fail): call backward first, or drop that forward's "
                "outputs (a forward that raised at a prompt is held by its traceback: sys.last_exc = sys.last_value = "
                "sys.last_traceback = None); nothing was changed"
            )
        controller.disable(cause=f"cm.{name}()")
        try:
            result = method(*args, **kwargs)
        except BaseException:
            if was_enabled:  # PEFT refused: the wrapper is back as it was
                controller.enable(controller.config)
            raise
        controller.unloaded_by = f"cm.{name}()"
        if was_enabled:
            logger.warning(
                "cm.%s(): remat is now disabled on this wrapper (the adapters it was planned with are gone): the model "
                "returned is plain. Wrap it again to checkpoint it: CheckpointedModel(model, cm.checkpoint_config)",
                name,
            )
        return result

    def memory_report(self, batch: Mapping[str, Any], *, loss_fn: LossFn | None = None) -> MemoryReport:
        """One training step on `batch` (loss: `outputs.loss` or `loss_fn(outputs, batch)`), measured per
        layer; everything is left as it was (`remat.report`). Raises `StateError` in inference mode."""
        from .report import memory_report_leaving_state

        if self._controller.inference or not self.model.training:
            raise StateError("memory_report measures a training step: call cm.for_training() first")
        self._controller.check_layers("memory_report()")
        return memory_report_leaving_state(self._controller, batch, loss_fn)

    def profile(
        self,
        batch: Mapping[str, Any],
        *,
        loss_fn: LossFn | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        progress: bool = True,
        repeats: int = 3,
    ) -> Profile:
        """Measure on `batch` once, for `.plan(budget, scope=..., tokens=...)` at any budget; `optimizer`
        adds the whole step's peak (`scope="step"`). `loss_fn(outputs, batch)` gives the loss where the batch has
        no labels; `repeats`: timed steps per timed map (more steady prices, longer); `progress` shows a progress bar.
        With head="chunked" every label counts (ignored ones too: the most a step of its length holds). Everything is
        left as it was (`remat.planner`)."""
        from .planner import ProfileOptions, profile_model

        self._controller.check_layers("profile()")
        return profile_model(self._controller, batch, ProfileOptions(loss_fn, optimizer, progress, repeats))

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write the adapters as PEFT does (keywords go to PEFT; a transformers model without PEFT: its own save,
        keywords to transformers) and `checkpoint_config.json`, touching no other file; a crash leaves the previous
        save or this one, never a mix. A replaced wrapper refuses: its config no longer runs on the model."""
        self._controller.check_not_replaced("save_pretrained()")
        self._controller.check_layers("save_pretrained()")
        save_checkpointed_model(self._controller, save_directory, **kwargs)

    @classmethod
    def from_pretrained(
        cls, model: nn.Module, path: str | os.PathLike, *, is_trainable: bool = True, **kwargs: Any
    ) -> CheckpointedModel:
        """Load what `save_pretrained` wrote at `path` into `model` (the base model, or a PeftModel with those
        adapters) and wrap it, refusing before any change. Keywords go to PEFT, except the constructor's own. A save of
        a model without PEFT holds its weights as transformers saves them: load `model` from `path` with transformers
        first (`AutoModelForCausalLM.from_pretrained(path)`); here the map is applied, the weights are not read."""
        return load_checkpointed_model(cls, model, path, is_trainable=is_trainable, **kwargs)

    def extra_repr(self) -> str:
        return f"checkpoint_config={self._controller.config!r}, map={self.checkpoint_map!r}, enabled={self.is_enabled}"
