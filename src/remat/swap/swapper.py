"""`WeightSwapper`: which layers are swapped, moving them out and home; one per wrapper for its whole life (shims of a
step in flight find their layers). A joining layer takes its host copy first (what can fail), so a refusal changes
nothing."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigTypeError
from ..transport import WeightMover, transport_for
from .checks import check_swappable, own_frozen_params, parameter_owners
from .guards import ModelGuards, guard_layer, refusal, unguard_layer
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
            self._bring_home(self.layers.pop(index))
        for layer, module in entries:
            layer.rest()
            guard_layer(self, layer, module)
            self.layers[layer.index] = layer
        ordered = sorted(self.layers.items())
        self.layers.clear()
        self.layers.update(ordered)  # the same dict: the schedule holds it
        swapped = {id(p) for layer in self.layers.values() for p in layer.params}
        self.swapped_names = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in swapped]
        self._keep_used_slots()
        if self.layers and not self._model_guards.installed:
            self._model_guards.install(model)
        elif not self.layers:
            self._model_guards.remove()
        return [i for i, _, _ in joining], leaving

    def restore(self) -> None:
        """Bring every weight home (`update()` swaps again)."""
        for index in list(self.layers):
            self._bring_home(self.layers.pop(index))
        self._keep_used_slots()
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

    def _bring_home(self, layer: SwappedLayer) -> None:
        """The true values back in place, on the device, as plain tensors; hooks and patches off."""
        for event in layer.ready or ():  # copies still writing into the slot must finish first
            event.synchronize()
        self.pool.release(layer)
        unguard_layer(layer)
        for param, host, rest in zip(layer.params, layer.host, layer.placeholders, strict=True):
            # The host copy is the swapper's own: on a CPU model it becomes the weight itself.
            same_place = host.device == rest.device and not host.is_pinned()
            param.data = host if same_place else host.to(rest.device, copy=True)

    def _keep_used_slots(self) -> None:
        self.pool.keep_only({layer.layout for layer in self.layers.values()})

    def apply_to_layer(self, index: int, original_apply: Any, fn: Any, recurse: bool) -> Any:
        """`module.to(...)` and friends on a swapped layer: the host copies and placeholders follow."""
        layer = self.layers[index]
        self.pool.release(layer)
        # What `fn` does to each weight is read off an empty tensor of its dtype and device:
        # applying it to the placeholder would allocate the full tensor on the device.
        probes = [fn(torch.empty(0, dtype=ph.dtype, device=ph.device)) for ph in layer.placeholders]
        for param in layer.params:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)  # hidden from torch's loop
        try:
            result = original_apply(fn, recurse)
        except BaseException:
            layer.rest()
            raise
        hosts, placeholders = [], []
        for host, old, probe in zip(layer.host, layer.placeholders, probes, strict=True):
            converted = host.to(dtype=probe.dtype)
            if probe.device.type != old.device.type or (host.is_pinned() and not converted.is_pinned()):
                # e.g. .cuda(), or a dtype change of a pinned copy: the new copy is made (pinned) by the mover
                converted = self._mover_for(probe.device).host_copy(converted)
            hosts.append(converted)
            placeholders.append(placeholder(old.shape, probe.dtype, probe.device))
        layer.host, layer.placeholders, layer.mover = hosts, placeholders, self._mover_for(probes[0].device)
        layer.rest()
        self._keep_used_slots()
        return result
