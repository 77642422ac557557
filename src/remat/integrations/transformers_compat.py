"""Every difference between transformers versions that remat cares about, in one place.

- 4.52+: `GradientCheckpointingLayer` exists; it checkpoints from `__call__` (module hooks run
  inside the recompute).
- 5.0: the default `use_reentrant` becomes False.
- 5.16 / 5.17: `gradient_checkpointing_enable(..., every_n_layers=, offload=)`; Trainer pops
  both keys out of `gradient_checkpointing_kwargs` and passes them explicitly.
- 5.23: everything renamed to `activation_checkpointing_*` (the old names warn until v6);
  `TrainingArguments(activation_checkpointing=..., activation_checkpointing_kwargs=...)`; the
  checkpoint moved from `__call__` to `forward`.

remat drives the per-layer flag and function itself, so the enable/disable routes are the only
entry points whose names differ; this module says which ones a model has.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import transformers

# The attributes transformers' layers and stack modules carry: the flag their code reads, and
# the function a flagged layer (or a stack's loop) calls to checkpoint.
LAYER_FLAG = "gradient_checkpointing"
LAYER_FUNCTION = "_gradient_checkpointing_func"
# The KV-cache arguments transformers' own layers drop while checkpointing, with their "off" values.
CACHE_ARGUMENTS = {
    "use_cache": False,
    "past_key_value": None,
    "past_key_values": None,
    "layer_past": None,
    "cache": None,
}

ENABLE_ROUTES = ("gradient_checkpointing_enable", "activation_checkpointing_enable")
DISABLE_ROUTES = ("gradient_checkpointing_disable", "activation_checkpointing_disable")


@cache
def gradient_checkpointing_layer_class() -> type:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return GradientCheckpointingLayer


def pretrained_model_class() -> type:
    return transformers.PreTrainedModel


def has_activation_checkpointing_names() -> bool:
    """True from 5.23 on, where the `activation_checkpointing_*` names are the main ones."""
    return hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")


def routes_defined_on(model: Any) -> tuple[str, ...]:
    """The enable/disable route names that `model`'s class defines on this version."""
    return tuple(name for name in (*ENABLE_ROUTES, *DISABLE_ROUTES) if hasattr(type(model), name))


def trainer_checkpointing_args(enabled: bool = True, kwargs: dict | None = None) -> dict[str, Any]:
    """The `TrainingArguments` keywords that ask Trainer for checkpointing on this version."""
    if has_activation_checkpointing_names():
        return {"activation_checkpointing": enabled, "activation_checkpointing_kwargs": kwargs}
    return {"gradient_checkpointing": enabled, "gradient_checkpointing_kwargs": kwargs}


def trainer_asks_for_checkpointing(args: Any) -> bool:
    """Whether these `TrainingArguments` ask Trainer to turn checkpointing on."""
    name = "activation_checkpointing" if has_activation_checkpointing_names() else "gradient_checkpointing"
    return bool(getattr(args, name, False) or getattr(args, "gradient_checkpointing", False))
