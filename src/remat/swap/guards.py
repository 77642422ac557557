"""Guards: everything else that touches a swapped layer's weights, handled on that layer's
instance (and on the model while anything is swapped), undone when the layer leaves the set.

- Forward: the layer's pre-hook fetches its weights (the schedule), its post-hook gives them
  back. A layer running in eval mode with gradients enabled is refused before anything runs
  (not checkpointed, so autograd would keep views of a slot the next fetch overwrites).
- `torch.compile` never traces these two hooks (`torch.compiler.disable`): traced, pointing
  `p.data` at a slot is a `set_` on a graph input, which inductor cannot compile. Run eagerly,
  they split the graph around them: the compiled code before the layer, the hook, then the
  compiled layer reading its parameters as they now are. Before transformers 5.23 the hooks
  run inside the checkpoint call, which dynamo runs eagerly anyway.
- `state_dict()` reads the host copies (the true values); `load_state_dict()` writes into them
  (`assign=True` is refused: it would replace the parameters the swap keeps).
- `.to()`, `.half()`, `.cuda()` and friends convert the host copies and placeholders too, so
  weights never end up in two dtypes.
- `copy.deepcopy`, pickling and `nn.DataParallel` replication are refused: each would read the
  placeholders as if they were the weights.
- PEFT's merge (`merge_and_unload`, `merge_adapter`) is refused before any layer merges.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ..patches import InstancePatches
from ..refs import Ref
from .schedule import Schedule
from .slots import SlotPool, SwappedLayer


class SwapperView(Protocol):
    """What the guards use of the swapper (`swapper.WeightSwapper`), which installs them."""

    layers: dict[int, SwappedLayer]
    pool: SlotPool
    schedule: Schedule
    swapped_names: list[str]

    def apply_to_layer(self, index: int, original_apply: Any, fn: Any, recurse: bool) -> Any: ...


def guard_layer(swapper: SwapperView, layer: SwappedLayer, module: nn.Module) -> None:
    """Hooks and instance patches on one swapped layer (kept on `layer`, removed by `unguard_layer`)."""
    index = layer.index
    layer.handles += [
        module.register_forward_pre_hook(torch.compiler.disable(_before_forward(swapper, index))),
        module.register_forward_hook(torch.compiler.disable(_after_forward(swapper, index)), always_call=True),
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


def _before_forward(swapper: SwapperView, index: int):
    schedule = swapper.schedule

    def hook(module: nn.Module, args: Any) -> None:
        if schedule.in_recompute:
            return
        if torch.is_grad_enabled() and not module.training:
            raise RuntimeError(
                f"block swap: layer {index} ran in eval mode with gradients enabled. Its weights go back to "
                "host memory after it runs, which a graph built outside checkpointing cannot survive. Evaluate "
                "under torch.no_grad() (generate already does), or train with cm.for_training()."
            )
        schedule.before_forward(index)

    return hook


def _after_forward(swapper: SwapperView, index: int):
    schedule = swapper.schedule

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not schedule.in_recompute:
            schedule.after_forward(index)

    return hook


def _state_dict_reads_host_copies(swapper: SwapperView, index: int):
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        # state_dict() must read the true values, not the placeholder at rest.
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
            raise RuntimeError(assign_refusal([layer.index]))
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
    """`module._apply` of a swapped layer (what `.to()`, `.half()`, `.cuda()` call)."""

    def __init__(self, swapper: SwapperView, index: int, module: nn.Module):
        self.swapper, self.index, self.module = swapper, index, Ref(module)

    def __call__(self, fn: Any, recurse: bool = True) -> Any:
        module = self.module()
        return self.swapper.apply_to_layer(self.index, type(module)._apply.__get__(module), fn, recurse)


class _Refusal:
    """What a swapped layer answers to copying, pickling and DataParallel replication."""

    def __init__(self, index: int, name: str):
        self.index, self.name = index, name

    def message(self, what: str) -> str:
        return (
            f"cannot {what}: block swap keeps the frozen weights of layer {self.index} ({self.name}) in host "
            "memory, and its parameters hold placeholders. Bring the weights home first with "
            "cm.enable(cm.checkpoint_config.replace(swap_layers=0)) or cm.disable(); nothing was copied"
        )

    def deepcopy(self, memo: Any = None) -> Any:
        raise TypeError(self.message("copy.deepcopy this model"))

    def pickle(self, protocol: Any = None) -> Any:
        raise TypeError(self.message("pickle this model (torch.save of the module)"))

    def replicate(self) -> Any:
        raise RuntimeError(
            self.message("replicate this model for nn.DataParallel")
            + "; DistributedDataParallel (one process per GPU) works with block swap"
        )


def copy_refusal(index: int, name: str) -> str:
    """Why a swapper that swaps (or a wrapper around it) cannot be copied."""
    return _Refusal(index, name).message("copy")


def assign_refusal(indices: list[int]) -> str:
    return (
        f"load_state_dict(assign=True) would replace the parameters of layers {indices}, whose frozen weights "
        "block swap keeps in host memory; load with assign=False (the default), which writes into the host "
        "copies, or bring the weights home first with cm.disable()"
    )


class ModelGuards:
    """Guards on the whole model while anything is swapped: `load_state_dict(assign=True)` is
    refused before any module loads (the layers' own hooks would refuse halfway through), and
    PEFT's merge is refused before any layer merges."""

    def __init__(self, swapper: SwapperView):
        # Weakly: the swapper owns these guards, and a cycle between the two would keep a dropped
        # wrapper's swapped weights in host memory until a GC pass.
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
            raise RuntimeError(assign_refusal(list(swapper.layers)))

    def _refuse_merge(self, *args: Any, **kwargs: Any) -> None:
        swapper = self._swapper()
        layers = list(swapper.layers) if swapper is not None else []
        raise RuntimeError(
            f"block swap keeps the frozen weights of layers {layers} in host memory, and merging "
            "adapters into them is not supported. Bring them home first: "
            "cm.enable(cm.checkpoint_config.replace(swap_layers=0)) (or cm.disable()), then merge. Nothing was merged."
        )
