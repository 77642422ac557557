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

It also holds the shims that rest on something a library does not promise (an attribute name
it reads, a message it raises), each with the versions it was checked against; a test per shim
fails when a new release breaks it.
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


def trainer_asks_for_checkpointing(args: Any) -> bool:
    """Whether these `TrainingArguments` ask Trainer to turn checkpointing on."""
    name = "activation_checkpointing" if has_activation_checkpointing_names() else "gradient_checkpointing"
    return bool(getattr(args, name, False) or getattr(args, "gradient_checkpointing", False))


def trainer_checkpointing_kwargs(args: Any) -> Any:
    """The checkpointing options these `TrainingArguments` pass to the model's enable route (the
    `activation_checkpointing_kwargs` of 5.23+, which `gradient_checkpointing_kwargs` mirrors; TRL
    may set the old name after the arguments were built)."""
    if has_activation_checkpointing_names() and getattr(args, "activation_checkpointing_kwargs", None) is not None:
        return args.activation_checkpointing_kwargs
    return getattr(args, "gradient_checkpointing_kwargs", None)


# What transformers' Trainer reads first on the model it is given, before any training step:
# `Trainer.__init__` asks `hasattr(model, "accepts_loss_kwargs")` (models declare it; only Trainer
# reads it). `CheckpointedModel` answers that read with the error naming `RematTrainer`, which
# hands Trainer `cm.model` instead, so `Trainer(model=cm)` fails at construction, never after
# writing a checkpoint. Checked against transformers 4.57.6, 5.17.0 and 5.24.0 (tests/test_trainer.py).
TRAINER_PROBE = "accepts_loss_kwargs"

# TRL's selective activation checkpointing (`trl.models.selective_activation_checkpointing.
# enable_selective_activation_checkpointing`) wraps the model's `gradient_checkpointing_enable` in a
# function it marks with this attribute, which passes `context_fn=partial(
# torch.utils.checkpoint.create_selective_checkpoint_contexts, <TRL's policy>)`. Checked against
# TRL 1.16.0 (tests/test_trl.py).
TRL_SAC_MARKER = "_is_sac_wrapped"
TRL_SAC_ROUTE = "gradient_checkpointing_enable"

# torch raises a plain RuntimeError, with no attribute of its own, when a tensor that selective
# checkpointing kept was changed in place before backward (`torch/utils/checkpoint.py`,
# `_VersionWrapper.get_val`). Matched on the whole message. Checked against torch 2.13.0
# (tests/test_selective.py).
TORCH_SAC_MUTATED = "Tensor cached during selective activation checkpoint has been mutated"


def native_every_n() -> tuple[int, ...]:
    """The `every_n_layers` transformers' own enable offers here (only 1 before 5.16), as `plot()` marks them."""
    import inspect

    routes = [getattr(transformers.PreTrainedModel, name, None) for name in ENABLE_ROUTES]
    takes = any(r is not None and "every_n_layers" in inspect.signature(r).parameters for r in routes)
    return (1, 2, 3, 4) if takes else (1,)
