"""Guards on a swapped layer's instance (and on the model while anything is swapped), undone
when the layer leaves the set: forward hooks fetch and give back its weights; `state_dict()`
reads and `load_state_dict()` writes the host copies; `.to()` and friends convert them too;
copies, pickling, DataParallel replication, `assign=True` loads and PEFT merges are refused
(each would read or replace the placeholders as if they were the weights).

The forward hooks run eagerly under `torch.compile` (`torch.compiler.disable`): traced,
pointing `p.data` at a slot is a `set_` on a graph input, which inductor cannot compile.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigTypeError, StateError
from ..refs import InstancePatches, Ref
from .slots import SwappedLayer

SwapperView = Any  # `swapper.WeightSwapper`, which installs the guards


def guard_layer(swapper: SwapperView, layer: SwappedLayer, module: nn.Module) -> None:
    index = layer.index
    before, after = _forward_hooks(swapper.schedule, index)
    layer.handles += [
        module.register_forward_pre_hook(torch.compiler.disable(before)),
        module.register_forward_hook(torch.compiler.disable(after), always_call=True),
        module.register_state_dict_post_hook(_state_dict_reads_host_copies(swapper, index)),
        module.register_load_state_dict_pre_hook(_load_writes_host_copies(swapper, index)),
        module.register_load_state_dict_post_hook(_load_done(swapper, index)),
    ]
    layer.patches.set(module, "_apply", _ConvertingApply(swapper, index, module))
    refusal = _Refusal(index, layer.name)
    layer.patches.set(module, "__deepcopy__", refusal.deepcopy)
    layer.patches.set(module, "__reduce_ex__", refusal.pickle)
    layer.patches.set(module, "_replicate_for_data_parallel", refusal.replicate)


def unguard_layer(layer: SwappedLayer) -> None:
    for handle in layer.handles:
        handle.remove()
    layer.handles.clear()
    layer.patches.undo()


def _forward_hooks(schedule: Any, index: int) -> tuple[Any, Any]:
    def before(module: nn.Module, args: Any) -> None:
        if schedule.in_recompute:
            return
        if torch.is_grad_enabled() and not module.training:
            raise StateError(
                f"block swap: layer {index} ran in eval mode with gradients enabled. Its weights go back to "
                "host memory after it runs, which a graph built outside checkpointing cannot survive. Evaluate "
                "under torch.no_grad() (generate already does), or train with cm.for_training()."
            )
        schedule.before_forward(index)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if not schedule.in_recompute:
            schedule.after_forward(index)

    return before, after


def _state_dict_reads_host_copies(swapper: SwapperView, index: int):
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        layer = swapper.layers[index]
        hosts = {id(p): host for p, host in zip(layer.params, layer.host, strict=True)}
        for name, param in module.named_parameters(remove_duplicate=False):
            host = hosts.get(id(param))
            if host is not None and prefix + name in state_dict:
                state_dict[prefix + name] = host

    return hook


def _load_writes_host_copies(swapper: SwapperView, index: int):
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any) -> None:
        layer = swapper.layers[index]
        mine = {id(p) for p in layer.params}
        names = [prefix + n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in mine]
        if not any(name in state_dict for name in names):
            return  # nothing of this layer's swapped weights is loaded (adapter weights, say)
        if local_metadata.get("assign_to_params_buffers"):
            raise StateError(assign_refusal([layer.index]))
        # torch copies the loaded values into `p.data`: point it at the host copy for the load.
        swapper.pool.release(layer)
        layer.point_at(layer.host)

    return hook


def _load_done(swapper: SwapperView, index: int):
    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        layer = swapper.layers.get(index)
        if layer is not None:
            layer.rest()

    return hook


class _ConvertingApply:
    def __init__(self, swapper: SwapperView, index: int, module: nn.Module):
        self.swapper, self.index, self.module = swapper, index, Ref(module)

    def __call__(self, fn: Any, recurse: bool = True) -> Any:  # what `.to()`, `.half()`, `.cuda()` call
        module = self.module()
        return self.swapper.apply_to_layer(self.index, type(module)._apply.__get__(module), fn, recurse)


class _Refusal:
    def __init__(self, index: int, name: str):
        self.index, self.name = index, name

    def message(self, what: str) -> str:
        return (
            f"cannot {what}: block swap keeps the frozen weights of layer {self.index} ({self.name}) in host "
            "memory, and its parameters hold placeholders. Bring the weights home first with "
            "cm.enable(cm.checkpoint_config.replace(swap_layers=0)) or cm.disable(); nothing was copied"
        )

    def deepcopy(self, memo: Any = None) -> Any:
        raise ConfigTypeError(self.message("copy.deepcopy this model"))

    def pickle(self, protocol: Any = None) -> Any:
        raise ConfigTypeError(self.message("pickle this model (torch.save of the module)"))

    def replicate(self) -> Any:
        raise StateError(
            self.message("replicate this model for nn.DataParallel")
            + "; DistributedDataParallel (one process per GPU) works with block swap"
        )


def copy_refusal(index: int, name: str) -> str:
    return _Refusal(index, name).message("copy")


def assign_refusal(indices: list[int]) -> str:
    return (
        f"load_state_dict(assign=True) would replace the parameters of layers {indices}, whose frozen weights "
        "block swap keeps in host memory; load with assign=False (the default), which writes into the host "
        "copies, or bring the weights home first with cm.disable()"
    )


class ModelGuards:
    """Refusals on the whole model, made before any module loads (`assign=True`) or merges."""

    def __init__(self, swapper: SwapperView):
        self._swapper = Ref(swapper)
        self._handles: list[Any] = []
        self._patches = InstancePatches()

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self, model: nn.Module) -> None:
        self._handles.append(model.register_load_state_dict_pre_hook(self._refuse_assign))
        for module in model.modules():
            if hasattr(type(module), "_check_merge_allowed"):  # PEFT's tuner models (LoraModel, ...)
                self._patches.set(module, "_check_merge_allowed", self._refuse_merge)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._patches.undo()

    def _refuse_assign(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any):
        swapper = self._swapper()
        if swapper is None:
            return
        swapped_loaded = any(prefix + n in state_dict for n in swapper.swapped_names)
        if local_metadata.get("assign_to_params_buffers") and swapped_loaded:
            raise StateError(assign_refusal(list(swapper.layers)))

    def _refuse_merge(self, *args: Any, **kwargs: Any) -> None:
        swapper = self._swapper()
        layers = list(swapper.layers) if swapper is not None else []
        raise StateError(
            f"block swap keeps the frozen weights of layers {layers} in host memory, and merging "
            "adapters into them is not supported. Bring them home first: "
            "cm.enable(cm.checkpoint_config.replace(swap_layers=0)) (or cm.disable()), then merge. Nothing was merged."
        )
