"""`WeightSwapper`: which layers are swapped, moving them out and home (a joining layer takes its host copy first, what
can fail, so a refusal changes nothing), and its guards on a swapped layer (and on the model), undone when it leaves:
forward hooks fetch its weights (eagerly under `torch.compile`: inductor cannot compile a `set_` on a graph input);
`state_dict()`, `load_state_dict()` and `.to()` work on the host copies; copies, pickling, DataParallel, `assign=True`
loads and PEFT merges are refused. All but the forward hooks sit on every module of the layer holding swapped weights
(`layer.mlp` is called without the layer), each working on the weights the module holds itself."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..errors import BlockSwapError, ConfigTypeError, StateError
from ..refs import InstancePatches, Ref
from ..transport import WeightMover, transport_for
from .checks import check_swappable, own_frozen_params, parameter_owners
from .slots import LayerSwapStats, Schedule, SlotPool, SwappedLayer, placeholder


class WeightSwapper:
    def __init__(self, mover: WeightMover | None = None, prefetch_depth: int = 2):
        self._fixed_mover = mover
        self.layers: dict[int, SwappedLayer] = {}  # ascending index; the schedule reads this dict
        self.pool = SlotPool(prefetch_depth)
        self.schedule = Schedule(self.layers, self.pool)
        self._model_guards = ModelGuards(self)
        self.swapped_names: list[str] = []  # the swapped parameters' names in the model, in its order

    def __reduce__(self) -> Any:
        """A copy of a wrapper that swaps nothing gets a fresh swapper; one that swaps is refused."""
        if self.layers:
            layer = next(iter(self.layers.values()))
            raise ConfigTypeError(refusal(layer.index, layer.name, "copy"))
        return (type(self), (self._fixed_mover, self.pool.prefetch_depth))

    @property
    def resident_bytes(self) -> int:
        return self.pool.resident_bytes

    @property
    def peak_resident_bytes(self) -> int:
        return self.pool.peak_resident_bytes

    @peak_resident_bytes.setter
    def peak_resident_bytes(self, value: int) -> None:  # the report and the planner reset it
        self.pool.peak_resident_bytes = value

    def reset_stats(self) -> None:
        """Every swapped layer's fetch counts back to zero, the resident peak to what is resident now."""
        for layer in self.layers.values():
            layer.stats = LayerSwapStats()
        self.pool.peak_resident_bytes = self.pool.resident_bytes

    @property
    def pool_bytes(self) -> int:
        return self.pool.size_bytes(list(self.layers.values()))

    def update(self, model: nn.Module, targets: list[tuple[int, str, nn.Module]]) -> tuple[list[int], list[int]]:
        """Swap exactly `targets` (index, name, module); returns (joined, left) indices."""
        wanted = {index: (name, module) for index, name, module in targets}
        joining = sorted((i, name, module) for i, (name, module) in wanted.items() if i not in self.layers)
        leaving = [i for i in self.layers if i not in wanted]
        check_swappable(joining, model)
        owners = parameter_owners(model) if joining else {}
        entries = [(self._new_layer(i, name, module, owners), module) for i, name, module in joining]
        for index in leaving:
            self._leave(index)
        for layer, module in entries:  # known first: an interrupted join is undone by the next update or restore
            self.layers[layer.index] = layer
            guard_layer(self, layer, module)
            layer.rest()
        ordered = sorted(self.layers.items())
        self.layers.clear()
        self.layers.update(ordered)  # the same dict: the schedule holds it
        swapped = {id(p) for layer in self.layers.values() for p in layer.params}
        self.swapped_names = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in swapped]
        self.pool.keep_only(self.layers.values())
        if self.layers:
            self._model_guards.install(model)
        else:
            self._model_guards.remove()
        return [i for i, _, _ in joining], leaving

    def restore(self) -> None:
        """Bring every weight home (`update()` swaps again)."""
        for index in list(self.layers):
            self._leave(index)
        self.pool.keep_only(self.layers.values())
        self._model_guards.remove()
        self.schedule.reset()

    def _new_layer(self, index: int, name: str, module: nn.Module, owners: dict[int, set[str]]) -> SwappedLayer:
        params = own_frozen_params(module, name, owners)
        mover = self._mover_for(params[0].device)
        host = [mover.host_copy(p.data) for p in params]
        placeholders = [placeholder(p.shape, p.dtype, p.device) for p in params]
        return SwappedLayer(index, name, params, host, placeholders, mover)

    def _mover_for(self, device: torch.device) -> WeightMover:
        return self._fixed_mover if self._fixed_mover is not None else transport_for(device)

    def _leave(self, index: int) -> None:
        """Layer `index` home and no longer swapped: every copy made before a weight changes, the layer forgotten
        only once home, then its hooks off. A copy interrupted (Ctrl-C, out of memory) left a weight at its
        placeholder's zeros, its host copy gone; a layer home but still listed, without its hooks, trained on
        zeros after its next fetch. Interrupted now, it stays swapped with its host copy and its hooks."""
        layer = self.layers[index]
        self._bring_home(layer)
        try:
            del self.layers[index]
        finally:
            _unhook(layer.handles, layer.patches)

    def _bring_home(self, layer: SwappedLayer) -> None:
        """The true values back in place, on the device, as plain tensors (hooks and patches stay: `_leave`)."""
        for event in layer.ready or ():  # copies still writing into the slot must finish first
            event.synchronize()
        self.pool.release(layer)  # at rest now (a weight a forward replaced became the host copy)
        # The host copy is the swapper's own: on a CPU model it becomes the weight itself.
        same_place = lambda host, rest: host.device == rest.device and not host.is_pinned()
        homes = [
            host if same_place(host, rest) else host.to(rest.device, copy=True)
            for host, rest in zip(layer.host, layer.placeholders, strict=True)
        ]
        for param, home in zip(layer.params, homes, strict=True):
            param.data = home

    def apply_to_layer(self, index: int, module: nn.Module, original_apply: Any, fn: Any, recurse: bool) -> Any:
        """`module.to(...)` and friends on a module of a swapped layer: the host copies and placeholders of the swapped
        weights it holds itself follow (those of its children follow in their own `_apply`, which torch calls)."""
        layer = self.layers[index]
        layer.take_writes_at_rest()  # `.data` cast or written since, before `.to()` sets it again (the outermost call)
        layer.converting += 1
        try:
            return self._apply_to_own(layer, module, original_apply, fn, recurse)
        finally:
            layer.converting -= 1
            if layer.slot is None and not layer.converting:  # the conversion's own writes (swap_tensors bumps versions)
                layer.rest_versions = [p._version for p in layer.params]

    def _apply_to_own(self, layer: SwappedLayer, module: nn.Module, original_apply: Any, fn: Any, recurse: bool) -> Any:
        index = layer.index
        own = {id(p) for p in module.parameters(recurse=False)}
        mine = [i for i, p in enumerate(layer.params) if id(p) in own]
        if not mine:
            return original_apply(fn, recurse)
        # What `fn` does is read off empty tensors: applied to a placeholder it would allocate the full tensor.
        probes = {i: fn(layer.placeholders[i].new_empty(0)) for i in mine}
        if any(probe.device.type == "meta" for probe in probes.values()):  # a host copy cannot follow it there
            raise BlockSwapError(
                f"layer {index} is block-swapped: its frozen weights live in host memory, which the meta device "
                "cannot hold (modules torch converted before it are on the meta device now); call cm.disable() (the "
                "weights come home), then move the model"
            )
        self.pool.release(layer)
        for i in mine:
            param = layer.params[i]
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)  # hidden from torch's loop
        try:
            result = original_apply(fn, recurse)
        except BaseException:
            layer.rest()
            raise
        for i, probe in probes.items():
            host, old = layer.host[i], layer.placeholders[i]
            converted = host.to(dtype=probe.dtype)
            if probe.device.type != old.device.type or (host.is_pinned() and not converted.is_pinned()):
                # e.g. .cuda(), or a dtype change of a pinned copy: the new copy is made (pinned) by the mover
                converted = self._mover_for(probe.device).host_copy(converted)
            layer.host[i], layer.placeholders[i] = converted, placeholder(old.shape, probe.dtype, probe.device)
            layer.params[i].data = layer.placeholders[i]  # only these: a parent's own weights may still be hidden
        layer.mover = self._mover_for(probe.device)  # where these went (a layer's weights share one device)
        self.pool.keep_only(self.layers.values())
        return result


def guard_layer(swapper: WeightSwapper, layer: SwappedLayer, module: nn.Module) -> None:
    """Forward hooks on the layer; the other guards on it and on every module inside it holding swapped weights (in it
    or below), which torch and users call without the layer's: `layer.mlp.state_dict()` read placeholder zeros, its
    `.to(dtype)` was undone at the next fetch, its copies held zeros."""
    guard = _LayerGuard(swapper, layer.index, layer.name, module)
    # the fetch before your pre-hooks and the release after your forward hooks (kept last at each call, as you may add
    # one after wrapping): a hook that read the layer's weights read placeholder zeros
    guard.release = module.register_forward_hook(torch.compiler.disable(guard.after_forward), always_call=True)
    layer.handles += [module.register_forward_pre_hook(torch.compiler.disable(guard.before_forward), prepend=True)]
    layer.handles.append(guard.release)
    where = {
        id(p): (owner, name) for owner in module.modules() for name, p in owner._parameters.items() if p is not None
    }
    guard.places = [(Ref(where[id(p)][0]), where[id(p)][1], p) for p in layer.params if id(p) in where]
    swapped = {id(p) for p in layer.params}
    for inner in module.modules():
        if not any(id(p) in swapped for p in inner.parameters()):
            continue
        guard = _LayerGuard(swapper, layer.index, layer.name, inner)
        layer.handles += [
            # torch marks this hook with an attribute, which a bound method cannot take: a partial can
            inner.register_state_dict_post_hook(functools.partial(_LayerGuard.state_dict_reads_host_copies, guard)),
            inner.register_load_state_dict_pre_hook(guard.load_writes_host_copies),
            inner.register_load_state_dict_post_hook(guard.load_done),
        ]
        layer.patches.set(inner, "_apply", guard.apply)
        layer.patches.set(inner, "__deepcopy__", guard.deepcopy)
        layer.patches.set(inner, "__reduce_ex__", guard.pickle)
        layer.patches.set(inner, "_replicate_for_data_parallel", guard.replicate)


def _replaced(place: Ref[nn.Module], name: str, param: nn.Parameter) -> bool:
    """Whether a swapped weight's place holds something else now: a parametrization (made from the placeholder,
    whether it moved the Parameter or kept it, as spectral_norm's does), or another Parameter. A plain tensor there
    is `torch.func.functional_call`'s, for that call only."""
    if (owner := place()) is None:
        return False
    now = owner._parameters.get(name)
    return (
        parametrize.is_parametrized(owner, name)
        or name not in owner._parameters
        or (isinstance(now, nn.Parameter) and now is not param)
    )


def _unhook(handles: list[Any], patches: InstancePatches) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
    patches.undo()


def refusal(index: int, name: str, what: str) -> str:
    return (
        f"cannot {what}: block swap keeps the frozen weights of layer {index} ({name}) in host "
        "memory, and its parameters hold placeholders. Bring the weights home first with "
        "cm.enable(cm.checkpoint_config.replace(swap_layers=0)) or cm.disable(); nothing was copied"
    )


def assign_refusal(indices: list[int]) -> str:
    return (
        f"load_state_dict(assign=True) would replace the parameters of layers {indices}, whose frozen weights "
        "block swap keeps in host memory; load with assign=False (the default), which writes into the host "
        "copies, or bring the weights home first with cm.disable()"
    )


class _LayerGuard:
    """The hooks and patches of one swapped layer; each reads the swapper's current entry."""

    def __init__(self, swapper: WeightSwapper, index: int, name: str, module: nn.Module):
        self.swapper, self.index, self.name, self.module = swapper, index, name, Ref(module)
        self.release: Any = None  # the forward hook's handle, moved after any hook added since
        self.places: list[tuple[Ref[nn.Module], str, nn.Parameter]] = []  # each swapped weight's module and name

    def before_forward(self, module: nn.Module, args: Any) -> None:
        hooks = self.release.hooks_dict_ref() if self.release is not None else None
        if hooks is not None and self.release.id in hooks:
            hooks.move_to_end(self.release.id)  # torch reads the forward hooks after the pre-hooks have run
        schedule = self.swapper.schedule
        if schedule.in_recompute:
            return
        if torch.is_grad_enabled() and not module.training:
            raise StateError(
                f"block swap: layer {self.index} ran in eval mode with gradients enabled. Its weights go back to "
                "host memory after it runs, which a graph built outside checkpointing cannot survive. Evaluate "
                "under torch.no_grad() (generate already does), or train with cm.for_training()."
            )
        if replaced := sum(_replaced(owner, name, param) for owner, name, param in self.places):
            raise BlockSwapError(
                f"layer {self.index} ({self.name}): {replaced} of its swapped weights were parametrized or replaced "
                "since it was swapped (weight_norm, spectral_norm, a new Parameter), from placeholder zeros, not the "
                "weights. Make such a change before swapping or with remat disabled: cm.disable() brings the swapped "
                "weights home into their own Parameter objects"
            )
        schedule.start(self.index, forward=True)

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.swapper.schedule.in_recompute:
            self.swapper.schedule.after_forward(self.index)

    def state_dict_reads_host_copies(self, module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        """The module's own swapped weights (its children's hooks do theirs) read from their host copies, with
        `keep_vars=True` too: the `Parameter` objects hold placeholders at rest, and a save of them would be zeros."""
        layer = self.swapper.layers[self.index]
        layer.take_writes_at_rest()  # a cast since is saved cast; a write refused, not saved as the old values
        hosts = {id(p): host for p, host in zip(layer.params, layer.host, strict=True)}
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in hosts and prefix + name in state_dict:
                state_dict[prefix + name] = hosts[id(param)]

    def load_writes_host_copies(self, module: nn.Module, state_dict: dict, prefix: str, meta: dict, *args: Any) -> None:
        """torch copies the loaded values into `p.data` of the module's own weights (its children's hooks run before
        theirs): pointed at the host copies for the load. `assign=True` is refused at the first module the load
        reaches whose swapped weights (in it or below) are loaded, before any of them is."""
        layer = self.swapper.layers[self.index]
        layer.take_writes_at_rest()  # a cast since: the values load in the new dtype
        hosts = {id(p): host for p, host in zip(layer.params, layer.host, strict=True)}
        if meta.get("assign_to_params_buffers") and any(
            id(p) in hosts and prefix + n in state_dict for n, p in module.named_parameters(remove_duplicate=False)
        ):
            raise StateError(assign_refusal([layer.index]))
        own = module.named_parameters(recurse=False, remove_duplicate=False)
        loaded = [(p, hosts[id(p)]) for n, p in own if id(p) in hosts and prefix + n in state_dict]
        if not loaded:
            return  # nothing of this module's swapped weights is loaded (adapter weights, say)
        self.swapper.pool.release(layer)
        for param, host in loaded:
            param.data = host

    def load_done(self, module: nn.Module, incompatible_keys: Any) -> None:
        layer = self.swapper.layers.get(self.index)
        if layer is not None:
            layer.rest()

    def apply(self, fn: Any, recurse: bool = True) -> Any:  # what `.to()`, `.half()`, `.cuda()` call
        module = self.module()
        return self.swapper.apply_to_layer(self.index, module, type(module)._apply.__get__(module), fn, recurse)

    def deepcopy(self, memo: Any = None) -> Any:
        raise ConfigTypeError(refusal(self.index, self.name, "copy.deepcopy this model"))

    def pickle(self, protocol: Any = None) -> Any:
        raise ConfigTypeError(refusal(self.index, self.name, "pickle this model (torch.save of the module)"))

    def replicate(self) -> Any:
        raise StateError(
            refusal(self.index, self.name, "replicate this model for nn.DataParallel")
            + "; DistributedDataParallel (one process per GPU) works with block swap"
        )


class ModelGuards:
    """Refusals on the whole model, made before any module loads (`assign=True`) or merges."""

    def __init__(self, swapper: WeightSwapper):
        self._swapper = Ref(swapper)
        self._handles: list[Any] = []
        self._patches = InstancePatches()

    def install(self, model: nn.Module) -> None:
        if self._handles:
            return  # installed already
        self._handles.append(model.register_load_state_dict_pre_hook(self._refuse_assign))
        for module in model.modules():
            if hasattr(type(module), "_check_merge_allowed"):  # PEFT's tuner models (LoraModel, ...)
                self._patches.set(module, "_check_merge_allowed", self._refuse_merge)

    def remove(self) -> None:
        _unhook(self._handles, self._patches)

    def _refuse_assign(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any):
        swapper, assigning = self._swapper(), local_metadata.get("assign_to_params_buffers")
        if assigning and swapper is not None and any(prefix + n in state_dict for n in swapper.swapped_names):
            raise StateError(assign_refusal(list(swapper.layers)))

    def _refuse_merge(self, *args: Any, **kwargs: Any) -> None:
        swapper = self._swapper()
        layers = list(swapper.layers) if swapper is not None else []
        raise StateError(
            f"block swap keeps the frozen weights of layers {layers} in host memory, and merging "
            "adapters into them is not supported. Bring them home first: "
            "cm.enable(cm.checkpoint_config.replace(swap_layers=0)) (or cm.disable()), then merge. Nothing was merged."
        )
