"""Saving and loading a `CheckpointedModel`: the adapters as PEFT writes them, plus
`checkpoint_config.json` with the config and the layers it was planned for."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .config import CONFIG_NAME, CheckpointConfig
from .saving import read_json_object, write_json_atomically

if TYPE_CHECKING:
    from torch import nn

    from .model import CheckpointedModel


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def save_checkpointed_model(cm: CheckpointedModel, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    os.makedirs(save_directory, exist_ok=True)
    if _is_peft_model(cm.model):
        cm.model.save_pretrained(save_directory, **kwargs)
    payload = json.loads(cm._config.to_json_string())
    payload["layers"] = [plan.name for plan in cm.checkpoint_map]
    text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
    write_json_atomically(os.path.join(save_directory, CONFIG_NAME), text)


def load_checkpointed_model(
    cls: type[CheckpointedModel], model: nn.Module, path: str | os.PathLike, *, is_trainable: bool, **kwargs: Any
) -> CheckpointedModel:
    file = os.path.join(path, CONFIG_NAME)
    data = read_json_object(file)
    config = CheckpointConfig.from_dict(data, source=file)
    if os.path.exists(os.path.join(path, "adapter_config.json")) and not _is_peft_model(model):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path, is_trainable=is_trainable, **kwargs)
    cm = cls(model, config)
    saved_layers = data.get("layers")
    if saved_layers is not None:
        current = [plan.name for plan in cm.checkpoint_map]
        if len(saved_layers) != len(current):
            cm.disable()
            raise ValueError(
                f"{file} was planned for {len(saved_layers)} layers, but this model has {len(current)}; "
                "load it into the model it was saved from"
            )
    if not is_trainable:
        cm.for_inference()
    return cm
