"""Block swap: the frozen weights of chosen layers live in host memory between uses.

A swapped layer's frozen parameters keep their identity (optimizers, PEFT and `state_dict` see
the same `Parameter` objects); only what `p.data` points at changes:

- at rest, `p.data` is a one-element placeholder expanded to the parameter's shape (shape,
  dtype and numel stay true, memory is ~0); the true values sit in a host copy made once;
- before the layer runs (forward, or its recompute in backward), its weights are copied host to
  device into a slot from a fixed pool and `p.data` points at the slot;
- after the layer is done, the slot goes back to the pool. Frozen weights never change, so
  nothing is ever copied back.

Slots: `prefetch_depth + 1` per weight layout, so a layer can run while the next
`prefetch_depth` layers (in execution order: ascending in forward, descending in backward's
recomputes) are being fetched; resident swapped-weight bytes never exceed the pool.

When a layer is done in backward: its recompute starts when backward reaches it, and the next
swapped layer's recompute can only start once this layer's gradient has flowed through it, so a
layer is released when the next recompute starts, and whatever is still fetched when backward
ends is released by a callback queued on the autograd engine.

Trainable parameters (LoRA) and parameters shared with modules outside the layer stay resident.
Swapped layers are always checkpointed (`remat.plan`), so forward never keeps their weights.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .offload import CudaEvent, DoneEvent

logger = logging.getLogger("remat")


class WeightMover(Protocol):
    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` in host memory (pinned where that helps)."""

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying host `src` into device `dst`; return something with `.wait()`."""


class CpuWeightMover:
    """The model runs on the CPU: copies are synchronous, but the working copy is still a
    separate slot that is given back between uses, so resident bytes really fall."""

    def __init__(self) -> None:
        self.fetches: list[int] = []  # layer order of fetches, for tests and reports

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().clone()

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return DoneEvent()


class CudaWeightMover:
    """Host copies in pinned memory; fetches on a side stream, waited on by the compute stream
    only when the layer is about to use them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.detach())
        return host

    def fetch(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the slot's previous user is done with it
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return CudaEvent(event, self.device)


@dataclass
class LayerSwapStats:
    fetches: int = 0
    bytes_fetched: int = 0


@dataclass
class _SwappedLayer:
    index: int
    params: list[nn.Parameter]
    host: list[torch.Tensor]
    placeholders: list[torch.Tensor]
    layout: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    nbytes: int
    slot: list[torch.Tensor] | None = None
    ready: Any = None
    stats: LayerSwapStats = field(default_factory=LayerSwapStats)


class BlockSwapError(ValueError):
    """A layer cannot be swapped."""


def check_swappable(layers: list[tuple[int, str, nn.Module]], model: nn.Module | None = None) -> None:
    """Raise BlockSwapError if any of these layers cannot be swapped. Changes nothing."""
    owners = _parameter_owners(model) if model is not None and layers else None
    for index, name, layer in layers:
        _check_swappable(index, name, layer)
        if owners is not None and not _own_frozen_params(layer, name, owners):
            raise BlockSwapError(f"layer {index} ({name}) has no frozen weights of its own to swap")


def _own_frozen_params(layer: nn.Module, name: str, owners: dict[int, set[str]]) -> list[nn.Parameter]:
    """The frozen parameters held by this layer alone (tied or shared weights stay resident)."""
    inside = {name} | {f"{name}.{n}" for n, _ in layer.named_modules() if n}
    return [p for p in _unique_params(layer) if not p.requires_grad and owners[id(p)] <= inside]


def _check_swappable(index: int, name: str, layer: nn.Module) -> None:
    for module in layer.modules():
        kind = type(module).__name__
        if "FullyShardedDataParallel" in kind or kind.startswith("FSDP"):
            raise BlockSwapError(
                f"layer {index} ({name}) is wrapped by FSDP ({kind}); block swap cannot move sharded weights"
            )
    for pname, param in layer.named_parameters():
        if hasattr(param, "ds_id") or type(param).__name__ == "DTensor":
            raise BlockSwapError(
                f"layer {index} ({name}) has a parameter managed by DeepSpeed or FSDP ({pname}); "
                "block swap cannot move it"
            )
        if param.requires_grad and param.dim() >= 2 and "lora_" not in pname:
            raise BlockSwapError(
                f"layer {index} ({name}): its base weight {pname} is trainable (full fine-tuning). Block swap keeps "
                "frozen weights in host memory; freeze the base weights (e.g. train LoRA adapters) or do not swap "
                "this layer"
            )


class WeightSwapper:
    """Keeps the frozen weights of the swapped layers in host memory and fetches them just in time."""

    def __init__(
        self,
        model: nn.Module,
        layers: list[tuple[int, str, nn.Module]],
        mover: WeightMover | None = None,
        prefetch_depth: int = 2,
    ):
        check_swappable(layers, model)
        self.prefetch_depth = prefetch_depth
        owners = _parameter_owners(model)
        self._mover = mover
        self.layers: OrderedDict[int, _SwappedLayer] = OrderedDict()
        self._free: dict[tuple, list[list[torch.Tensor]]] = {}
        self._slot_count: dict[tuple, int] = {}
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self._callback_queued = False
        self.in_recompute = False
        self._handles: list[Any] = []
        for index, name, layer in sorted(layers, key=lambda item: item[0]):
            params = _own_frozen_params(layer, name, owners)
            mover_for = self._mover_for(params[0])
            host = [mover_for.host_copy(p.data) for p in params]
            placeholders = [torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape) for p in params]
            layout = tuple((tuple(p.shape), p.dtype) for p in params)
            nbytes = sum(p.numel() * p.element_size() for p in params)
            self.layers[index] = _SwappedLayer(index, params, host, placeholders, layout, nbytes)
        for entry in self.layers.values():
            for param, placeholder in zip(entry.params, entry.placeholders, strict=True):
                param.data = placeholder

    def _mover_for(self, param: torch.Tensor) -> WeightMover:
        if self._mover is None:
            self._mover = CudaWeightMover(param.device) if param.device.type == "cuda" else CpuWeightMover()
        return self._mover

    @property
    def pool_bytes(self) -> int:
        """The most swapped-weight bytes that can be resident at once."""
        per_layout: dict[tuple, int] = {}
        for entry in self.layers.values():
            per_layout[entry.layout] = entry.nbytes
        return sum(nbytes * (self.prefetch_depth + 1) for nbytes in per_layout.values())

    # -- slots ----------------------------------------------------------------------------------

    def _acquire(self, entry: _SwappedLayer) -> list[torch.Tensor] | None:
        free = self._free.setdefault(entry.layout, [])
        if free:
            return free.pop()
        if self._slot_count.get(entry.layout, 0) <= self.prefetch_depth:
            self._slot_count[entry.layout] = self._slot_count.get(entry.layout, 0) + 1
            return [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in entry.placeholders]
        return None

    def _fetch(self, entry: _SwappedLayer) -> bool:
        if entry.slot is not None:
            return True
        slot = self._acquire(entry)
        if slot is None:
            return False  # every slot is busy: a prefetch waits for a later chance
        events = [self._mover.fetch(dst, src) for dst, src in zip(slot, entry.host, strict=True)]
        entry.slot, entry.ready = slot, events
        entry.stats.fetches += 1
        entry.stats.bytes_fetched += entry.nbytes
        self.resident_bytes += entry.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        if isinstance(self._mover, CpuWeightMover):
            self._mover.fetches.append(entry.index)
        return True

    def _release(self, entry: _SwappedLayer) -> None:
        if entry.slot is None:
            return
        for param, placeholder in zip(entry.params, entry.placeholders, strict=True):
            param.data = placeholder
        self._free[entry.layout].append(entry.slot)
        entry.slot, entry.ready = None, None
        self.resident_bytes -= entry.nbytes

    def _use(self, index: int) -> None:
        entry = self.layers[index]
        if not self._fetch(entry):
            raise RuntimeError(f"block swap: no free slot for layer {index}; this is a bug in remat's release order")
        for event in entry.ready:
            event.wait()
        for param, slot in zip(entry.params, entry.slot, strict=True):
            param.data = slot

    def _prefetch(self, upcoming: list[int]) -> None:
        for index in upcoming[: self.prefetch_depth]:
            if not self._fetch(self.layers[index]):
                break

    # -- the schedule ---------------------------------------------------------------------------

    def before_forward(self, index: int) -> None:
        self._callback_queued = False  # a backward that aborted never ran its end callback
        for earlier in [i for i in self.layers if i < index]:
            self._release(self.layers[earlier])  # done in this forward, or left by an aborted step
        self._use(index)
        self._prefetch([i for i in self.layers if i > index])

    def after_forward(self, index: int) -> None:
        self._release(self.layers[index])

    @contextlib.contextmanager
    def recomputing(self, index: int) -> Iterator[None]:
        """Backward recomputes layer `index`: fetch its weights; the layer's own hooks stand aside.
        A layer swapped no more (disable() or a new map between forward and backward) has its
        weights home already and needs nothing."""
        if index not in self.layers:
            yield
            return
        self.before_recompute(index)
        self.in_recompute = True
        try:
            yield
        finally:
            self.in_recompute = False

    # -- hooks on the swapped layers (forward in training and in inference) -----------------------

    def install_hooks(self, modules: dict[int, nn.Module]) -> None:
        for index, module in modules.items():
            if index not in self.layers:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(module.register_forward_hook(self._post_hook(index), always_call=True))
            self._handles.append(module.register_state_dict_post_hook(self._state_dict_hook(index)))

    def _pre_hook(self, index: int):
        def hook(module: nn.Module, args: Any) -> None:
            if self.in_recompute:
                return
            if torch.is_grad_enabled() and not module.training:
                # Not checkpointed (eval mode), so autograd would keep views of the slot, which
                # the next layer's fetch overwrites: wrong gradients, silently. Refuse instead.
                raise RuntimeError(
                    f"block swap: layer {index} ran in eval mode with gradients enabled. Its weights go back to "
                    "host memory after it runs, which a graph built outside checkpointing cannot survive. Evaluate "
                    "under torch.no_grad() (generate already does), or train with cm.for_training()."
                )
            self.before_forward(index)

        return hook

    def _post_hook(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.in_recompute:
                self.after_forward(index)

        return hook

    def _state_dict_hook(self, index: int):
        entry_params = {id(p): host for p, host in zip(self.layers[index].params, self.layers[index].host, strict=True)}

        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            # state_dict() must read the true values, not the placeholder at rest.
            for name, param in module.named_parameters(remove_duplicate=False):
                host = entry_params.get(id(param))
                if host is not None and prefix + name in state_dict:
                    state_dict[prefix + name] = host

        return hook

    def before_recompute(self, index: int) -> None:
        for later in [i for i in self.layers if i > index]:
            self._release(self.layers[later])  # backward is done with every later layer
        self._use(index)
        self._prefetch([i for i in reversed(self.layers) if i < index])
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.release_all()

    def release_all(self) -> None:
        for entry in self.layers.values():
            self._release(entry)

    # -- reading and undoing --------------------------------------------------------------------

    def restore(self) -> None:
        """Bring every weight home: a fresh device copy of the true values, no slots, no host copies."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for entry in self.layers.values():  # copies still writing into slots must finish first
            for event in entry.ready or ():
                event.synchronize()
        self.release_all()
        for entry in self.layers.values():
            for param, host, placeholder in zip(entry.params, entry.host, entry.placeholders, strict=True):
                param.data = host.to(placeholder.device, copy=True)
        self.layers.clear()
        self._free.clear()


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    seen, out = set(), []
    for param in module.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


def _parameter_owners(model: nn.Module) -> dict[int, set[str]]:
    """For each parameter, the names of every module that holds it directly (tied weights have several)."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return owners
