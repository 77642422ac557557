"""The controller behind a `CheckpointedModel`: config, map, mode, ownership, and everything it
installs on the model's instances (`remat.install`, the routes, the save/load overrides, block swap),
all undone by `disable()`. It holds the model weakly and the model's patches hold it (`remat.refs`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import weakref
from typing import Any

import torch
from torch import nn

from .budget import BudgetState, bucket_text
from .compat.transformers_compat import kv_shared_across_layers, router_logits_recorded_inside_layers
from .config import CheckpointConfig
from .errors import BlockSwapError, ConfigError, ReplacedWrapperError, StateError
from .head import ChunkedHead, HeadPlan, causal_lm, plan_head
from .install import FlagInstall, ForwardInstall, installer_for
from .layers import DiscoveredLayer, Discovery, Placement
from .offload import Offloader
from .persistence import SaveLoadOverrides, is_mixed_peft_model, stray_adapter_layers
from .plan import CheckpointMap, plan_layers
from .policies import policy as policy_named
from .recompute import LayerCheckpoint, distributed_training, run_without_checkpoint, swappers_owed
from .refs import InstancePatches, Ref
from .routes import describe_changes, install_routes
from .swap import WeightSwapper, check_swappable, weights_in_use

logger = logging.getLogger("remat")

_Mode = tuple[bool, list[tuple[Ref[nn.Module], bool]]]  # (inference, training flag of every module)

# model or layer -> the controller that installed on it last, both weakly, kept outside the model (a disabled
# wrapper leaves nothing on it); a copy of a controller (deepcopy, pickle) is another controller.
_LAST_CLAIM: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Controller]] = weakref.WeakKeyDictionary()


def owners_of(model: nn.Module) -> list[Controller]:
    """The enabled controllers installed on the model or on a module inside it (a base model under a PeftModel, a
    layer: its last claim, held weakly, so a layer copied or pickled alone carries no controller)."""
    found: dict[int, Controller] = {}
    for module in model.modules():
        claim = _LAST_CLAIM.get(module)
        for owner in (module.__dict__.get("_remat_owner"), claim() if claim is not None else None):
            if owner is not None and owner.is_enabled:
                found[id(owner)] = owner
    return list(found.values())


def _refuse_prefix_tuning_checkpointed(model: nn.Module, new_map: CheckpointMap, config: CheckpointConfig) -> None:
    """Prefix tuning hands every layer its virtual keys and values as the cache, which transformers drops in a
    checkpointed layer: a shape error on transformers 5, silently wrong gradients on 4.57 (native checkpointing too)."""
    peft_type = getattr(getattr(model, "active_peft_config", None), "peft_type", None)  # a str enum
    if new_map.checkpointed and peft_type in ("PREFIX_TUNING", "CARTRIDGE"):
        do = (  # a budget takes no layer_policies: it checkpoints what it must
            f"A budget checkpoints the layers it must, so prefix tuning takes none: drop budget={config.budget!r} "
            "and checkpoint no layer"
            if config.budget is not None
            else "Checkpoint no layer"
        )
        raise ConfigError(
            f"{peft_type.value.lower()} passes its virtual tokens to every layer as the cache "
            f"(past_key_values), which transformers drops in a checkpointed layer (layers {new_map.checkpointed} "
            f"here): a shape error or wrong gradients. {do} (layer_policies={{i: 'none' for i in range(n)}}) or "
            "train another PEFT method (prompt tuning, LoRA); nothing was changed"
        )


def controller_of_wrapper(obj: Any) -> Controller | None:
    """The controller of a `CheckpointedModel`, else None (for rooms below `remat.model`)."""
    controller = obj.__dict__.get("_controller") if isinstance(obj, nn.Module) else None
    return controller if isinstance(controller, Controller) else None


def budget_reasons(checkpoint_map: CheckpointMap, config: CheckpointConfig, active: Any, bucket: Any) -> CheckpointMap:
    """With a budget, each row says so: pending until the first training step, then the bucket planned for."""
    if config.budget is None:
        return checkpoint_map
    scope = f"budget {config.budget} ({config.budget_scope})"
    if active is None:
        why = f"{scope}: planned on the first training step; until then {{}}"
    else:
        why = f"{scope}, planned for {bucket_text(bucket)}"
    plans = [dataclasses.replace(p, reason=why.format(p.reason)) for p in checkpoint_map]
    return CheckpointMap(plans, off=checkpoint_map.off, head=checkpoint_map.head)


def swap_targets(discovery: Discovery, checkpoint_map: CheckpointMap) -> list[tuple[int, str, nn.Module]]:
    return [(p.index, p.name, discovery.layers[p.index].module) for p in checkpoint_map if p.swapped]


class Controller:
    """Everything behind one wrapper. The model's `_remat_owner` names the enabled controller (a second wrapper is
    refused); `_LAST_CLAIM` the last to install on the model and each layer, so a replaced one refuses to come back
    and a wrapper of a model inside or around this one finds the layers taken."""

    def __init__(
        self,
        model: nn.Module,
        config: CheckpointConfig,
        discovery: Discovery,
        checkpoint_map: CheckpointMap,
        offloader: Offloader,
        swapper: WeightSwapper,
    ):
        self._model = Ref(model)
        self.config, self.discovery, self.checkpoint_map = config, discovery, checkpoint_map
        self._placement = Placement(model, discovery)  # where the layers were found
        self.offloader, self.swapper = offloader, swapper
        self.off_by: str | None = None
        self.inference, self.disabled_by = False, "cm.disable()"  # what turned remat off, while it is off
        self.unloaded_by: str | None = None  # PEFT's merge_and_unload()/unload(): the adapters left cm.model for good
        self._installs: list[FlagInstall | ForwardInstall] = []
        self._routes, self._model_patches, self._save_load = InstancePatches(), InstancePatches(), SaveLoadOverrides()
        self._hook: Any = None  # the model's forward pre-hook, while enabled
        self._watch: Any = None  # the budget's watch of a training forward's backward (a forward hook), until it ran
        self._head: ChunkedHead | None = None  # the chunked head's hooks, while enabled with head="chunked"
        self._head_planned: HeadPlan | None = None  # the map's head row shows what the last training forward ran
        self._guards: list[Any] = []
        self._mode_stack: list[_Mode] = []
        self._mode_before_call: _Mode | None = None
        self.wrapper: Ref[nn.Module] = Ref(None)  # the CheckpointedModel (a `LocalRef`), while it exists
        self._adopted_from: list[Ref[nn.Module]] = []  # models this one wrapped before `adopt`
        self._has_installed = False
        self._said_eval_mode = False
        self._said_layers_in_eval = False
        self._said_switched_back = False
        self._said_stray_adapters = False  # adapter layers in a model that is not a PeftModel: said once
        self._said_no_cache = False  # a budget's training forwards run without a KV cache: said once
        self._last_change: tuple[str, ...] = ()  # the last change made, by any cause: (cause, config changes, new map)
        self._said_moves: set[tuple[str, str, str]] = set()  # a route's map moves said since another kind of change
        self.budget = BudgetState()  # with CheckpointConfig(budget=...): the profile, plans per bucket, receipts
        self.measuring = False  # a profile's steps run: their maps are not the user's, neither planned nor logged

    @property
    def model(self) -> nn.Module:
        return self._model.alive("the model this wrapper checkpoints no longer exists; wrap the model you train")

    @property
    def is_enabled(self) -> bool:
        return bool(self._installs)

    def _owned_models(self) -> list[nn.Module]:
        return [m for m in (ref() for ref in (self._model, *self._adopted_from)) if m is not None]

    def _owned_layers(self) -> list[nn.Module]:
        """The layers and holders installed on (those still alive)."""
        found = (*self.discovery.layers, *self.discovery.holders)
        return [module for layer in found if (module := layer._module()) is not None]

    def claim_layers(self) -> None:
        """Record this controller as its layers' last claim (at install, and in a copy or an unpickled wrapper)."""
        for layer in self._owned_layers():
            _LAST_CLAIM[layer] = weakref.ref(self)

    @property
    def replaced(self) -> bool:
        """Another wrapper installed on an owned model or layer after this one (this one was disabled first)."""
        owned = [*self._owned_models(), *self._owned_layers()] if self._has_installed else []
        claims = [_LAST_CLAIM.get(module) for module in owned]
        return any(claim is not None and claim() is not self for claim in claims)

    def check_not_replaced(self, action: str) -> None:
        """Refuse `action` on a replaced wrapper: both would install on one model."""
        if self.replaced:
            raise ReplacedWrapperError(
                f"{action}: another CheckpointedModel took this wrapper's model over after this one was disabled, so "
                "this wrapper stays off (two wrappers would install on one model). Use the newer wrapper, or wrap the "
                "model again once that one is disabled: cm = CheckpointedModel(model, config). Nothing was changed"
            )

    def check_layers(self, action: str) -> None:
        """Refuse `action` where the model's layers changed since they were found (pruned, replaced, one added): the
        map would name layers that no longer run, and a save of it would not load into the model as it is."""
        if self._placement.same():
            return
        model = self.model
        if (change := self._placement.changed(model, self.discovery)) is not None:
            then = "Call cm.disable(), then wrap" if self.is_enabled else "Wrap"
            raise StateError(
                f"{action}: the model's layers changed since it was wrapped ({change}), so the map no longer says what "
                f"runs. {then} the model as it is now: cm = CheckpointedModel(cm.model, ...). Nothing was changed"
            )
        self._placement = Placement(model, self.discovery)  # wrappers put in the layers' places (compile, FSDP)

    def enable(self, config: CheckpointConfig, *, off_by: str | None = None, cause: str = "enable()") -> None:
        """Install with `config` (re-plan, if installed already)."""
        if not self.is_enabled:
            self.check_not_replaced("enable()")
            self.check_not_unloaded("enable()")
        self.replan(config, off_by, cause, install=True)

    def check_not_unloaded(self, action: str) -> None:
        """Refuse `action` once PEFT took the adapters out: cm.model holds none, and the model returned is plain."""
        if self.unloaded_by is not None:
            raise StateError(
                f"{action}: {self.unloaded_by} took the adapters out of this wrapper's model, so there is nothing of "
                "the trained model left in it to checkpoint or save (a save would write an empty adapter). Use the "
                f"model {self.unloaded_by} returned: merged.save_pretrained(folder), or CheckpointedModel(merged, "
                "cm.checkpoint_config) to train it on. Nothing was changed"
            )

    def disable(self, cause: str = "cm.disable()", *, say: bool = True) -> None:
        if not self.is_enabled:
            return
        self.disabled_by = cause
        self._uninstall()
        if say:
            logger.info("remat disabled: the model's checkpointing is back to what it was before wrapping")

    def _uninstall(self) -> None:
        """Everything an install (or a part of one) changed, undone."""
        if self._watch is not None:  # a budget's watch a Ctrl-C left (`_before_forward`)
            self._watch.remove()
            self._watch = None
        self.swapper.restore()
        self._set_head(None)
        self._model_patches.undo()
        self.offloader.release_host_memory()
        for install in reversed(self._installs):
            install.restore()
        self._installs.clear()
        self._routes.undo()
        self._save_load.uninstall()
        self._set_guards(False)
        if self._hook is not None:
            self._hook.remove()
        for model in self._owned_models():
            model.__dict__.pop("_remat_owner", None)

    def _install(self) -> None:
        model = self.model
        self._installs = []
        for found in (*self.discovery.layers, *self.discovery.holders):  # each kept as made, for `_uninstall`
            self._installs.append(installer_for(found))
        if took_over := [s.module for s in self._installs if s.was_checkpointing]:
            logger.info("remat took over checkpointing that was already enabled on %d module(s)", len(took_over))
        install_routes(self._routes, self, model)
        self._save_load.install(self, model)
        self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        for m in self._owned_models():  # the model keeps its controller alive
            object.__setattr__(m, "_remat_owner", self)
            _LAST_CLAIM[m] = weakref.ref(self)
        self.claim_layers()
        self._has_installed = True

    def adopt(self, model: nn.Module, cause: str) -> None:
        """Make `model`, built around this one's (TRL's `peft_config=`), the one this wrapper owns: the
        same layers under new names, the map kept. Raises, changing nothing, if a layer is missing."""
        if model is self.model:
            return
        self.check_layers(cause)  # the layers as they were found, before they are found again under new names
        names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
        lost = [layer.name for layer in self.discovery.layers if id(layer.module) not in names]
        if id(self.model) not in names or lost:
            raise ConfigError(
                f"{cause}: the trainer's model ({type(model).__name__}) does not contain the model this "
                f"CheckpointedModel wraps{f' (layers {lost[:3]} are missing)' if lost else ''}, so the map would not "
                "be what trains. Apply PEFT before wrapping: peft_model = get_peft_model(model, lora_config); "
                "cm = CheckpointedModel(peft_model); and pass no peft_config to the trainer"
            )
        renamed = lambda found: tuple(DiscoveredLayer(names[id(d.module)], d.module, d.kind) for d in found)
        discovery = Discovery(renamed(self.discovery.layers), renamed(self.discovery.holders))
        was_enabled = self.is_enabled
        self.disable(cause=cause, say=False)  # installed again on `model` below
        self._adopted_from.append(self._model)
        self._model, self.discovery, self._placement = Ref(model), discovery, Placement(model, discovery)
        if (wrapper := self.wrapper()) is not None:
            wrapper.model = model
        self.replan(self.config, self.off_by, cause, said=True, install=was_enabled)  # the map, under the new names
        logger.info(
            "%s: the CheckpointedModel now wraps the %s built around its model; its layers are %s ... and the map "
            "is kept: %r",
            cause,
            type(model).__name__,
            discovery.names[0],
            self.checkpoint_map,
        )

    def replan(
        self,
        config: CheckpointConfig,
        off_by: str | None,
        cause: str,
        *,
        said: bool = False,
        install: bool = False,
        planned: CheckpointMap | None = None,
    ) -> None:
        """The one path of `enable` and re-planning: plan once, run every check that can refuse before
        anything changes, then swap, install (`install`) or re-apply. `said`: the caller logged it."""
        active = self.budget.active_for(config)  # the plan of the current bucket (None: pending, another budget)
        map_config = (active or config) if config.budget is not None and planned is None else config
        if planned is None:
            planned = plan_layers(map_config, self.discovery.names, checkpointing_off_by=off_by)
        new_map = budget_reasons(planned, config, active, self.budget.active_bucket)
        head = plan_head(map_config.head, map_config.head_chunk_tokens, self.model)
        if active is not None and config.head == "chunked" and map_config.head != config.head:  # the budget's choice
            why = f"budget {config.budget} ({config.budget_scope}) chose the model's own head and loss"
            head = dataclasses.replace(head, reason=f"{why}, planned for {bucket_text(self.budget.active_bucket)}")
        # the same head planned again (a route, a mode change) keeps the row of what last ran
        shown = self.checkpoint_map.head if head == self._head_planned else None
        new_map = new_map.with_head(shown or head)
        installing = install and not self.is_enabled
        live = installing or self.is_enabled
        if live:
            self.check_layers(cause)
            self._check_swap_change(new_map)
            _refuse_prefix_tuning_checkpointed(self.model, new_map, config)
        # nothing refuses from here: what the new config plans is kept
        change = None
        if not said and not self.measuring:  # a profile says one line (a budget's) or shows a bar for all its steps
            change = self._log_changes(config, new_map, cause)
        before = (self.config, self.off_by, self.checkpoint_map, self._head_planned)
        self._head_planned = head
        try:
            self._make(config, off_by, new_map, installing=installing, live=live)
        except BaseException:  # Ctrl-C, an out-of-memory copy: the swap, flags and map of before, together
            self._put_back(*before, installing=installing, live=live)
            raise
        self.budget.config_changed(config)  # another budget config: planned on the next training step
        if off_by is None and not any(plan.offloaded for plan in new_map):
            # Nothing offloaded (a route's "off" comes back, and re-pinning costs more than torch's pinned cache).
            self.offloader.release_host_memory()
        if change is not None:  # made: said
            self._last_change = change
            if not change[1] and "checkpointing_" in cause:  # a route's toggle (TRL's around every generation)
                self._said_moves.add(change)
            else:  # the user's own change, or a config's: a route's next toggle is news again
                self._said_moves.clear()

    def _make(
        self, config: CheckpointConfig, off_by: str | None, new_map: CheckpointMap, *, installing: bool, live: bool
    ) -> None:
        if live:
            self._swap_to(new_map)
        self.config, self.off_by, self.checkpoint_map = config, off_by, new_map
        self.offloader.min_bytes = config.offload_min_bytes
        if installing:
            self._install()
        if live:
            self._exclude_swapped_from_ddp_sync()
            self.apply_map()

    def _put_back(
        self,
        config: CheckpointConfig,
        off_by: str | None,
        old_map: CheckpointMap,
        head: HeadPlan | None,
        *,
        installing: bool,
        live: bool,
    ) -> None:
        """A `replan` interrupted between its first change and its last: what was there before, swapped weights
        home or out again (a half-made swap left a swapped layer unflagged: its backward read placeholders)."""
        self._head_planned = head
        if live and not installing:
            self._make(config, off_by, old_map, installing=False, live=True)
            return
        if installing:  # a wrapper being built: nothing of it stays
            self._uninstall()
        self.config, self.off_by, self.checkpoint_map = config, off_by, old_map
        self.offloader.min_bytes = config.offload_min_bytes

    def shown_map(self, config: CheckpointConfig | None = None, checkpoint_map: CheckpointMap | None = None) -> str:
        """A map (the wrapper's, or `checkpoint_map` for `config`) as a log line says it: under a budget not planned
        yet, the map that stands for it (every layer recomputed) never runs a step, so the budget is named."""
        config = self.config if config is None else config
        checkpoint_map = self.checkpoint_map if checkpoint_map is None else checkpoint_map
        pending = config.budget is not None and self.budget.active_for(config) is None
        if pending and checkpoint_map.checkpointed:
            return f"the budget's ({config.budget}: planned on the first training step)"
        return repr(checkpoint_map)

    def _log_changes(self, config: CheckpointConfig, new_map: CheckpointMap, cause: str) -> tuple[str, str, str]:
        """Says the change, unless it is the last change made, again, or a route (`*checkpointing_enable/disable`)
        said this move of the map with no config change since the last change of another kind (TRL's disable and
        enable around every generation, under a budget to each bucket's map: news the first time); returns the change,
        which `replan` records once it is made."""
        changes = describe_changes(self.config, config)
        change = (cause, changes, repr(new_map) if new_map != self.checkpoint_map else "")
        if self._last_change == change or change in self._said_moves:
            return change
        if changes:
            logger.info("%s changed the checkpoint config: %s", cause, changes)
        if new_map != self.checkpoint_map:
            logger.info("%s changed the checkpoint map: %s", cause, self.shown_map(config, new_map))
        elif changes and config.layer_policies and "layer_policies" not in changes:
            logger.info(  # a planned config names every layer
                "%s: the map stays as it was: layer_policies names the layers these options would change", cause
            )
        return change

    def _check_swap_change(self, new_map: CheckpointMap) -> None:
        """Refuse a swap that cannot be made, or would move weights an autograd graph still holds."""
        targets = swap_targets(self.discovery, new_map)
        for index in (t[0] for t in targets if t[0] in self.swapper.layers):  # staying: still frozen
            self.swapper.layers[index].check_frozen()
        joining = [t for t in targets if t[0] not in self.swapper.layers]
        check_swappable(joining, self.model)
        # A forward checkpointed under another wrapper (disabled, dropped or replaced since) recomputes the layer with
        # that wrapper's swapper, which would not fetch the weights this one moves out: the recompute would read
        # placeholders. This wrapper's own forwards fetch them (the swapper is asked at recompute time).
        if owed := [t[0] for t in joining if any(s is not self.swapper for s in swappers_owed(t[2]))]:
            raise BlockSwapError(
                f"cannot start swapping layers {owed} now: a forward made under another CheckpointedModel on this "
                "model (disabled, dropped or replaced since) still owes its backward, whose recompute of those layers "
                "would read the weights moved out and compute wrong gradients. Run that backward first (or drop that "
                "forward's outputs), then swap; nothing was changed"
            )
        if held := joining and weights_in_use(joining, self.model):  # (walks every parameter: only when one joins)
            raise StateError(
                f"cannot start swapping layers {[t[0] for t in joining]} now: {held[0]} (and {len(held) - 1} more) is "
                "held by an autograd graph whose backward has not run (a forward with gradients), and moving it out "
                "would change those gradients. Call backward first, or drop that forward's outputs (a forward that "
                "raised at a prompt is held by its traceback: sys.last_exc = sys.last_value = sys.last_traceback = "
                "None); nothing was changed"
            )

    def _swap_to(self, new_map: CheckpointMap) -> None:
        joined, left = self.swapper.update(self.model, swap_targets(self.discovery, new_map))
        if joined:
            logger.info(
                "block swap: layer(s) %s keep their frozen weights in host memory; %d bytes of device slots",
                joined,
                self.swapper.pool_bytes,
            )
        if left:
            logger.info("block swap: layer(s) %s have their weights back on the device", left)

    def _exclude_swapped_from_ddp_sync(self) -> None:
        """DDP would broadcast a swapped weight's placeholder; frozen, it is the same on every rank: ignored."""
        self._model_patches.undo()
        if self.swapper.layers:
            own = list(self.model.__dict__.get("_ddp_params_and_buffers_to_ignore", []))
            self._model_patches.set(self.model, "_ddp_params_and_buffers_to_ignore", own + self.swapper.swapped_names)

    def apply_map(self) -> None:
        """Make the installed flags say exactly what the map says, for the current mode."""
        if not self.is_enabled:
            return
        active, count = not self.inference, len(self.discovery.layers)
        for plan, install in zip(self.checkpoint_map, self._installs[:count], strict=True):
            if plan.checkpointed and active:
                shim = LayerCheckpoint(
                    plan.index,
                    policy_named(plan.policy),
                    use_reentrant=self.config.use_reentrant,
                    preserve_rng_state=self.config.preserve_rng_state,
                    offloader=self.offloader,
                    offload=plan.offloaded,
                    swapper=self.swapper,
                    module=install.module,
                )
                install.set(True, shim)
            else:
                install.set(False, run_without_checkpoint)
        for holder in self._installs[count:]:
            holder.set(active and bool(self.checkpoint_map.checkpointed), None)
        self._set_guards(self.inference)
        self._set_head(self._head_planned)

    def _set_head(self, plan: HeadPlan | None) -> None:
        """The chunked head's hooks for `plan` (none for a plain head, or None). They act on training
        forwards only, so the mode needs no change here. Hooks that exist take a new plan in place
        (a budget re-plans inside the model's forward pre-hooks, whose list that call has already read)."""
        if self._head is not None and plan is not None:
            self._head.plan = plan  # "plain": its hooks stand down until a chunked plan comes back
        elif self._head is not None:
            self._head.remove()
            self._head = None
        elif plan is not None and plan.policy == "chunked":
            self._head = ChunkedHead(self.model, plan, self._head_ran)

    @torch.compiler.disable  # bookkeeping: traced with dynamic shapes, dynamo failed comparing the rows
    def _head_ran(self, why: str | None) -> None:
        """The head row says what the last training forward ran: the plan, or the model's own head and why."""
        planned = self._head_planned  # set by every replan, before a ChunkedHead exists
        shown = planned if why is None else HeadPlan(planned.name, "plain", None, f"{planned.label} planned; {why}")
        if self.checkpoint_map.head != shown:
            self.checkpoint_map = self.checkpoint_map.with_head(shown)
        self.budget.head_ran(shown.label)

    def set_mode(self, inference: bool) -> None:
        """`for_inference()` / `for_training()`; a `with` block around the call restores the mode before."""
        self.check_not_replaced("for_inference()" if inference else "for_training()")
        self._mode_before_call = self._mode()
        self.inference = inference
        self.model.train(not inference)
        self.apply_map()

    def enter(self) -> None:
        mode, self._mode_before_call = self._mode_before_call or self._mode(), None
        self._mode_stack.append(mode)

    def exit(self) -> None:
        if not self._mode_stack:
            raise StateError(
                "cm.__exit__() without a matching cm.__enter__(): use the wrapper as a context manager with "
                "`with cm.for_inference(): ...` (or `with cm: ...`), which enters and exits in pairs"
            )
        self.inference, flags = self._mode_stack.pop()
        for module, training in flags:
            if (alive := module()) is not None:
                alive.training = training
        self.apply_map()

    def _mode(self) -> _Mode:
        return (self.inference, [(Ref(m), m.training) for m in self.model.modules()])

    def _set_guards(self, on: bool) -> None:
        for handle in self._guards:
            handle.remove()
        self._guards.clear()
        for plan, layer in zip(self.checkpoint_map, self.discovery.layers, strict=True) if on else ():
            if plan.checkpointed:
                guard = functools.partial(self._refuse_training_in_inference, plan.index, plan.name)
                self._guards.append(layer.module.register_forward_pre_hook(guard, prepend=True))

    def _before_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        """A model put back into training behind our back (Trainer calls `model.train()`) trains with its map;
        with a budget, a training forward first gets its bucket's plan (`remat.budget`)."""
        self._mode_before_call = None  # a `with` needs the mode call right before it
        self.offloader.forward_started()
        if self._watch is not None:  # an earlier forward's, left by a Ctrl-C (torch runs always_call hooks on an
            self._watch.remove()  # Exception only): it would mark this forward as owing a backward
            self._watch = None
        if self.inference and (module.training or any(layer.module.training for layer in self.discovery.layers)):
            if not self._said_switched_back:  # a loop that evaluates this way does it at every evaluation
                self._said_switched_back = True
                logger.info("the model was switched to training outside for_training(); applying the checkpoint map")
            self.inference = False
            self.apply_map()
        grad = torch.is_grad_enabled()
        if not module.training and not self.inference and self.off_by is None and grad:
            self._say_eval_mode_runs_no_checkpoint()
        training = module.training and grad
        if training and not self.inference and self.off_by is None:
            self.check_layers("a training forward")
            if not self._said_layers_in_eval:
                self._say_layers_in_eval_mode()
        if training and not self._said_stray_adapters:
            self._say_adapters_unsaved()
        if training and self.config.use_reentrant and not self.inference:
            self._refuse_outputs_reentrant_loses(kwargs)
        if not training or self.config.budget is None or self.off_by is not None or self.inference:
            return None
        return self._budget_step(module, args, kwargs)

    @torch.compiler.disable  # measuring and planning run eagerly: traced by dynamo, a compiled first step failed
    def _budget_step(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        """A budget's training forward: its bucket's plan, then a watch for its backward."""
        # as a checkpointed model's forward does (transformers turns the cache off): the cache also changes how a
        # packed row without a mask attends, so a map that changes per step would change the loss per step
        if (slot := _use_cache_slot(module)) is not None:
            args, cached = _without_cache(slot, args, kwargs)
            if cached is None:  # not given: the model's config says
                cached = _use_cache_of(causal_lm(module))
            if cached and not self._said_no_cache:
                self._said_no_cache = True
                logger.info(
                    "budget: training forwards run with use_cache=False, whatever the map (as transformers runs a "
                    "checkpointed model; with the cache on, a packed row without an attention mask attends across "
                    "its sequences, and the loss would change with the map)"
                )
        if self.measuring:
            return args, kwargs
        if passed := next((v for v in (*args, *kwargs.values()) if isinstance(v, nn.Module)), None):
            _undo_forward_redirection(module)
            raise ConfigError(
                f"budget: this training forward was called with a module ({type(passed).__name__}) among its "
                "arguments, not a batch: a trainer routing its own loss through the model's forward (TRL's "
                "DistillationTrainer does, for DDP and FSDP). The budget measures and plans from a batch the model's "
                "forward takes, which this step has not; give the map instead, planned once from a batch of yours: "
                "cm.enable(cm.profile(batch).plan(budget)), or CheckpointConfig(every_n_layers=...). This forward "
                "did not run"
            )
        budget, batch = self.budget, {**_named_positionals(module, args), **kwargs}
        budget.before_step(self, batch)
        # after every other hook (the chunked head's replaces the output): watch this forward's backward. Not called
        # when the forward or a hook raises (the chunked head's loss out of memory): nothing was returned to owe a
        # backward for, and the next forward (or `_uninstall`) removes it
        self._watch = handle = module.register_forward_hook(
            lambda m, a, output: (handle.remove(), budget.watch_backward(output))[0]
        )
        return args, kwargs

    def _refuse_outputs_reentrant_loses(self, kwargs: dict[str, Any]) -> None:
        """Reentrant checkpointing runs a layer's forward without gradients, so an output transformers records by a
        hook inside the layer carries none: an MoE's router logits, which its aux loss is made of, and the router
        would silently not learn from it (transformers' own reentrant checkpointing does the same)."""
        if not (self.checkpoint_map.checkpointed or self.config.budget is not None) or distributed_training():
            return
        if router_logits_recorded_inside_layers(self.model, kwargs):
            raise ConfigError(
                "use_reentrant=True would lose the gradient of the router_logits this forward records: transformers "
                "records them by hooks inside the layers, which reentrant checkpointing runs without gradients (an "
                "MoE's aux loss would not train its router). Use use_reentrant=False (the default), or do not ask for "
                "them (output_router_logits=False)"
            )
        if kv_shared_across_layers(self.model):
            raise ConfigError(
                "use_reentrant=True would lose gradients of this model's shared keys and values: its later layers read "
                "those earlier layers computed (num_kv_shared_layers), which reentrant checkpointing runs without "
                "gradients, so the loss is right and the gradients are wrong. Use use_reentrant=False (the default)"
            )

    def _say_eval_mode_runs_no_checkpoint(self) -> None:
        """Once per wrapper: a model left in eval mode (as `from_pretrained` returns it) trains without its map."""
        if not self._said_eval_mode and (self.checkpoint_map.checkpointed or self.config.budget is not None):
            self._said_eval_mode = True
            logger.warning(
                "a forward with gradients while the model is in eval mode (model.eval(), or as from_pretrained "
                "returned it): layers checkpoint only in training mode, as in transformers, so this one keeps every "
                "activation (and runs no dropout). Call cm.train() or cm.for_training() to train with the map"
            )

    def _say_layers_in_eval_mode(self) -> None:
        """Once per wrapper: checkpointed layers in eval mode inside a model that trains (another model's `.eval()`
        reached layers the two share, or a mode set by hand) run without their checkpoint, as in transformers."""
        layers = self.discovery.layers
        if idle := [i for i in self.checkpoint_map.checkpointed if not layers[i].module.training]:
            self._said_layers_in_eval = True
            logger.warning(
                "a training forward while layers %s are in eval mode (another model's .eval() on layers it shares, or "
                "set by hand): layers checkpoint only in training mode, as in transformers, so these keep every "
                "activation although the map checkpoints them. Call cm.train() to train with the map",
                idle,
            )

    def _say_adapters_unsaved(self) -> None:
        """Adapter layers in cm.model, which is not a PeftModel: PEFT applied around it after wrapping (a trainer's
        `peft_config=` given `model=cm.model`; its PeftModel is not the wrapper's, so its checkpoints hold no
        checkpoint_config.json), or transformers' own `add_adapter`. Looked for in the first layer at each training
        forward (a few modules), the whole model once found."""
        if not stray_adapter_layers(self.discovery.layers[0].module, self.model) or not (
            stray := stray_adapter_layers(self.model, self.model)
        ):
            return
        self._said_stray_adapters = True
        if is_mixed_peft_model(self.model):
            logger.warning(
                "cm.model is a PeftMixedModel (get_peft_model(..., mixed=True)): the map runs, but PEFT cannot save "
                "such a model, so neither can cm.save_pretrained (refused); train one adapter type in a PeftModel "
                "to save it"
            )
            return
        by = (
            "transformers' add_adapter"
            if getattr(self.model, "_hf_peft_config_loaded", False)
            else "PEFT applied around it after wrapping (a trainer given model=cm.model and peft_config=?), whose "
            "PeftModel's checkpoints hold no checkpoint_config.json"
        )
        logger.warning(
            "cm.model has PEFT adapter layers (%s, ...) but is not a PeftModel: %s. The map runs, but "
            "cm.save_pretrained refuses to save them. Apply PEFT first (cm = CheckpointedModel(get_peft_model(model, "
            "lora_config))), or hand a trainer the wrapper: remat_trainer_class(SFTTrainer)(model=cm, peft_config=...)",
            stray[0],
            by,
        )

    def _refuse_training_in_inference(self, index: int, name: str, module: nn.Module, args: Any) -> None:
        """A checkpointed layer run alone (not via the model's forward) in training mode would skip its checkpoint."""
        if self.inference and module.training and torch.is_grad_enabled():
            raise StateError(
                f"layer {index} ({name}) is in training mode with gradients enabled, but the wrapper is in "
                "inference mode (checkpointing off), so it would train without its checkpoint. Call "
                "cm.for_training() first, or run the whole model (cm(...) or cm.model(...)), which applies the map"
            )

    def save_extras(self) -> dict[str, Any]:
        """Keys a save writes into `checkpoint_config.json` beside the config (`remat.persistence.pair_format`)."""
        return self.budget.save_extras(self.config, self.model)

    def adopt_saved_config(self, config: CheckpointConfig, cause: str) -> None:
        """A config loaded from a checkpoint folder; a route's "off" stays off, a disabled wrapper off, each with the
        saved config, which applies when checkpointing is turned on again."""
        if config == self.config:
            return
        if self.unloaded_by is not None:
            logger.warning(
                "%s: %s took the adapters out of this wrapper; the saved config is not applied", cause, self.unloaded_by
            )
            return
        own_config, own_map = self.config, self.shown_map()
        self.replan(config, off_by=self.off_by, cause=cause, said=True)  # disabled: planned for enable()
        if not self.is_enabled:
            logger.warning(
                "%s: checkpointing is disabled and stays off; the saved checkpoint config (%s) applies when "
                "cm.enable() turns it on",
                cause,
                describe_changes(own_config, config),
            )
            return
        logger.warning(
            "%s: the saved checkpoint config replaced this wrapper's own (%s): the map was %s, it is now %s. To keep "
            "your own, apply it again after loading: cm.enable(config) (with a Trainer: README, 'Resuming')",
            cause,
            describe_changes(own_config, config),
            own_map,
            self.shown_map(),
        )


def _use_cache_position(forward: Any) -> int | None:
    """The position of the `use_cache` argument of `forward` (what torch calls: a class's method, or one set on the
    instance), -1 where it goes by keyword only or into **kwargs, None where it cannot be passed."""
    if (parameters := _parameters_of(forward)) is None:  # no signature to read: left as the caller gave it
        return None
    for position, parameter in enumerate(parameters):
        if parameter.name == "use_cache":
            return position if parameter.kind is parameter.POSITIONAL_OR_KEYWORD else -1
    return -1 if any(p.kind is p.VAR_KEYWORD for p in parameters) else None


def _use_cache_slot(model: nn.Module) -> int | None:
    """Where the model's forward takes `use_cache` (`_use_cache_position`) when the transformers model inside (under
    PEFT or not) reads it: its forward names it, or hands it on through **kwargs with the setting in its config (a
    VLM's text model); None when it does not (a remote-code model's **kwargs may reach blocks that refuse it)."""
    base = causal_lm(model)
    named = any(p.name == "use_cache" for p in _parameters_of(type(base).forward) or ())
    if not named and _use_cache_of(base) is None:
        return None
    return _use_cache_position(model.forward)


def _undo_forward_redirection(model: nn.Module) -> None:
    """Put back the forward a redirection (TRL's and Lightning's `_ForwardRedirection`) replaced on the instance: it
    restores it only inside its own forward, which a refused call never runs (the next call ran TRL's loss)."""
    patched = model.__dict__.get("forward")
    if not (inspect.isfunction(patched) and patched.__name__ == "wrapped_forward" and patched.__closure__):
        return  # (another wrapper of the forward, transformers' pipeline-parallel one, stays)
    cells = dict(zip(patched.__code__.co_freevars, patched.__closure__, strict=True))
    if not {"original_forward", "original_module", "method"} <= cells.keys():
        return
    with contextlib.suppress(ValueError):  # an empty cell
        if cells["original_module"].cell_contents is model:
            model.forward = cells["original_forward"].cell_contents


def _named_positionals(model: nn.Module, args: tuple[Any, ...]) -> dict[str, Any]:
    """The call's positional arguments by the names the model's forward gives them (the transformers model's under a
    forward taking *args), as the budget's measuring steps call the model: `model(**batch)`. One it cannot name is
    `input_ids`, as transformers' first argument is."""
    names: list[str] = []
    for forward in (model.forward, causal_lm(model).forward) if args else ():
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = [p.name for p in _parameters_of(forward) or () if p.kind in kinds]
        if len(names) >= len(args):
            return dict(zip(names, args, strict=False))
    if len(args) > 1:
        raise ConfigError(
            f"budget: this call passes {len(args)} positional arguments and {type(model).__name__}.forward names "
            f"{len(names)} ({', '.join(names) or 'none'}); pass the batch by keyword (cm(input_ids=..., labels=...)), "
            "as the budget's measuring steps call the model with it"
        )
    return {"input_ids": args[0]} if args else {}


# forward -> its parameters, held weakly: a partial set on one instance (accelerate's hooks) holds its module, which a
# cache holding it would keep alive
_PARAMETERS: weakref.WeakKeyDictionary[Any, tuple[inspect.Parameter, ...] | None] = weakref.WeakKeyDictionary()


def _parameters_of(forward: Any) -> tuple[inspect.Parameter, ...] | None:
    """The parameters of `forward` after `self` where it is a bound method; None where it has no signature."""
    function, bound = getattr(forward, "__func__", forward), hasattr(forward, "__self__")
    try:
        parameters = _PARAMETERS[function]
    except (KeyError, TypeError):  # not read yet, or cannot be held weakly (then read each time)
        try:
            parameters = tuple(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):
            parameters = None
        with contextlib.suppress(TypeError):
            _PARAMETERS[function] = parameters
    return None if parameters is None else parameters[int(bound) :]


def _use_cache_of(model: nn.Module) -> bool | None:
    """The model config's `use_cache` (a VLM's is its text config's); None where it has none."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return getattr(config, "use_cache", getattr(text, "use_cache", None))


def _without_cache(slot: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
    """The call's positional arguments with `use_cache=False`, set there (at `slot`) or in `kwargs` (in place), and
    the value the caller gave (None: none)."""
    if 0 <= slot < len(args):
        return (*args[:slot], False, *args[slot + 1 :]), args[slot]
    given, kwargs["use_cache"] = kwargs.get("use_cache"), False
    return args, given
