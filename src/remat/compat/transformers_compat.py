"""Every difference between transformers versions that remat cares about, in one place.

- 4.52+: `GradientCheckpointingLayer` checkpoints from `__call__` (module hooks run inside the recompute).
- 5.0: the default `use_reentrant` becomes False.
- 5.16 / 5.17: `gradient_checkpointing_enable(..., every_n_layers=, offload=)`; Trainer pops both
  keys out of `gradient_checkpointing_kwargs` and passes them explicitly.
- 5.23: everything renamed `activation_checkpointing_*` (old names warn until v6), in
  `TrainingArguments` too; the checkpoint moved from `__call__` to `forward`.

remat drives the per-layer flag and function itself, so only the enable/disable routes' names
differ. Also here: each shim resting on what a library does not promise (an attribute it reads, a
message it raises), with the versions checked; a test per shim fails when a release breaks it.
"""

from __future__ import annotations

from typing import Any

import transformers

# The flag transformers' layers and stacks read, and the function a flagged layer (or stack loop) calls.
LAYER_FLAG = "gradient_checkpointing"
LAYER_FUNCTION = "_gradient_checkpointing_func"
# The KV-cache arguments transformers' own layers drop while checkpointing, with their "off" values.
CACHE_ARGUMENTS = {"use_cache": False} | dict.fromkeys(("past_key_value", "past_key_values", "layer_past", "cache"))

ENABLE_ROUTES = ("gradient_checkpointing_enable", "activation_checkpointing_enable")
DISABLE_ROUTES = ("gradient_checkpointing_disable", "activation_checkpointing_disable")


def gradient_checkpointing_layer_class() -> type:
    return transformers.modeling_layers.GradientCheckpointingLayer


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
    """The options these `TrainingArguments` pass to the enable route (5.23+'s
    `activation_checkpointing_kwargs`; TRL may set the old name after the arguments were built)."""
    if has_activation_checkpointing_names() and getattr(args, "activation_checkpointing_kwargs", None) is not None:
        return args.activation_checkpointing_kwargs
    return getattr(args, "gradient_checkpointing_kwargs", None)


# What `Trainer.__init__` reads first on its model (`hasattr(model, "accepts_loss_kwargs")`; only
# Trainer reads it): `CheckpointedModel` answers with the error naming `RematTrainer`, so
# `Trainer(model=cm)` fails at construction, never after writing a checkpoint. Checked against
# transformers 4.57.6, 5.17.0 and 5.24.0 (tests/test_trainer.py).
TRAINER_PROBE = "accepts_loss_kwargs"

# TRL's selective activation checkpointing wraps the model's `gradient_checkpointing_enable` in a
# function marked with this attribute, which passes `context_fn=partial(
# create_selective_checkpoint_contexts, <TRL's policy>)`. Checked against TRL 1.16.0 (tests/test_trl.py).
TRL_SAC_MARKER = "_is_sac_wrapped"
TRL_SAC_ROUTE = "gradient_checkpointing_enable"

# torch's plain RuntimeError when a tensor selective checkpointing kept was changed in place before
# backward (`_VersionWrapper.get_val`), matched on the whole message. Checked against torch 2.13.0
# (tests/test_selective.py).
TORCH_SAC_MUTATED = "Tensor cached during selective activation checkpoint has been mutated"


def native_every_n() -> tuple[int, ...]:
    """The `every_n_layers` transformers' own enable offers here (only 1 before 5.16), as `plot()` marks them."""
    import inspect

    routes = [getattr(transformers.PreTrainedModel, name, None) for name in ENABLE_ROUTES]
    takes = any(r is not None and "every_n_layers" in inspect.signature(r).parameters for r in routes)
    return (1, 2, 3, 4) if takes else (1,)


def router_logits_recorded_inside_layers(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether this forward asks transformers to record router logits, which an MoE's aux loss is made of, through
    forward hooks on modules inside the layers (the model's `_can_record_outputs`: 5.x everywhere, and 4.57's
    Mixtral). A keyword (`output_router_logits=True`) takes precedence over the config, as transformers reads them.
    (Attentions are recorded so too, but no loss of the model's is made of them, and with sdpa none are.)"""
    for module in model.modules():
        recorded = getattr(type(module), "_can_record_outputs", None)
        if isinstance(recorded, dict) and "router_logits" in recorded:
            config = getattr(module, "config", None)
            if kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)):
                return True
    return False


def kv_shared_across_layers(model: Any) -> bool:
    """Whether later layers read the keys and values earlier layers computed (Gemma 3n's `num_kv_shared_layers`,
    passed along in a dict): under reentrant checkpointing those run without gradients, and the gradients of the
    layers that made them were silently wrong (transformers' own reentrant checkpointing too)."""
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    return any(isinstance(n := getattr(c, "num_kv_shared_layers", 0), int) and n > 0 for c in configs if c is not None)
