"""Discovery: the ordered list of layers remat can checkpoint.

transformers marks its repeated blocks (decoder layers, vision-tower layers) as
`GradientCheckpointingLayer`s; remat drives their own per-layer flag ("flag" layers). Models
whose blocks are plain modules (remote code, the pre-4.35 checkpointing format, hand-written
stacks) are found three ways, and remat wraps those blocks' `forward` on the instance ("wrap"
layers):

1. the classes named by `layer_class` (explicit, for when discovery cannot decide), added to
   any GradientCheckpointingLayers;
2. in a model with no GradientCheckpointingLayer, the classes it lists in `_no_split_modules`
   (its own word for "a block") that occur at least twice;
3. failing that, the children of an `nn.ModuleList` of at least two modules of one class (the
   repeated-block structure of a decoder stack).

Rules 2 and 3 never apply to a model that has GradientCheckpointingLayers, so for transformers'
own models the map counts exactly the layers transformers' `every_n_layers` counts.

All layers share one map, numbered in `named_modules()` order: for a transformers model that is
the order its own `every_n_layers` counts in. A layer nested inside another discovered layer is
skipped (the experts of an MoE block, a block inside a composite layer): checkpointing both
would recompute the inner one twice.

Modules that carry a `gradient_checkpointing` flag but are not layers (the `LlamaModel` holding
the stack, a remote-code model whose loop calls `self._gradient_checkpointing_func`) are
"holders". transformers reads their flag to turn `use_cache` off while training; remat sets it
only where the holder's code goes through `_gradient_checkpointing_func` (which remat replaces
by a pass-through), never where it would call torch's checkpoint itself around a layer that
already has one.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .compat.transformers_compat import LAYER_FLAG, gradient_checkpointing_layer_class
from .errors import ConfigTypeError, NoCheckpointableLayersError
from .refs import Ref


class DiscoveredLayer:
    """A layer (or holder) found in the model: its name, kind, and the module, held weakly
    (remat's state never keeps the model alive, see `remat.refs`)."""

    __slots__ = ("_module", "kind", "name")

    def __init__(self, name: str, module: nn.Module, kind: str = "flag"):
        self.name = name
        self.kind = kind  # "flag": a GradientCheckpointingLayer; "wrap": a plain block; "holder"
        self._module = Ref(module)

    @property
    def module(self) -> nn.Module:
        return self._module.alive(f"layer {self.name} of the wrapped model no longer exists; wrap the model you train")


@dataclass(frozen=True)
class Discovery:
    layers: tuple[DiscoveredLayer, ...]
    holders: tuple[DiscoveredLayer, ...]

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]


def _class_names(value: str | type | Sequence[str | type] | None) -> set[str]:
    if value is None:
        return set()
    if isinstance(value, (str, type)):
        items = [value]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        raise ConfigTypeError(f"layer_class must be a class, a class name, or a list of them; got {value!r}")
    names = set()
    for item in items:
        if isinstance(item, type):
            names.add(item.__name__)
        elif isinstance(item, str) and item:
            names.add(item)
        else:
            raise ConfigTypeError(f"layer_class must name a class (a str or a type), got {item!r}")
    return names


def _no_split_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(type(module), "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.update(n for n in declared if isinstance(n, str))
    return names


def _repeated_stacks(model: nn.Module) -> set[int]:
    """ids of the children of ModuleLists holding >= 2 modules of one class, with parameters."""
    found: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and any(True for _ in module[0].parameters()) and len(list(module[0].children())):
                found.update(id(child) for child in module)
    return found


def calls_checkpoint_directly(module: nn.Module) -> bool:
    """Whether the module's forward calls torch's checkpoint itself (instead of going through
    `_gradient_checkpointing_func`); setting its flag would nest a checkpoint around remat's.

    Read from the compiled code, not the source: the names the forward (and any function defined
    inside it) looks up. `torch.utils.checkpoint.checkpoint(...)`, `checkpoint(...)` and
    `checkpoint_sequential(...)` all look up such a name; `self._gradient_checkpointing_func(...)`
    does not. Comments and strings do not count, and code whose source file is gone (remote code
    built at run time) is read all the same."""
    code = getattr(type(module).forward, "__code__", None)
    if not isinstance(code, types.CodeType):
        return True  # not Python code: cannot tell, so do not risk a nested checkpoint
    return bool(_looked_up_names(code) & _TORCH_CHECKPOINTS)


_TORCH_CHECKPOINTS = frozenset({"checkpoint", "checkpoint_sequential"})


def _looked_up_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # a function or lambda defined inside
            names |= _looked_up_names(constant)
    return names


def _check_classes_exist(model: nn.Module, explicit: set[str], named: list[tuple[str, nn.Module]]) -> None:
    """Each class `layer_class` names must occur in the model: a typo would otherwise be ignored."""
    counts: dict[str, int] = {}
    for _, module in named:
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    missing = sorted(explicit - set(counts))
    if missing:
        repeated = sorted(name for name, count in counts.items() if count >= 2)
        raise NoCheckpointableLayersError(
            f"layer_class names {missing}, but {type(model).__name__} has no module of that class. "
            f"Classes that occur more than once in it: {repeated}; name one of those"
        )


def discover_layers(model: nn.Module, layer_class: str | type | Sequence[str | type] | None = None) -> Discovery:
    """Find the checkpointable layers of `model` (and the flag holders), in module order."""
    gc_layer = gradient_checkpointing_layer_class()
    explicit = _class_names(layer_class)
    named = list(model.named_modules(remove_duplicate=True))
    candidates = [(n, m, "flag") for n, m in named if isinstance(m, gc_layer)]
    if explicit:
        _check_classes_exist(model, explicit, named)
        candidates += [(n, m, "wrap") for n, m in named if type(m).__name__ in explicit and not isinstance(m, gc_layer)]
    elif not candidates:
        # No transformers layers: the model's own block classes, repeated; else the stack structure.
        declared = _no_split_names(model)
        blocks = [(n, m, "wrap") for n, m in named if type(m).__name__ in declared]
        counts = {name: sum(type(m).__name__ == name for _, m, _ in blocks) for name in declared}
        candidates = [c for c in blocks if counts[type(c[1]).__name__] >= 2]
        if not candidates:
            stacked = _repeated_stacks(model)
            candidates = [(n, m, "wrap") for n, m in named if id(m) in stacked]
    order = {name: i for i, (name, _) in enumerate(named)}
    candidates.sort(key=lambda c: order[c[0]])

    layers: list[DiscoveredLayer] = []
    for name, module, kind in candidates:
        if any(name.startswith(outer.name + ".") for outer in layers):
            continue
        layers.append(DiscoveredLayer(name, module, kind))
    if not layers:
        searched = (
            f"modules of class {sorted(explicit)} (layer_class)"
            if explicit
            else (
                f"{gc_layer.__name__} submodules, the classes in _no_split_modules "
                f"({sorted(_no_split_names(model)) or 'none declared'}), and nn.ModuleList stacks of one repeated block"
            )
        )
        raise NoCheckpointableLayersError(
            f"{type(model).__name__} has no checkpointable layers: remat looked for {searched} and found none. "
            "Name the decoder block class with layer_class=... if the model has one."
        )
    layer_ids = {id(layer.module) for layer in layers}
    holders = tuple(
        DiscoveredLayer(name, module, "holder")
        for name, module in named
        if hasattr(module, LAYER_FLAG) and id(module) not in layer_ids and not isinstance(module, gc_layer)
    )
    return Discovery(tuple(layers), holders)
