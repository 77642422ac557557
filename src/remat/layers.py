"""Discovery: the ordered layers remat can checkpoint. transformers' `GradientCheckpointingLayer`s ("flag"),
so the map counts what its `every_n_layers` counts; else plain blocks ("wrap"): `layer_class`, else classes
of `_no_split_modules` occurring twice, else a `ModuleList` of one class. A layer inside another is skipped
(it would be recomputed twice); other modules carrying the flag are "holders" (`remat.install`)."""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .compat.transformers_compat import LAYER_FLAG, gradient_checkpointing_layer_class
from .errors import ConfigTypeError, NoCheckpointableLayersError
from .refs import Ref


class DiscoveredLayer:
    """A layer found in the model: its name, kind ("flag", "wrap" or "holder") and the module, held weakly."""

    __slots__ = ("_module", "kind", "name")

    def __init__(self, name: str, module: nn.Module, kind: str = "flag"):
        self.name, self.kind, self._module = name, kind, Ref(module)

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


# The attributes through which a wrapper put in a layer's place runs that layer (torch.compile's, FSDP's, torch's
# checkpoint wrapper, DDP's): a wrapper that holds the layer but runs another module (PEFT's ModulesToSaveWrapper runs
# its copy) is a change.
PASS_THROUGH = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module")


class Placement:
    """Where the layers were found: each step of the module tree from the model down to them and how many modules
    each list holding layers held, both held weakly and read in microseconds before every training step
    (`get_submodule` through PEFT's wrappers took 8 us a layer); on a difference `changed` says what it is."""

    def __init__(self, model: nn.Module, discovery: Discovery):
        steps: dict[tuple[int, str], tuple[Ref[nn.Module], str, Ref[nn.Module]]] = {}
        for layer in discovery.layers:
            module = model
            for part in layer.name.split(".") if layer.name else []:
                if (child := module._modules.get(part)) is None:
                    break
                steps[(id(module), part)] = (Ref(module), part, Ref(child))
                module = child
        self._steps = list(steps.values())
        parents = {layer.name.rpartition(".")[0] for layer in discovery.layers}
        lists = ((name, _submodule(model, name)) for name in parents)
        self._lists = [(name, Ref(held), len(held)) for name, held in lists if isinstance(held, nn.ModuleList)]

    def same(self) -> bool:
        for parent, key, child in self._steps:
            if (module := parent()) is None or module._modules.get(key) is not child():
                return False
        return all((held := ref()) is not None and len(held) == count for _, ref, count in self._lists)

    def changed(self, model: nn.Module, discovery: Discovery) -> str | None:
        """How the layers found in `model` have changed since (pruned, replaced, added), in words; None: as found."""
        for layer in discovery.layers:
            now, found = _submodule(model, layer.name), layer._module()
            if now is None:
                return f"{layer.name} is no longer in the model"
            while now is not found and (inner := _runs_through(now)) is not None:
                now = inner
            if found is None or now is not found:
                return f"{layer.name} is another module than the layer wrapped"
        for name, _, count in self._lists:
            if isinstance(held := _submodule(model, name), nn.ModuleList) and len(held) != count:
                return f"{name or 'the model'} holds {len(held)} modules, {count} when wrapped"
        return None


def _runs_through(wrapper: nn.Module) -> nn.Module | None:
    return next((inner for key in PASS_THROUGH if (inner := wrapper._modules.get(key)) is not None), None)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _class_names(value: str | type | Sequence[str | type] | None) -> set[str]:
    items = [] if value is None else [value] if isinstance(value, (str, type)) else value
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise ConfigTypeError(f"layer_class must be a class, a class name, or a list of them; got {value!r}")
    for item in items:
        if not isinstance(item, type) and not (isinstance(item, str) and item):
            raise ConfigTypeError(f"layer_class must name a class (a str or a type), got {item!r}")
    return {item.__name__ if isinstance(item, type) else item for item in items}


def _no_split_names(model: nn.Module) -> set[str]:
    declared = [getattr(type(module), "_no_split_modules", None) for module in model.modules()]
    return {n for names in declared if isinstance(names, (list, tuple, set)) for n in names if isinstance(n, str)}


def _runs(module: nn.Module) -> bool:
    """Whether the module has a forward to call: a container (a `ModuleList` of the blocks a model's loop calls one by
    one) has none, and a map over it would say "recompute" where nothing is checkpointed."""
    return type(module).forward is not nn.Module.forward


def _repeated_stacks(model: nn.Module) -> set[int]:
    """ids of the children of ModuleLists holding >= 2 modules of one class, with parameters and a forward."""
    found: set[int] = set()
    for module in model.modules():
        one_class = isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(c) for c in module}) == 1
        if one_class and _runs(module[0]) and any(True for _ in module[0].parameters()) and len(module[0]._modules):
            found.update(id(child) for child in module)
    return found


def _lift_into_stack(named: list[tuple[str, nn.Module]], blocks: list[tuple[str, nn.Module, str]]) -> list:
    """Blocks found inside a module that sits in a list beside blocks are that module: it is what the list runs per
    layer. (Zamba's hybrid layer on transformers 4.x, in the list of Mamba blocks, runs a shared attention block and a
    Mamba block: taking the Mamba block alone would leave the attention, a third of the step, never checkpointed.)"""
    names = {name for name, _, _ in blocks}
    lifted: dict[str, tuple[str, nn.Module, str]] = {}
    for name, module in named:
        children = [f"{name}.{key}" if name else key for key in module._modules]
        if not isinstance(module, nn.ModuleList) or not names.intersection(children):
            continue
        for child_name, child in zip(children, module._modules.values(), strict=True):
            if child_name not in names and _runs(child) and any(n.startswith(child_name + ".") for n in names):
                lifted[child_name] = (child_name, child, "wrap")
    kept = [b for b in blocks if not any(b[0].startswith(outer + ".") for outer in lifted)]
    return kept + list(lifted.values())


def _gives_way(module: nn.Module, kind: str, candidates: list[tuple[str, nn.Module, str]], explicit: set[str]) -> bool:
    """Whether a layer holding other layers is left for them (else it is taken, and they are not): a class named by
    `layer_class` inside it (unless its own class is named too), or, a transformers layer, a list of transformers
    layers it holds (Swin's stage on transformers 5.2x: recomputed whole, a stage held 2.4x what its blocks do).
    Zamba's hybrid layer, whose Mamba block is a layer held directly beside the shared attention, stays the layer, and
    so do blocks found by class or by structure (their inner stacks leave out what the block does around them)."""
    if type(module).__name__ in explicit:
        return False
    inside = {id(m) for m in module.modules() if m is not module}
    found = [(m, k) for _, m, k in candidates if id(m) in inside]
    if any(type(m).__name__ in explicit for m, _ in found):
        return True
    held = {id(m) for m, k in found if k == "flag"}
    return kind == "flag" and any(
        isinstance(child, nn.ModuleList) and any(id(c) in held for c in child) for child in module.children()
    )


_TORCH_CHECKPOINTS = frozenset({"checkpoint", "checkpoint_sequential"})


def calls_checkpoint_directly(module: nn.Module) -> bool:
    """Whether the module's forward calls torch's checkpoint itself, so its flag would nest one around remat's.
    Read from the names its compiled code looks up: comments do not count, code without a source file reads."""
    code = getattr(type(module).forward, "__code__", None)
    if not isinstance(code, types.CodeType):
        return True  # not Python code: cannot tell, so do not risk a nested checkpoint
    return bool(_looked_up_names(code) & _TORCH_CHECKPOINTS)


def _looked_up_names(code: types.CodeType) -> set[str]:  # with those of functions and lambdas defined inside
    return set(code.co_names).union(*(_looked_up_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def discover_layers(model: nn.Module, layer_class: str | type | Sequence[str | type] | None = None) -> Discovery:
    """Find the checkpointable layers of `model` (and the flag holders), in module order."""
    gc_layer = gradient_checkpointing_layer_class()
    explicit = _class_names(layer_class)
    named = list(model.named_modules(remove_duplicate=True))
    candidates = [(n, m, "flag") for n, m in named if isinstance(m, gc_layer)]
    if explicit:
        counts = Counter(type(module).__name__ for _, module in named)
        if missing := sorted(explicit - set(counts)):  # a typo would otherwise be ignored
            repeated = sorted(name for name, count in counts.items() if count >= 2)
            raise NoCheckpointableLayersError(
                f"layer_class names {missing}, but {type(model).__name__} has no module of that class. "
                f"Classes that occur more than once in it: {repeated}; name one of those"
            )
        if containers := sorted({type(m).__name__ for _, m in named if type(m).__name__ in explicit and not _runs(m)}):
            raise NoCheckpointableLayersError(
                f"layer_class names {containers}, a container with no forward of its own: the model calls the blocks "
                "inside it, so name the class of those blocks"
            )
        candidates += [(n, m, "wrap") for n, m in named if type(m).__name__ in explicit and not isinstance(m, gc_layer)]
    elif not candidates:
        # No transformers layers: the model's own block classes, repeated; else the stack structure.
        declared = _no_split_names(model)
        blocks = [(n, m, "wrap") for n, m in named if type(m).__name__ in declared]
        counts = Counter(type(m).__name__ for _, m, _ in blocks)
        candidates = _lift_into_stack(named, [c for c in blocks if counts[type(c[1]).__name__] >= 2])
        if not candidates:
            stacked = _repeated_stacks(model)
            candidates = [(n, m, "wrap") for n, m in named if id(m) in stacked]
    order = {name: i for i, (name, _) in enumerate(named)}
    candidates.sort(key=lambda c: order[c[0]])
    layers: list[DiscoveredLayer] = []
    for name, module, kind in candidates:
        if not any(name.startswith(outer.name + ".") for outer in layers) and not _gives_way(
            module, kind, candidates, explicit
        ):
            layers.append(DiscoveredLayer(name, module, kind))
    if not layers:
        searched = f"modules of class {sorted(explicit)} (layer_class)"
        if not explicit:
            searched = (
                f"{gc_layer.__name__} submodules, the classes in _no_split_modules "
                f"({sorted(_no_split_names(model)) or 'none declared'}), and nn.ModuleList stacks of one repeated block"
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
