"""Which layers block swap may take, and which of their weights: checks that change nothing. Sharded weights (a
`DTensor`, an FSDP unit on, in or around the layer, a `FlatParameter`, ZeRO-3's `ds_id`), weights on `meta` (what
accelerate offloads), tensor subclasses (torchao's quantized weights: `param.data =` leaves them in place) and
trainable base weights are refused; adapter and tied weights stay: only frozen weights a layer holds alone are
swapped."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import BlockSwapError

# swap_layers=n chooses its layers itself: name the way to leave one out.
LEAVE_OUT = (
    "leave this layer out of swap_layers (a list of the indices to swap, where you gave a count; with "
    "swap_placement='spread')"
)


def check_swappable(layers: list[tuple[int, str, nn.Module]], model: nn.Module) -> None:
    """Raise BlockSwapError if any of these layers cannot be swapped."""
    if not layers:
        return
    owners = parameter_owners(model)
    units = _fsdp_units(model)
    for index, name, layer in layers:
        _check_layer(index, name, layer, units)
        if not own_frozen_params(layer, name, owners):
            inside = {name} | {f"{name}.{n}" for n, _ in layer.named_modules() if n}
            shared = sorted({o for p in layer.parameters() if not p.requires_grad for o in owners[id(p)] - inside})
            why = (
                f" (its frozen weights are also held by {shared[0]}: shared weights stay on the device)"
                if shared
                else ""
            )
            raise BlockSwapError(f"layer {index} ({name}) has no frozen weights of its own to swap{why}; {LEAVE_OUT}")


def weights_in_use(layers: list[tuple[int, str, nn.Module]], model: nn.Module) -> list[str]:
    """The frozen weights of these layers that something else holds (above all the graph of a backward still to run,
    saved by a layer that ran without checkpointing): swapping them out would change what that backward computes."""
    owners = parameter_owners(model)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return [
        names.get(id(p), f"layer {index}")
        for index, name, layer in layers
        for p in own_frozen_params(layer, name, owners)
        if p._use_count() > 1
    ]


def own_frozen_params(layer: nn.Module, name: str, owners: dict[int, set[str]]) -> list[nn.Parameter]:
    inside = {name} | {f"{name}.{n}" for n, _ in layer.named_modules() if n}
    adapters = _adapter_params(layer)
    return [p for p in layer.parameters() if not p.requires_grad and owners[id(p)] <= inside and id(p) not in adapters]


def _adapter_params(layer: nn.Module) -> set[int]:
    """A PEFT adapter's weights, trainable or not: one frozen by `set_adapter` trains again when set back, and
    `add_weighted_adapter` reads it outside any forward (swapped, it read placeholders: zeros). Tuner layers and
    PEFT's auxiliary wrappers (`modules_to_save` copies, trainable tokens) name them in `adapter_layer_names`."""
    found: set[int] = set()
    for tuner in (m for m in layer.modules() if isinstance(getattr(m, "adapter_layer_names", None), tuple)):
        for attribute in tuner.adapter_layer_names:
            if isinstance(held := getattr(tuner, attribute, None), nn.Module):
                found.update(id(p) for p in held.parameters())
    return found


def parameter_owners(model: nn.Module) -> dict[int, set[str]]:
    """For each parameter, the names of every module that holds it directly (tied weights have several)."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return owners


def _check_layer(index: int, name: str, layer: nn.Module, fsdp_units: list[tuple[str, str]]) -> None:
    related = [(unit, kind) for unit, kind in fsdp_units if _contains(unit, name) or _contains(name, unit)]
    if related:
        unit, kind = max(related, key=lambda u: len(u[0]))  # the innermost unit names it best
        where = f"module {unit!r}" if unit else "the whole model"
        raise BlockSwapError(
            f"layer {index} ({name}) is sharded by FSDP ({kind} on {where}); block swap cannot move sharded "
            "weights. Under FSDP swap no layers (FSDP already keeps only a shard of each weight per rank)"
        )
    adapters = _adapter_params(layer)
    for pname, param in layer.named_parameters():
        if param.is_meta:
            raise BlockSwapError(
                f"layer {index} ({name}): its weight {pname} is on the meta device, with no data to swap (accelerate "
                'offloads it: its hook loads the weight at each forward, from a device_map\'s "cpu" or "disk" or '
                "cpu_offload; or the model was built under init_empty_weights); accelerate already keeps its weights "
                f"off the device: {LEAVE_OUT}"
            )
        if (sharding := _sharding_of(param)) is not None:
            raise BlockSwapError(
                f"layer {index} ({name}) has a parameter managed by {sharding} ({pname}); block swap cannot move it"
            )
        if type(param.data) is not torch.Tensor and not param.requires_grad:
            raise BlockSwapError(
                f"layer {index} ({name}): its weight {pname} is a {type(param.data).__name__} (a tensor subclass: a "
                "quantized weight of torchao or optimum-quanto), whose data block swap cannot move (its tensors are "
                f"inside it); {LEAVE_OUT}"
            )
        if param.requires_grad and param.dim() >= 2 and id(param) not in adapters:
            raise BlockSwapError(
                f"layer {index} ({name}): its weight {pname} trains and is no PEFT adapter's (full fine-tuning, or an "
                "adapter added by hand). Block swap keeps frozen weights in host memory and leaves PEFT's adapters on "
                f"the device; freeze the base weights and train PEFT adapters (get_peft_model), or {LEAVE_OUT}"
            )


def _contains(outer: str, inner: str) -> bool:
    return outer in ("", inner) or inner.startswith(outer + ".")


def _sharding_of(param: torch.Tensor) -> str | None:
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FlatParameter
        from torch.distributed.tensor import DTensor

        if isinstance(param, DTensor):
            return "torch.distributed (a DTensor: FSDP2 or tensor parallel)"
        if isinstance(param, FlatParameter):
            return "FSDP (a FlatParameter)"
    return "DeepSpeed ZeRO-3 (a partitioned parameter)" if hasattr(param, "ds_id") else None


def _fsdp_units(model: nn.Module) -> list[tuple[str, str]]:
    """(name, class name) of the FSDP-wrapped modules (FSDP2 makes their class an `FSDPModule`)."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    kinds = (FullyShardedDataParallel, FSDPModule)
    return [(n, type(m).__name__) for n, m in model.named_modules() if isinstance(m, kinds)]
