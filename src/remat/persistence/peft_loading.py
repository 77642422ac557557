"""Loading checked adapters through PEFT, and the checks that need PEFT, made before anything
changes."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..errors import ConfigError, SavedFileError
from ..saving.files import read_json_object
from .pair_format import Loaded
from .peft_names import ADAPTER_CONFIG, is_peft_model, original_method

_PEFT_BOOKKEEPING = {"base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version"}


def load_adapters(model: nn.Module, loaded: Loaded, is_trainable: bool, kwargs: dict[str, Any]) -> nn.Module:
    """Every saved adapter into `model` (a base model becomes a PeftModel); returns the model."""
    adapters = list(loaded.adapters)
    if not is_peft_model(model):
        from peft import PeftModel

        first = next((a for a in adapters if a.name == "default"), adapters[0])
        adapters = [a for a in adapters if a is not first]
        model = PeftModel.from_pretrained(
            model, loaded.adapter_path(first), adapter_name=first.name, is_trainable=is_trainable, **kwargs
        )
    for adapter in adapters:
        original_method(model, "load_adapter")(
            loaded.adapter_path(adapter), adapter_name=adapter.name, is_trainable=is_trainable, **kwargs
        )
    return model


def check_trainable_load(model: Any, loaded: Loaded, is_trainable: bool) -> None:
    """Refuse a new prompt-learning adapter as trainable (PEFT would, halfway)."""
    if not is_trainable:
        return
    from peft.config import PromptLearningConfig
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    existing = model.peft_config if is_peft_model(model) else {}
    for adapter in loaded.adapters:
        if adapter.name in existing:
            continue
        peft_type = read_json_object(os.path.join(loaded.adapter_path(adapter), ADAPTER_CONFIG)).get("peft_type")
        config_class = PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type) if isinstance(peft_type, str) else None
        if config_class is not None and issubclass(config_class, PromptLearningConfig):
            raise ConfigError(
                f"adapter {adapter.name!r} in {loaded.snapshot.name(adapter.folder)} is a prompt-learning adapter "
                f"({peft_type}), which PEFT loads for inference only (it saved the prompts, not the encoder that "
                "made them); load it with is_trainable=False. Nothing was loaded"
            )


def check_loadable_into(model: Any, loaded: Loaded) -> None:
    """Refuse replacing a PeftModel's adapter by a saved one of another structure."""
    from peft import PeftConfig
    from peft.utils import get_peft_model_state_dict

    for adapter in loaded.adapters:
        if adapter.name not in model.peft_config:
            continue  # a new adapter: PEFT adds it (undone if that fails)
        where = loaded.snapshot.name(adapter.folder)
        saved_config = PeftConfig.from_pretrained(loaded.adapter_path(adapter))
        differs = _config_differences(model.peft_config[adapter.name], saved_config)
        if differs:
            raise SavedFileError(
                f"the model's adapter {adapter.name!r} differs from the saved one in {where} ({differs}); load into "
                "the base model (not a PeftModel) to get the saved adapter as it was. Nothing was loaded"
            )
        expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model, adapter_name=adapter.name).items()}
        found = _tensor_shapes(loaded.snapshot.path(adapter.file()))
        if expected != found:
            diff = sorted(set(expected.items()) ^ set(found.items()))[:3]
            raise SavedFileError(
                f"the saved weights of adapter {adapter.name!r} ({loaded.snapshot.name(adapter.file())}) do not fit "
                f"the model's adapter (names or shapes differ, e.g. {diff}); load into the base model. Nothing loaded"
            )


def _config_differences(current: Any, saved: Any) -> str:
    mine, theirs = _comparable(current.to_dict()), _comparable(saved.to_dict())
    keys = sorted(k for k in set(mine) | set(theirs) if k not in _PEFT_BOOKKEEPING and mine.get(k) != theirs.get(k))
    return ", ".join(f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} saved" for k in keys)


def _comparable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_comparable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    return value


def _tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    if path.endswith(".safetensors"):
        import safetensors

        with safetensors.safe_open(path, framework="pt") as saved:
            return {k: tuple(saved.get_slice(k).get_shape()) for k in saved.keys()}  # noqa: SIM118
    import torch

    return {k: tuple(v.shape) for k, v in torch.load(path, map_location="meta", weights_only=True).items()}
