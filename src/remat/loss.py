"""The loss of a measuring step (the memory report's, the planner's) and the inputs it runs on: the
model's own (`outputs.loss`) or `loss_fn(outputs, batch)`, a batch with neither refused before any
work; a batch tensor that requires grad (a soft prompt) becomes a fresh leaf, so the steps'
gradients never reach it, and a leaf outside the model gets its `.grad` back after each step's backward."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .errors import ConfigError, ConfigTypeError, StateError

LossFn = Callable[[Any, Mapping[str, Any]], torch.Tensor]


def check_step_batch(batch: Any, what: str) -> None:
    """A measuring step's batch is the model's keyword inputs, and its backward needs gradients: refused before any
    work (torch's own error came after a forward, and named no fix)."""
    if not isinstance(batch, Mapping):
        raise ConfigTypeError(
            f"{what} takes the model's inputs as a dict, as cm(**batch) does (input_ids, attention_mask, labels, ...), "
            f"got {type(batch).__name__}"
        )
    if not torch.is_grad_enabled():
        raise StateError(
            f"{what} runs a training step, whose backward needs gradients: call it outside torch.no_grad() and "
            "torch.inference_mode()"
        )


def check_loss_source(model: nn.Module, batch: Mapping[str, Any], loss_fn: LossFn | None, what: str) -> None:
    """Refuse, before any work, a batch from which no loss can come (`check_step_batch` first)."""
    check_step_batch(batch, what)
    if loss_fn is not None:
        if not callable(loss_fn):
            raise ConfigTypeError(
                f"{what}: loss_fn must be a callable (outputs, batch) -> loss, got {type(loss_fn).__name__}"
            )
        return
    from transformers.utils import find_labels

    base = model.get_base_model() if hasattr(type(model), "get_base_model") else model  # under a PeftModel
    names = {"labels", *find_labels(type(base))}  # the batch keys from which the model computes its own loss
    if not any(batch.get(name) is not None for name in names):
        raise ConfigError(
            f"{what} runs training steps and needs a loss: this batch has no labels ({', '.join(sorted(names))}) "
            "and no loss_fn was given. Add labels to the batch, or pass loss_fn=lambda outputs, batch: ... "
            "returning a scalar tensor"
        )


def own_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch with every tensor that requires grad replaced by a fresh leaf sharing its memory."""
    return {
        key: value.detach().requires_grad_(True) if isinstance(value, torch.Tensor) and value.requires_grad else value
        for key, value in batch.items()
    }


def step_loss(model: nn.Module, batch: Mapping[str, Any], loss_fn: LossFn | None) -> torch.Tensor:
    """Forward `model(**batch)` and its scalar loss."""
    outputs = model(**batch)
    if loss_fn is not None:
        loss = loss_fn(outputs, batch)
    elif isinstance(outputs, tuple) and outputs and isinstance(outputs[0], torch.Tensor) and not outputs[0].dim():
        loss = outputs[0]  # return_dict=False with labels: transformers puts the loss first
    else:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        source = "loss_fn" if loss_fn is not None else "the model's output .loss"
        raise ConfigError(
            f"{source} gave {type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}, "
            "not a scalar tensor: pass loss_fn=lambda outputs, batch: ... returning the scalar loss"
        )
    return loss


def step_backward(loss: torch.Tensor, model: nn.Module) -> None:
    """`loss.backward()`, then the leaves outside the model that it reached (a steering vector a hook adds, an
    embedding the user keeps) given back the `.grad` they had: every measuring step's gradient was added to theirs,
    and the model's snapshot cannot see them. Backward's `inputs=` would say it, but torch refuses it under reentrant
    checkpointing (the model's own, or `use_reentrant=True`). A leaf that only a reentrant checkpoint's inner graph
    uses is not reached from the loss, and still gets the gradient."""
    own = {id(p) for p in model.parameters()}
    outside = [(leaf, leaf.grad) for leaf in _leaves(loss) if id(leaf) not in own]
    for leaf, _ in outside:
        leaf.grad = None  # backward adds into a `.grad` in place
    try:
        loss.backward()
    finally:
        for leaf, grad in outside:
            leaf.grad = grad


def _leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose gradients the graph of `loss` accumulates (its AccumulateGrad nodes' variables)."""
    seen, todo, leaves = set(), [loss.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":  # a custom Function's node may have a `variable` too
            leaves.append(node.variable)
        todo.extend(child for child, _ in node.next_functions)
    return leaves
