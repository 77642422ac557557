"""`CheckpointedModel`: owns a model and keeps its per-layer checkpoint map true.

The wrapper follows PEFT's `PeftModel`: an `nn.Module` that holds the model as `.model`,
delegates unknown attributes to it (with a recursion guard) and forwards calls. What it adds is
the map: discover the layers, plan them from the config, install exactly what the plan says,
and route every other way of touching checkpointing (transformers' enable/disable methods,
Trainer, PEFT) back into the plan.

Installing means, per layer and on the instance only (see `remat.install`): transformers'
per-layer flag and function for its own layers, a wrapped `forward` for plain blocks, the flag
of the "holder" modules that turn `use_cache` off while training; plus the route methods, the
save/load overrides, block swap's placeholders and hooks, and a forward pre-hook that re-applies
the map if the model is put back into training behind the wrapper's back. Everything set is
recorded and restored by `disable()`. Offload and swap state live in one `Offloader` and one
`WeightSwapper` per wrapper, so several wrapped models never share anything.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from .config import CheckpointConfig
from .install import FlagInstall, ForwardInstall, InstancePatches, installer_for
from .integrations.routes import RouteOverrides, config_from_route, describe_changes
from .integrations.transformers_compat import pretrained_model_class
from .layers import Discovery, discover_layers
from .offload import LayerOffloadStats, Offloader, Transport
from .persistence import SaveLoadOverrides, load_checkpointed_model, save_checkpointed_model
from .plan import CheckpointMap, describe_map, plan_layers
from .recompute import RecomputeCheckpoint, run_without_checkpoint
from .swap import LayerSwapStats, WeightMover, WeightSwapper, check_swappable

if TYPE_CHECKING:
    from .report import MemoryReport

logger = logging.getLogger("remat")


def _check_wrappable(model: Any) -> None:
    if isinstance(model, CheckpointedModel):
        raise TypeError("this model is already a CheckpointedModel; wrap the original model once")
    if not isinstance(model, nn.Module):
        raise TypeError(f"CheckpointedModel wraps a torch.nn.Module, got {type(model).__name__}")
    pretrained = pretrained_model_class()
    if not any(isinstance(m, pretrained) for m in model.modules()):
        raise TypeError(
            f"CheckpointedModel wraps a transformers PreTrainedModel or a peft PeftModel over one; "
            f"{type(model).__name__} contains no PreTrainedModel"
        )
    owner = getattr(model, "_remat_owner", None)
    if owner is not None:
        raise ValueError("this model is already wrapped by another CheckpointedModel; call its disable() first")


def _swap_targets(discovery: Discovery, checkpoint_map: CheckpointMap) -> list[tuple[int, str, nn.Module]]:
    return [(p.index, p.name, discovery.layers[p.index].module) for p in checkpoint_map if p.swapped]


class _ModelAwareConfig(CheckpointConfig):
    """What `cm.config` returns: the CheckpointConfig, answering for the wrapped model's own
    config where the name is not a checkpointing field.

    Code written for Hugging Face models reads and writes `model.config` (Trainer sets
    `model.config.use_cache`, reads `eos_token_id`, `problem_type`, ...). The contract makes
    `cm.config` the CheckpointConfig, so the names it does not have are looked up on, and
    written to, `cm.model.config`. Its fields stay frozen: change them with `cm.enable(config)`.
    """

    @classmethod
    def bind(cls, config: CheckpointConfig, model_config: Any) -> CheckpointConfig:
        if model_config is None:
            return config
        view = cls.__new__(cls)
        object.__setattr__(view, "__dict__", dict(config.__dict__))
        object.__setattr__(view, "_model_config", model_config)
        return view

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_model_config":
            raise AttributeError(name)
        return getattr(self.__dict__["_model_config"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in {f.name for f in dataclasses.fields(CheckpointConfig)}:
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to CheckpointConfig.{name}: build a new config with "
                f"cm.config.replace({name}=...) and pass it to cm.enable(config)"
            )
        setattr(self.__dict__["_model_config"], name, value)


class CheckpointedModel(nn.Module):
    """A model whose activation checkpointing is decided layer by layer by `config`.

    Args:
        model: a transformers `PreTrainedModel`, or a peft `PeftModel` over one. It is kept as
            `cm.model`, unchanged in type, parameter names and parameter objects.
        config: the `CheckpointConfig`; the default checkpoints every layer.
        offload_transport: how the "offload" policy moves bytes between device and host. The
            default picks one per device (CUDA: side stream and pinned pool; CPU: nothing to
            move). A `remat.offload.SimulatedTransport` plays a device/host pair on the CPU.
        swap_mover: how block swap copies weights host to device; the default picks one from the
            weights' device (CUDA: pinned host copies and a side stream; CPU: plain copies).
        layer_class: the class (or class name, or several) of the model's repeated block, for
            models where discovery cannot decide (see `remat.layers`).
        offload_host_budget: bytes of pinned host memory the offload pool may take in this
            process; default: half the host's memory divided among the processes on the host
            (`LOCAL_WORLD_SIZE`). Past it, buffers are pageable (one warning).

    Example::

        cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
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
        offload_host_budget: int | None = None,
    ):
        _check_wrappable(model)
        config = CheckpointConfig() if config is None else config
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        discovery = discover_layers(model, layer_class)
        checkpoint_map = plan_layers(config, discovery.names)
        check_swappable(_swap_targets(discovery, checkpoint_map), model)
        super().__init__()
        self.model = model
        self._config = config
        self._discovery: Discovery = discovery
        self._map: CheckpointMap = checkpoint_map
        self._off_by: str | None = None
        self._inference = False
        self._restore_training: bool | None = None
        self._states: list[FlagInstall | ForwardInstall] = []
        self._routes = RouteOverrides(self._route_enable, self._route_disable)
        self._save_load = SaveLoadOverrides(self)
        self._mode_hook: Any = None
        self._offloader = Offloader(config.offload_min_bytes, offload_transport, offload_host_budget)
        self._swap_mover = swap_mover
        self._swapper: WeightSwapper | None = None
        self._ddp_patches = InstancePatches()

        # Trainer picks dataset columns from `inspect.signature(model.forward)`; a PeftModel's own
        # forward takes (*args, **kwargs), so show the transformers model's signature, as Trainer
        # does when it unwraps a PeftModel.
        base = model.get_base_model() if hasattr(type(model), "get_base_model") else model

        @functools.wraps(base.forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.model(*args, **kwargs)

        self.forward = forward
        self._install()

    # -- delegation (PEFT's pattern) -----------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":  # not set yet: no recursion through self.model
                raise
            return getattr(self.model, name)

    def forward(self, *args: Any, labels: Any = None, **kwargs: Any) -> Any:
        """Calls the wrapped model. Each instance replaces this with a function that shows the
        wrapped model's signature (for Trainer's column selection); this class-level one names
        `labels` because Trainer reads label names from the class (`find_labels(type(model))`),
        and without them it would evaluate `Trainer(model=cm)` with no eval loss."""
        if labels is not None:
            kwargs["labels"] = labels
        return self.model(*args, **kwargs)

    # -- public state --------------------------------------------------------------------------

    @property
    def config(self) -> CheckpointConfig:  # type: ignore[override]
        """The current `CheckpointConfig` (the wrapped model's own config is `cm.model.config`)."""
        return _ModelAwareConfig.bind(self._config, getattr(self.model, "config", None))

    @property
    def checkpoint_map(self) -> CheckpointMap:
        """The per-layer plan, in layer order. It is what runs whenever the model trains."""
        return self._map

    @property
    def is_enabled(self) -> bool:
        """True while remat's shims are installed (between `enable()` and `disable()`)."""
        return bool(self._states)

    @property
    def layers(self) -> list[nn.Module]:
        """The discovered layers, index i being `checkpoint_map[i]`."""
        return [layer.module for layer in self._discovery.layers]

    # -- enable / disable ----------------------------------------------------------------------

    def enable(self, config: CheckpointConfig | None = None) -> CheckpointedModel:
        """Turn checkpointing on, with `config` if given (else the current one). Returns self."""
        config = self._config if config is None else config
        if not isinstance(config, CheckpointConfig):
            raise TypeError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        self._replan(config, off_by=None, cause="enable()")
        if not self.is_enabled:
            self._install()
        return self

    def disable(self) -> CheckpointedModel:
        """Remove everything remat installed: flags, functions, routes, hooks. Returns self.

        The model is left as it was before wrapping (same parameters and state_dict, no hooks);
        `enable()` installs the shims again.
        """
        if not self.is_enabled:
            return self
        self._unswap()
        self._offloader.release_host_memory()
        for state in reversed(self._states):
            state.restore()
        self._states.clear()
        self._routes.uninstall()
        self._save_load.uninstall()
        if self._mode_hook is not None:
            self._mode_hook.remove()
            self._mode_hook = None
        self.model.__dict__.pop("_remat_owner", None)
        logger.info("remat disabled: the model's checkpointing is back to what it was before wrapping")
        return self

    # -- training / inference ------------------------------------------------------------------

    def for_inference(self) -> CheckpointedModel:
        """Eval mode with checkpointing off, so generation can use its cache. The map is kept.

        Usable as a context manager: ``with cm.for_inference(): ...`` returns to the previous
        mode (training, usually) on exit.
        """
        self._restore_training = self.model.training and not self._inference
        self._inference = True
        self.model.eval()
        self._apply_map()
        return self

    def for_training(self) -> CheckpointedModel:
        """Training mode with the map applied exactly as it is. Returns self."""
        self._restore_training = self.model.training and not self._inference
        self._inference = False
        self.model.train()
        self._apply_map()
        return self

    def __enter__(self) -> CheckpointedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        restore, self._restore_training = self._restore_training, None
        if restore:
            self.for_training()
        elif restore is not None:
            self.for_inference()

    @property
    def offload_stats(self) -> dict[int, LayerOffloadStats]:
        """Per layer index: bytes offloaded, bytes kept on the device and why, copies made,
        summed since the wrapper was made (or `reset_offload_stats()`)."""
        return dict(self._offloader.stats)

    def reset_offload_stats(self) -> None:
        self._offloader.reset_stats()

    @property
    def swap_stats(self) -> dict[int, LayerSwapStats]:
        """Per swapped layer: how many times its weights were fetched, and the bytes."""
        return {} if self._swapper is None else {i: e.stats for i, e in self._swapper.layers.items()}

    def summary(self) -> str:
        """The map's table with what offload and block swap did per layer."""
        return describe_map(self._map, self._offloader.stats, self.swap_stats)

    # -- measurement ---------------------------------------------------------------------------

    def memory_report(self, batch: Mapping[str, Any]) -> MemoryReport:
        """Run one training step on `batch` and measure, per layer: bytes held for backward after
        forward (device / host), resident weight bytes, and how often the layer ran (2 means
        recomputed). Gradients are left in place; no optimizer step is taken."""
        from .report import memory_report

        if self._inference or not self.model.training:
            raise RuntimeError("memory_report measures a training step: call cm.for_training() first")
        return memory_report(self, dict(batch))

    # -- save / load ---------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write the adapters exactly as PEFT writes them (when the model is a PeftModel; keyword
        arguments go to PEFT) and `checkpoint_config.json`, atomically. A plain base model saves
        the config alone: its weights are the user's to save."""
        save_checkpointed_model(self, save_directory, **kwargs)

    @classmethod
    def from_pretrained(
        cls, model: nn.Module, path: str | os.PathLike, is_trainable: bool = True, **kwargs: Any
    ) -> CheckpointedModel:
        """Load adapters (if `path` holds any) and the checkpoint config saved at `path` into
        `model` and wrap it. A model whose layers differ from the saved ones is refused before
        anything changes. `is_trainable=False` loads for inference (`for_inference()`); the map
        is applied whenever the model trains. Keyword arguments go to PEFT, except the wrapper's
        own (`offload_transport`, `swap_mover`, `layer_class`)."""
        return load_checkpointed_model(cls, model, path, is_trainable=is_trainable, **kwargs)

    # -- internals -----------------------------------------------------------------------------

    def _replan(self, config: CheckpointConfig, off_by: str | None, cause: str) -> None:
        """Plan first (errors leave everything as it was), then apply."""
        new_map = plan_layers(config, self._discovery.names, checkpointing_off_by=off_by)
        new_swapped = [p.index for p in new_map if p.swapped]
        if new_swapped != [p.index for p in self._map if p.swapped]:
            check_swappable(_swap_targets(self._discovery, new_map), self.model)
        changes = describe_changes(self._config, config)
        if changes:
            logger.info("%s changed the checkpoint config: %s", cause, changes)
        if new_map != self._map:
            logger.info("%s changed the checkpoint map: %r", cause, new_map)
        old = (self._config, self._off_by, self._map)
        old_swapped = [p.index for p in self._map if p.swapped]
        self._config, self._off_by, self._map = config, off_by, new_map
        self._offloader.min_bytes = config.offload_min_bytes
        if self.is_enabled:
            if new_swapped != old_swapped:
                self._unswap()
                try:
                    self._swap()
                except BaseException:  # e.g. pinned memory could not be had: back to the old plan
                    self._config, self._off_by, self._map = old
                    self._offloader.min_bytes = self._config.offload_min_bytes
                    self._swap()
                    raise
            self._apply_map()
        if off_by is None and not any(plan.policy == "offload" for plan in new_map):
            # The new plan offloads nothing (a route turning checkpointing off for a while does
            # not count: it comes back, and re-pinning costs more than keeping the pool).
            self._offloader.release_host_memory()

    def _install(self) -> None:
        self._swap()  # the step that can fail (host memory) goes first, before anything is patched
        self._states = [installer_for(d) for d in (*self._discovery.layers, *self._discovery.holders)]
        took_over = [s.module for s in self._states if s.was_checkpointing]
        if took_over:
            logger.info("remat took over checkpointing that was already enabled on %d module(s)", len(took_over))
        self._routes.install(self.model)
        self._save_load.install(self.model)
        self._mode_hook = self.model.register_forward_pre_hook(self._check_mode)
        object.__setattr__(self.model, "_remat_owner", True)
        self._apply_map()

    def _swap(self) -> None:
        targets = _swap_targets(self._discovery, self._map)
        if targets:
            self._swapper = WeightSwapper(self.model, targets, self._swap_mover)
            self._swapper.install_hooks({index: module for index, _, module in targets})
            self._exclude_swapped_from_ddp_sync()
            logger.info(
                "block swap: %d layer(s) keep their frozen weights in host memory; %d bytes of device slots",
                len(targets),
                self._swapper.pool_bytes,
            )

    def _exclude_swapped_from_ddp_sync(self) -> None:
        """DDP broadcasts every parameter when it is built; a swapped weight at rest is a
        placeholder it cannot write into. Frozen weights are the same on every rank and DDP never
        reduces them, so they are named in DDP's ignore list, for DDP(cm) and DDP(cm.model) alike."""
        swapped = {id(p) for entry in self._swapper.layers.values() for p in entry.params}
        names = [n for n, p in self.model.named_parameters(remove_duplicate=False) if id(p) in swapped]
        for target, prefix in ((self.model, ""), (self, "model.")):
            existing = list(target.__dict__.get("_ddp_params_and_buffers_to_ignore", []))
            self._ddp_patches.set(target, "_ddp_params_and_buffers_to_ignore", existing + [prefix + n for n in names])

    def _unswap(self) -> None:
        self._ddp_patches.undo()
        if self._swapper is not None:
            self._swapper.restore()
            self._swapper = None

    def _apply_map(self) -> None:
        """Make the installed flags say exactly what the map says, for the current mode."""
        if not self.is_enabled:
            return
        active = not self._inference
        layer_states = self._states[: len(self._discovery.layers)]
        holder_states = self._states[len(self._discovery.layers) :]
        for plan, state in zip(self._map, layer_states, strict=True):
            if plan.checkpointed and active:
                shim = RecomputeCheckpoint(
                    plan.index,
                    use_reentrant=self._config.use_reentrant,
                    preserve_rng_state=self._config.preserve_rng_state,
                    offloader=self._offloader,
                    offload=plan.policy == "offload",
                    swapper=self._swapper,
                    module=state.module,
                )
                state.set(True, shim)
            else:
                state.set(False, run_without_checkpoint)
        any_checkpointed = active and bool(self._map.checkpointed)
        for state in holder_states:
            state.set(any_checkpointed, None)

    def _check_mode(self, module: nn.Module, args: Any) -> None:
        """A model put back into training by `model.train()` (Trainer does it every step) after
        `for_inference()` must train with its map, not without checkpointing."""
        if self._inference and module.training:
            logger.info("the model was switched to training outside for_training(); applying the checkpoint map")
            self._inference = False
            self._apply_map()

    def _route_enable(self, route: str, kwargs_dict: Mapping[str, Any] | None, keywords: dict[str, Any]) -> None:
        config = config_from_route(self._config, route, kwargs_dict, keywords)
        self._replan(config, off_by=None, cause=route)

    def _route_disable(self, route: str) -> None:
        self._replan(self._config, off_by=route, cause=route)

    def _adopt_saved_config(self, config: CheckpointConfig, cause: str) -> None:
        """Take a config loaded from a checkpoint folder (resume, best model, load_adapter).

        It replaces the config but not the on/off state: checkpointing a route turned off stays
        off (the saved map applies when it is turned on again), and a disabled wrapper stays
        disabled, its config unchanged, with a warning.
        """
        if config == self._config:
            return
        if not self.is_enabled:
            logger.warning("%s: checkpointing is disabled, the saved checkpoint config is not applied", cause)
            return
        logger.info("%s: applying the saved checkpoint config", cause)
        self._replan(config, off_by=self._off_by, cause=cause)

    def extra_repr(self) -> str:
        return f"config={self._config!r}, map={self._map!r}, enabled={self.is_enabled}"
