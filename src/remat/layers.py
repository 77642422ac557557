"""Discovery: the ordered list of layers remat can checkpoint.

transformers marks its repeated blocks (decoder layers, vision-tower layers) as
`GradientCheckpointingLayer`s. They are taken in `named_modules()` order, which is the order
transformers' own `every_n_layers` counts in, so index i here is index i there. A layer nested
inside another discovered layer is skipped: checkpointing both would recompute the inner one
twice (a nested checkpoint).

Modules that carry a `gradient_checkpointing` flag but are not layers (the `LlamaModel` that
holds the stack, for example) are "holders": transformers reads their flag to turn `use_cache`
off while training with checkpointing. They are reported separately so the installer can drive
their flag without ever letting them checkpoint anything themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .integrations.transformers_compat import gradient_checkpointing_layer_class


class NoCheckpointableLayersError(ValueError):
    """The model has no layer remat knows how to checkpoint."""


@dataclass(frozen=True)
class DiscoveredLayer:
    name: str
    module: nn.Module


@dataclass(frozen=True)
class Discovery:
    layers: tuple[DiscoveredLayer, ...]
    holders: tuple[DiscoveredLayer, ...]

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]


def discover_layers(model: nn.Module) -> Discovery:
    """Find the checkpointable layers of `model` (and the flag holders), in module order."""
    layer_class = gradient_checkpointing_layer_class()
    layers: list[DiscoveredLayer] = []
    holders: list[DiscoveredLayer] = []
    for name, module in model.named_modules(remove_duplicate=True):
        if isinstance(module, layer_class):
            if any(name.startswith(outer.name + ".") for outer in layers):
                continue
            layers.append(DiscoveredLayer(name, module))
        elif hasattr(module, "gradient_checkpointing"):
            holders.append(DiscoveredLayer(name, module))
    if not layers:
        raise NoCheckpointableLayersError(
            f"{type(model).__name__} has no checkpointable layers: remat looked for "
            f"transformers.{layer_class.__module__.split('transformers.')[-1]}.{layer_class.__name__} "
            "submodules (the decoder and vision-tower layers of transformers models) and found none"
        )
    return Discovery(tuple(layers), tuple(holders))
