"""Which layers block swap may take, and which of their weights: checks that change nothing.

A layer can be swapped when its base weights are frozen and plain tensors of this process:
- sharded weights are refused, recognised by type: a `DTensor` parameter (FSDP2's
  `fully_shard`, tensor parallel), a layer inside an FSDP unit (`FullyShardedDataParallel` or
  `FSDPModule` on the layer, inside it or around it; FSDP1's `FlatParameter`), and DeepSpeed
  ZeRO-3's partitioned parameters, which carry `ds_id` (DeepSpeed's own test,
  `deepspeed.runtime.zero.partition_parameters.is_zero_param`, is `hasattr(param, "ds_id")`);
- a trainable base weight (full fine-tuning) is refused; trainable adapter weights are fine and
  stay resident. An adapter weight is one held by an adapter submodule of a PEFT tuner layer
  (`BaseTunerLayer.adapter_layer_names`: LoRA's `lora_A`/`lora_B`, IA3's `ia3_l`, ...), so
  every PEFT method is recognised, and nothing else is by its name.

Only the frozen weights a layer holds alone are swapped: tied or shared weights stay resident.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import BlockSwapError


def check_swappable(layers: list[tuple[int, str, nn.Module]], model: nn.Module | None = None) -> None:
    """Raise BlockSwapError if any of these layers cannot be swapped. Changes nothing."""
    if not layers:
        return
    owners = parameter_owners(model) if model is not None else None
    units = _fsdp_units(model.named_modules()) if model is not None else None
    for index, name, layer in layers:
        if units is None:
            inside = [(f"{name}.{n}" if n else name, m) for n, m in layer.named_modules()]
            _check_layer(index, name, layer, _fsdp_units(inside))
        else:
            _check_layer(index, name, layer, units)
        if owners is not None and not own_frozen_params(layer, name, owners):
            raise BlockSwapError(
                f"layer {index} ({name}) has no frozen weights of its own to swap; leave it out of swap_layers"
            )


def weights_in_use(layers: list[tuple[int, str, nn.Module]], model: nn.Module) -> list[str]:
    """The frozen weights of these layers that something besides their parameter holds: above
    all an autograd graph whose backward has not run, which saved them when a layer ran without
    checkpointing (torch counts those holders on the tensor itself). Swapping such a weight out
    would change what that backward computes. A checkpointed layer saves no weights (its
    recompute fetches them again), so it never shows here."""
    owners = parameter_owners(model)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return [
        names.get(id(p), f"layer {index}")
        for index, name, layer in layers
        for p in own_frozen_params(layer, name, owners)
        if p._use_count() > 1
    ]


def own_frozen_params(layer: nn.Module, name: str, owners: dict[int, set[str]]) -> list[nn.Parameter]:
    """The frozen parameters held by this layer alone (tied or shared weights stay resident)."""
    inside = {name} | {f"{name}.{n}" for n, _ in layer.named_modules() if n}
    return [p for p in unique_params(layer) if not p.requires_grad and owners[id(p)] <= inside]


def unique_params(module: nn.Module) -> list[nn.Parameter]:
    seen, out = set(), []
    for param in module.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


def parameter_owners(model: nn.Module) -> dict[int, set[str]]:
    """For each parameter, the names of every module that holds it directly (tied weights have several)."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return owners


def _check_layer(index: int, name: str, layer: nn.Module, fsdp_units: list[tuple[str, str]]) -> None:
    """`fsdp_units`: (name, class name) of the FSDP-wrapped modules; one on the layer, inside it
    or around it shards the layer's weights."""
    related = [(unit, kind) for unit, kind in fsdp_units if _contains(unit, name) or _contains(name, unit)]
    if related:
        unit, kind = max(related, key=lambda u: len(u[0]))  # the innermost unit names it best
        where = f"module {unit!r}" if unit else "the whole model"
        raise BlockSwapError(
            f"layer {index} ({name}) is sharded by FSDP ({kind} on {where}); block swap cannot move sharded "
            "weights. Under FSDP swap no layers (FSDP already keeps only a shard of each weight per rank)"
        )
    adapters = adapter_param_ids(layer)
    for pname, param in layer.named_parameters():
        sharding = _sharding_of(param)
        if sharding is not None:
            raise BlockSwapError(
                f"layer {index} ({name}) has a parameter managed by {sharding} ({pname}); block swap cannot move it"
            )
        if param.requires_grad and param.dim() >= 2 and id(param) not in adapters:
            raise BlockSwapError(
                f"layer {index} ({name}): its base weight {pname} is trainable (full fine-tuning). Block swap keeps "
                "frozen weights in host memory; freeze the base weights (e.g. train LoRA adapters) or do not swap "
                "this layer"
            )


def _contains(outer: str, inner: str) -> bool:
    """Whether the module named `inner` is `outer` or inside it (names as in `named_modules`)."""
    return outer in ("", inner) or inner.startswith(outer + ".")


def adapter_param_ids(module: nn.Module) -> set[int]:
    """The parameters inside `module` that belong to PEFT adapters: those held by the adapter
    submodules (`adapter_layer_names`) of every PEFT tuner layer in it."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no PEFT, no adapters
        return set()
    ids: set[int] = set()
    for tuner in module.modules():
        if isinstance(tuner, BaseTunerLayer):
            for attribute in tuner.adapter_layer_names:
                adapter = getattr(tuner, attribute, None)
                if isinstance(adapter, nn.Module):
                    ids.update(id(p) for p in adapter.parameters())
    return ids


def _sharding_of(param: torch.Tensor) -> str | None:
    """Who shards this parameter, recognised by type or by the library's own marker; None if nobody."""
    dtensor, flat_parameter = _sharded_tensor_types()
    if dtensor is not None and isinstance(param, dtensor):
        return "torch.distributed (a DTensor: FSDP2 or tensor parallel)"
    if flat_parameter is not None and isinstance(param, flat_parameter):
        return "FSDP (a FlatParameter)"
    if hasattr(param, "ds_id"):
        return "DeepSpeed ZeRO-3 (a partitioned parameter)"
    return None


def _sharded_tensor_types() -> tuple[Any, Any]:
    if not torch.distributed.is_available():
        return None, None
    from torch.distributed.fsdp import FlatParameter
    from torch.distributed.tensor import DTensor

    return DTensor, FlatParameter


def _fsdp_module_types() -> tuple[type, ...]:
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FullyShardedDataParallel, FSDPModule)


def _fsdp_units(modules: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, str]]:
    """(name, class name) of the modules that FSDP wraps (FSDP1's `FullyShardedDataParallel`,
    FSDP2's `FSDPModule`, which `fully_shard` makes the module's class a subclass of)."""
    fsdp_types = _fsdp_module_types()
    if not fsdp_types:
        return []
    return [(n, type(m).__name__) for n, m in modules if isinstance(m, fsdp_types)]
