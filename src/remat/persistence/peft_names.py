"""PEFT's file names and folder layout, from PEFT itself, and the two questions about a model
that saving asks of PEFT (is it a PeftModel; its method without remat's override)."""

from __future__ import annotations

from typing import Any

from peft.utils import CONFIG_NAME as ADAPTER_CONFIG
from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

ADAPTER_WEIGHTS = (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME)
"""The weight files PEFT writes, in the order `load_peft_weights` looks for them."""

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_folder", "is_peft_model", "original_method"]


def adapter_folder(adapter_name: str) -> str:
    """Where `PeftModel.save_pretrained` puts an adapter (PEFT computes it inline, exporting no
    helper; `tests/test_folder_transaction.py` checks it against PEFT)."""
    return "" if adapter_name == "default" else adapter_name


def is_peft_model(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def original_method(model: Any, name: str) -> Any:
    """The method as the class defines it, even while remat's override sits on the instance."""
    return getattr(type(model), name).__get__(model)
