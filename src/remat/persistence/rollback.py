"""Putting a model back as it was when loading adapters into it fails halfway: `ModelChanges`
records what PEFT's load may change in place before it runs, and `revert()` puts it back."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .peft_names import is_peft_model


class ModelChanges:
    """Modules, requires_grad, a PeftModel's adapters and their weights, instance attributes."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.children = [(module, dict(module._modules)) for module in model.modules()]
        self.requires_grad = [(p, p.requires_grad) for p in model.parameters()]
        self.attributes = set(model.__dict__)
        self.adapters = list(model.peft_config) if is_peft_model(model) else None
        marks = [f".{name}." for name in self.adapters or ()]
        self.values = [(p, p.detach().clone()) for n, p in model.named_parameters() if any(m in n for m in marks)]

    def revert(self) -> None:
        model: Any = self.model
        if self.adapters is not None:
            for name in [n for n in model.peft_config if n not in self.adapters]:
                with contextlib.suppress(Exception):  # a half-added adapter: the steps below finish the job
                    model.delete_adapter(name)
                model.peft_config.pop(name, None)
        for module, children in self.children:
            module._modules.clear()
            module._modules.update(children)
        for param, flag in self.requires_grad:
            param.requires_grad_(flag)
        with torch.no_grad():
            for param, value in self.values:
                param.copy_(value)
        for name in set(model.__dict__) - self.attributes:
            hook = model.__dict__[name]
            if name == "_require_grads_hook" and hasattr(hook, "remove"):
                hook.remove()  # transformers' enable_input_require_grads, called by PEFT
            del model.__dict__[name]
