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

Faults: an exception in a forward or inside a recompute abandons a step halfway, with slots
still held. Nothing relies on a step finishing: the first swapped layer of the next forward (or
the first recompute of the next backward) gives back every slot the last one left, and a fetch
that finds the pool full takes the slot of a layer that is not running. So a failed step is
followed by a normal one.

Changes to the swapped set (`update`) move only the layers that join or leave. A layer joining
takes its host copy first (the step that can fail), so a refusal changes nothing.

Everything else that touches a swapped layer's weights is handled on that layer's instance, and
undone when it leaves the set:
- `state_dict()` reads the host copies (the true values);
- `load_state_dict()` writes into the host copies (`assign=True` is refused: it would replace
  the parameters the swap keeps);
- `.to()`, `.half()`, `.cuda()` and friends convert the host copies and placeholders too, so
  weights never end up in two dtypes;
- PEFT's merge (`merge_and_unload`, `merge_adapter`) is refused before any layer merges;
- `copy.deepcopy`, pickling and `nn.DataParallel` replication are refused: each would read the
  placeholders as if they were the weights.

Trainable parameters (LoRA) and parameters shared with modules outside the layer stay resident.
Swapped layers are always checkpointed (`remat.plan`), so forward never keeps their weights.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .offload import CudaEvent, DoneEvent
from .patches import InstancePatches
from .refs import Ref

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

    def __reduce__(self) -> Any:  # a copy gets a stream of its own
        return (type(self), (self.device,))

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
    name: str
    params: list[nn.Parameter]
    host: list[torch.Tensor]
    placeholders: list[torch.Tensor]
    mover: WeightMover
    slot: list[torch.Tensor] | None = None
    ready: Any = None
    stats: LayerSwapStats = field(default_factory=LayerSwapStats)
    handles: list[Any] = field(default_factory=list)
    patches: InstancePatches = field(default_factory=InstancePatches)

    @property
    def layout(self) -> tuple:
        """What a slot must look like to hold this layer's weights (slots are shared by layout)."""
        return tuple((tuple(p.shape), p.dtype, p.device) for p in self.placeholders)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.placeholders)


class BlockSwapError(ValueError):
    """A layer cannot be swapped."""


def check_swappable(layers: list[tuple[int, str, nn.Module]], model: nn.Module | None = None) -> None:
    """Raise BlockSwapError if any of these layers cannot be swapped. Changes nothing."""
    owners = _parameter_owners(model) if model is not None and layers else None
    for index, name, layer in layers:
        _check_swappable(index, name, layer)
        if owners is not None and not _own_frozen_params(layer, name, owners):
            raise BlockSwapError(f"layer {index} ({name}) has no frozen weights of its own to swap")


def weights_in_use(layers: list[tuple[int, str, nn.Module]], model: nn.Module) -> list[str]:
    """The frozen weights of these layers that something besides their parameter holds: above
    all an autograd graph whose backward has not run, which saved them when a layer ran without
    checkpointing (torch counts those holders on the tensor itself). Swapping such a weight out
    would change what that backward computes. A checkpointed layer saves no weights (its
    recompute fetches them again), so it never shows here."""
    owners = _parameter_owners(model)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return [
        names.get(id(p), f"layer {index}")
        for index, name, layer in layers
        for p in _own_frozen_params(layer, name, owners)
        if p._use_count() > 1
    ]


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
    """Keeps the frozen weights of the swapped layers in host memory and fetches them just in time.

    One per wrapper, for its whole life: `update()` changes which layers are swapped, and the
    recompute shims of a step already in flight keep finding the layers they need.
    """

    def __init__(self, mover: WeightMover | None = None, prefetch_depth: int = 2):
        self.prefetch_depth = prefetch_depth
        self._fixed_mover = mover
        self._movers: dict[torch.device, WeightMover] = {}
        self.layers: dict[int, _SwappedLayer] = {}  # ascending index
        self._free: dict[tuple, list[list[torch.Tensor]]] = {}
        self._slot_count: dict[tuple, int] = {}
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self.in_recompute = False
        self._phase: tuple[str, int] | None = None  # ("forward" | "backward", last layer index)
        self._callback_queued = False
        self._model_patches = InstancePatches()
        self._model_handles: list[Any] = []
        self.swapped_names: list[str] = []  # the swapped parameters' names in the model, in its order

    def __reduce__(self) -> Any:
        """A copy of a wrapper that swaps nothing gets a swapper of its own, with the same mover
        if one was given. One that swaps is refused on the swapped layers themselves (`_Refusal`)."""
        if self.layers:
            raise TypeError(_Refusal(*next((e.index, e.name) for e in self.layers.values()))._message("copy"))
        return (type(self), (self._fixed_mover, self.prefetch_depth))

    # -- which layers are swapped -------------------------------------------------------------------

    def update(self, model: nn.Module, targets: list[tuple[int, str, nn.Module]]) -> tuple[list[int], list[int]]:
        """Swap exactly `targets` (index, name, module): layers that leave the set come home,
        layers that join move out, the others stay as they are. Returns (joined, left).

        Everything that can fail (checks, host copies) happens before anything moves.
        """
        wanted = {index: (name, module) for index, name, module in targets}
        joining = sorted((i, name, module) for i, (name, module) in wanted.items() if i not in self.layers)
        leaving = [i for i in self.layers if i not in wanted]
        check_swappable(joining, model)
        owners = _parameter_owners(model) if joining else {}
        entries = [(self._new_entry(i, name, module, owners), module) for i, name, module in joining]
        for index in leaving:
            self._bring_home(self.layers.pop(index))
        for entry, module in entries:
            self._move_out(entry, module)
            self.layers[entry.index] = entry
        self.layers = dict(sorted(self.layers.items()))
        swapped = {id(p) for entry in self.layers.values() for p in entry.params}
        self.swapped_names = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in swapped]
        self._forget_unused_slots()
        if self.layers and not self._model_handles:
            self._guard_model(model)
        elif not self.layers:
            self._unguard_model()
        return [i for i, _, _ in joining], leaving

    def _new_entry(self, index: int, name: str, module: nn.Module, owners: dict[int, set[str]]) -> _SwappedLayer:
        params = _own_frozen_params(module, name, owners)
        mover = self._mover_for(params[0].device)
        host = [mover.host_copy(p.data) for p in params]
        placeholders = [_placeholder(p.shape, p.dtype, p.device) for p in params]
        return _SwappedLayer(index, name, params, host, placeholders, mover)

    def _mover_for(self, device: torch.device) -> WeightMover:
        if self._fixed_mover is not None:
            return self._fixed_mover
        if device not in self._movers:
            self._movers[device] = CudaWeightMover(device) if device.type == "cuda" else CpuWeightMover()
        return self._movers[device]

    def _move_out(self, entry: _SwappedLayer, module: nn.Module) -> None:
        for param, placeholder in zip(entry.params, entry.placeholders, strict=True):
            param.data = placeholder
        index = entry.index
        entry.handles += [
            module.register_forward_pre_hook(self._pre_hook(index)),
            module.register_forward_hook(self._post_hook(index), always_call=True),
            module.register_state_dict_post_hook(self._state_dict_hook(index)),
            module.register_load_state_dict_pre_hook(self._load_pre_hook(index)),
            module.register_load_state_dict_post_hook(self._load_post_hook(index)),
        ]
        entry.patches.set(module, "_apply", _ConvertingApply(self, index, module))
        refusal = _Refusal(index, entry.name)
        entry.patches.set(module, "__deepcopy__", refusal.deepcopy)
        entry.patches.set(module, "__reduce_ex__", refusal.pickle)
        entry.patches.set(module, "_replicate_for_data_parallel", refusal.replicate)

    def _bring_home(self, entry: _SwappedLayer) -> None:
        """The true values back in place, on the device, as plain tensors; hooks and patches off."""
        for event in entry.ready or ():  # copies still writing into the slot must finish first
            event.synchronize()
        self._release(entry)
        for handle in entry.handles:
            handle.remove()
        entry.handles.clear()
        entry.patches.undo()
        for param, host, placeholder in zip(entry.params, entry.host, entry.placeholders, strict=True):
            # The host copy is the swapper's own: on a CPU model it becomes the weight itself.
            same_place = host.device == placeholder.device and not host.is_pinned()
            param.data = host if same_place else host.to(placeholder.device, copy=True)

    def restore(self) -> None:
        """Bring every weight home (the swapper stays usable: `update()` swaps again)."""
        for index in list(self.layers):
            self._bring_home(self.layers.pop(index))
        self._forget_unused_slots()
        self._unguard_model()
        self._phase = None

    def _forget_unused_slots(self) -> None:
        used = {entry.layout for entry in self.layers.values()}
        for layout in [layout for layout in self._slot_count if layout not in used]:
            self._free.pop(layout, None)
            del self._slot_count[layout]

    @property
    def pool_bytes(self) -> int:
        """The most swapped-weight bytes that can be resident at once."""
        per_layout = {entry.layout: entry.nbytes for entry in self.layers.values()}
        return sum(nbytes * (self.prefetch_depth + 1) for nbytes in per_layout.values())

    # -- slots ----------------------------------------------------------------------------------

    def _acquire(self, entry: _SwappedLayer, *, beyond_pool: bool = False) -> list[torch.Tensor] | None:
        layout = entry.layout
        free = self._free.setdefault(layout, [])
        if free:
            return free.pop()
        if beyond_pool or self._slot_count.get(layout, 0) <= self.prefetch_depth:
            self._slot_count[layout] = self._slot_count.get(layout, 0) + 1
            return [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in entry.placeholders]
        return None

    def _fetch(self, entry: _SwappedLayer, *, beyond_pool: bool = False) -> bool:
        if entry.slot is not None:
            return True
        slot = self._acquire(entry, beyond_pool=beyond_pool)
        if slot is None:
            return False  # every slot is busy: a prefetch waits for a later chance
        events = [entry.mover.fetch(dst, src) for dst, src in zip(slot, entry.host, strict=True)]
        entry.slot, entry.ready = slot, events
        entry.stats.fetches += 1
        entry.stats.bytes_fetched += entry.nbytes
        self.resident_bytes += entry.nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        if isinstance(entry.mover, CpuWeightMover):
            entry.mover.fetches.append(entry.index)
        return True

    def _release(self, entry: _SwappedLayer) -> None:
        if entry.slot is None:
            return
        for param, placeholder in zip(entry.params, entry.placeholders, strict=True):
            param.data = placeholder
        self._free.setdefault(entry.layout, []).append(entry.slot)
        entry.slot, entry.ready = None, None
        self.resident_bytes -= entry.nbytes

    def _use(self, index: int) -> None:
        entry = self.layers[index]
        if not self._fetch(entry):
            # Every slot of this layout is held by a prefetch for later: the running layer comes
            # first, so the prefetch farthest away gives its slot up (it is fetched again later).
            holders = [e for e in self.layers.values() if e.slot is not None and e.layout == entry.layout]
            if holders:
                self._release(max(holders, key=lambda e: abs(e.index - index)))
            self._fetch(entry, beyond_pool=not holders)
        for event in entry.ready:
            event.wait()
        for param, slot in zip(entry.params, entry.slot, strict=True):
            param.data = slot

    def _prefetch(self, upcoming: list[int]) -> None:
        for index in upcoming[: self.prefetch_depth]:
            if not self._fetch(self.layers[index]):
                break

    def release_all(self) -> None:
        for entry in self.layers.values():
            self._release(entry)

    # -- the schedule ---------------------------------------------------------------------------

    def _enter(self, direction: str, index: int) -> None:
        """Note where the schedule is. A layer that does not continue the current pass (a new
        forward, a new backward, or the first step after one that failed halfway) starts a new
        pass: whatever the last one still held is given back first."""
        continues = self._phase is not None and self._phase[0] == direction
        if continues and (index > self._phase[1] if direction == "forward" else index < self._phase[1]):
            self._phase = (direction, index)
            return
        self.release_all()
        self._callback_queued = False  # a backward that failed never ran its end callback
        self._phase = (direction, index)

    def before_forward(self, index: int) -> None:
        self._enter("forward", index)
        for earlier in [i for i in self.layers if i < index]:
            self._release(self.layers[earlier])  # done in this forward
        self._use(index)
        self._prefetch([i for i in self.layers if i > index])

    def after_forward(self, index: int) -> None:
        if index in self.layers:
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

    def before_recompute(self, index: int) -> None:
        self._enter("backward", index)
        for later in [i for i in self.layers if i > index]:
            self._release(self.layers[later])  # backward is done with every later layer
        self._use(index)
        self._prefetch([i for i in reversed(self.layers) if i < index])
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._phase = None
        self.release_all()

    # -- hooks on the swapped layers ------------------------------------------------------------

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
        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
            # state_dict() must read the true values, not the placeholder at rest.
            entry = self.layers[index]
            hosts = {id(p): host for p, host in zip(entry.params, entry.host, strict=True)}
            for name, param in module.named_parameters(remove_duplicate=False):
                host = hosts.get(id(param))
                if host is not None and prefix + name in state_dict:
                    state_dict[prefix + name] = host

        return hook

    def _load_pre_hook(self, index: int):
        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any) -> None:
            entry = self.layers[index]
            mine = {id(p) for p in entry.params}
            names = [prefix + n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in mine]
            if not any(name in state_dict for name in names):
                return  # nothing of this layer's swapped weights is loaded (adapter weights, say)
            if local_metadata.get("assign_to_params_buffers"):
                raise RuntimeError(_assign_refusal([entry.index]))
            # torch copies the loaded values into `p.data`: point it at the host copy for the load.
            self._release(entry)
            for param, host in zip(entry.params, entry.host, strict=True):
                param.data = host

        return hook

    def _load_post_hook(self, index: int):
        def hook(module: nn.Module, incompatible_keys: Any) -> None:
            entry = self.layers.get(index)
            if entry is not None:
                for param, placeholder in zip(entry.params, entry.placeholders, strict=True):
                    param.data = placeholder

        return hook

    def _apply_to_layer(self, index: int, original_apply: Any, fn: Any, recurse: bool) -> Any:
        """`module.to(...)` and friends on a swapped layer: torch converts everything else, the
        swapped weights take the same dtype and device in their host copies and placeholders."""
        entry = self.layers[index]
        self._release(entry)
        # What `fn` does to each weight is read off an empty tensor of its dtype and device:
        # applying it to the placeholder would allocate the full tensor on the device.
        probes = [fn(torch.empty(0, dtype=ph.dtype, device=ph.device)) for ph in entry.placeholders]
        for param in entry.params:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)  # hidden from torch's loop
        try:
            result = original_apply(fn, recurse)
        except BaseException:
            for param, placeholder in zip(entry.params, entry.placeholders, strict=True):
                param.data = placeholder
            raise
        hosts, placeholders = [], []
        for host, old, probe in zip(entry.host, entry.placeholders, probes, strict=True):
            converted = host.to(dtype=probe.dtype)
            if probe.device.type != old.device.type or (host.is_pinned() and not converted.is_pinned()):
                # e.g. .cuda(), or a dtype change of a pinned copy: the new copy is made (pinned) by the mover
                converted = self._mover_for(probe.device).host_copy(converted)
            hosts.append(converted)
            placeholders.append(_placeholder(old.shape, probe.dtype, probe.device))
        entry.host, entry.placeholders, entry.mover = hosts, placeholders, self._mover_for(probes[0].device)
        for param, placeholder in zip(entry.params, placeholders, strict=True):
            param.data = placeholder
        self._forget_unused_slots()
        return result

    # -- guards on the whole model while anything is swapped ------------------------------------

    def _guard_model(self, model: nn.Module) -> None:
        self._model_handles.append(model.register_load_state_dict_pre_hook(self._root_load_pre_hook))
        for module in model.modules():
            if hasattr(type(module), "_check_merge_allowed"):  # PEFT's tuner models (LoraModel, ...)
                self._model_patches.set(module, "_check_merge_allowed", self._merge_refusal)

    def _unguard_model(self) -> None:
        for handle in self._model_handles:
            handle.remove()
        self._model_handles.clear()
        self._model_patches.undo()

    def _root_load_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args):
        """Refuse before any module loads (the layers' own hooks would refuse halfway through)."""
        swapped_loaded = any(prefix + n in state_dict for n in self.swapped_names)
        if local_metadata.get("assign_to_params_buffers") and swapped_loaded:
            raise RuntimeError(_assign_refusal(list(self.layers)))

    def _merge_refusal(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"block swap keeps the frozen weights of layers {list(self.layers)} in host memory, and merging "
            "adapters into them is not supported. Bring them home first: cm.enable(cm.config.replace(swap_layers=0)) "
            "(or cm.disable()), then merge. Nothing was merged."
        )


class _ConvertingApply:
    """`module._apply` of a swapped layer (what `.to()`, `.half()`, `.cuda()` call)."""

    def __init__(self, swapper: WeightSwapper, index: int, module: nn.Module):
        self.swapper, self.index, self.module = swapper, index, Ref(module)

    def __call__(self, fn: Any, recurse: bool = True) -> Any:
        module = self.module()
        return self.swapper._apply_to_layer(self.index, type(module)._apply.__get__(module), fn, recurse)


class _Refusal:
    """What a swapped layer answers to copying, pickling and DataParallel replication."""

    def __init__(self, index: int, name: str):
        self.index, self.name = index, name

    def _message(self, what: str) -> str:
        return (
            f"cannot {what}: block swap keeps the frozen weights of layer {self.index} ({self.name}) in host "
            "memory, and its parameters hold placeholders. Bring the weights home first with "
            "cm.enable(cm.config.replace(swap_layers=0)) or cm.disable(); nothing was copied"
        )

    def deepcopy(self, memo: Any = None) -> Any:
        raise TypeError(self._message("copy.deepcopy this model"))

    def pickle(self, protocol: Any = None) -> Any:
        raise TypeError(self._message("pickle this model (torch.save of the module)"))

    def replicate(self) -> Any:
        raise RuntimeError(
            self._message("replicate this model for nn.DataParallel")
            + "; DistributedDataParallel (one process per GPU) works with block swap"
        )


def _assign_refusal(indices: list[int]) -> str:
    return (
        f"load_state_dict(assign=True) would replace the parameters of layers {indices}, whose frozen weights "
        "block swap keeps in host memory; load with assign=False (the default), which writes into the host "
        "copies, or bring the weights home first with cm.disable()"
    )


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


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
