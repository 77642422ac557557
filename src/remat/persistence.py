"""Saving and loading a `CheckpointedModel`: the adapters exactly as PEFT writes them, plus
`checkpoint_config.json` with the config and the layers it was planned for.

A save is atomic: everything is written into a temporary folder beside the target, which then
replaces the target with two renames (the old folder is moved aside, the new one moved in, the
old one deleted). A crash while writing leaves the previous save untouched; a crash between the
two renames leaves it in `<path>.old-*`, from which `from_pretrained` recovers with a warning.

While a model is wrapped, its own `save_pretrained` also writes `checkpoint_config.json`, and a
PeftModel's `load_adapter` applies the one it finds: that is how every checkpoint folder Trainer
writes for `Trainer(model=cm.model)` carries the map, and how resuming restores it. Both are
instance-level overrides, removed by `disable()`. `Trainer(model=cm)` needs `RematTrainer`
(`remat.integrations.trainer`), which hands Trainer `cm.model` while it saves and loads.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from .config import CONFIG_NAME, CheckpointConfig
from .install import InstancePatches
from .saving import read_json_object, write_json_atomically

if TYPE_CHECKING:
    from torch import nn

    from .model import CheckpointedModel

logger = logging.getLogger("remat")
_PEFT_PREFIX = "base_model.model."


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _plain_name(name: str) -> str:
    """A layer name without PEFT's wrapper prefix, so a save from a PeftModel matches its base."""
    return name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name


def config_payload(cm: CheckpointedModel) -> str:
    payload = json.loads(cm._config.to_json_string())
    payload["layers"] = [plan.name for plan in cm.checkpoint_map]
    return json.dumps(payload, indent=2, sort_keys=True) + "\n"


def save_checkpointed_model(cm: CheckpointedModel, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    target = os.path.abspath(os.fspath(save_directory))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    try:
        if _is_peft_model(cm.model):
            _original(cm.model, "save_pretrained")(staging, **kwargs)
        write_json_atomically(os.path.join(staging, CONFIG_NAME), config_payload(cm))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if os.path.exists(target):
        old = tempfile.mkdtemp(prefix=f"{os.path.basename(target)}.old-", dir=parent)
        os.rmdir(old)
        os.rename(target, old)
    os.rename(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _recover(path: str) -> str:
    if os.path.exists(path):
        return path
    leftovers = sorted(glob.glob(f"{path}.old-*"))
    if len(leftovers) == 1:
        logger.warning("%s is missing but an interrupted save left %s: loading that", path, leftovers[0])
        return leftovers[0]
    raise FileNotFoundError(f"no saved CheckpointedModel at {path}")


def read_saved(path: str) -> tuple[CheckpointConfig, list[str] | None, str]:
    file = os.path.join(path, CONFIG_NAME)
    data = read_json_object(file)
    layers = data.get("layers")
    if layers is not None and not (isinstance(layers, list) and all(isinstance(n, str) for n in layers)):
        raise ValueError(f"{file}: 'layers' must be a list of layer names")
    return CheckpointConfig.from_dict(data, source=file), layers, file


def check_layers_match(saved: list[str] | None, current: list[str], file: str) -> None:
    if saved is None:
        return
    if [_plain_name(n) for n in saved] != [_plain_name(n) for n in current]:
        raise ValueError(
            f"{file} was planned for {len(saved)} layers ({_summary(saved)}), but this model has {len(current)} "
            f"({_summary(current)}); load it into the model it was saved from"
        )


def _summary(names: list[str]) -> str:
    shown = [_plain_name(n) for n in names[:2]]
    return ", ".join(shown) + (", ..." if len(names) > 2 else "")


def load_checkpointed_model(
    cls: type[CheckpointedModel], model: nn.Module, path: str | os.PathLike, *, is_trainable: bool, **kwargs: Any
) -> CheckpointedModel:
    from .layers import discover_layers

    folder = _recover(os.path.abspath(os.fspath(path)))
    config, saved_layers, file = read_saved(folder)
    own = ("offload_transport", "swap_mover", "layer_class", "offload_host_budget")
    wrapper_kwargs = {k: kwargs.pop(k) for k in own if k in kwargs}
    # Refuse a mismatch before anything changes: PEFT's loading would already modify the model.
    check_layers_match(saved_layers, discover_layers(model, wrapper_kwargs.get("layer_class")).names, file)
    if os.path.exists(os.path.join(folder, "adapter_config.json")) and not _is_peft_model(model):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, folder, is_trainable=is_trainable, **kwargs)
    cm = cls(model, config, **wrapper_kwargs)
    if is_trainable:
        cm.for_training()
    else:
        cm.for_inference()
    return cm


# -- instance overrides while wrapped ----------------------------------------------------------


def _original(model: Any, name: str) -> Any:
    """The method as the class defines it, even while remat's override sits on the instance."""
    return getattr(type(model), name).__get__(model)


class SaveLoadOverrides:
    """`save_pretrained` (and a PeftModel's `load_adapter`) on the wrapped model's instance."""

    def __init__(self, cm: CheckpointedModel):
        self.cm = cm
        self._patches = InstancePatches()

    def install(self, model: Any) -> None:
        cm = self.cm

        def save_pretrained(save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
            result = _original(model, "save_pretrained")(save_directory, *args, **kwargs)
            if kwargs.get("is_main_process", True):
                os.makedirs(save_directory, exist_ok=True)
                write_json_atomically(os.path.join(save_directory, CONFIG_NAME), config_payload(cm))
            return result

        self._patches.set(model, "save_pretrained", save_pretrained)
        if _is_peft_model(model):

            def load_adapter(model_id: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
                result = _original(model, "load_adapter")(model_id, *args, **kwargs)
                folder = os.fspath(model_id)
                if os.path.isfile(os.path.join(folder, CONFIG_NAME)):
                    config, layers, file = read_saved(folder)
                    check_layers_match(layers, [p.name for p in cm.checkpoint_map], file)
                    cm._adopt_saved_config(config, f"load_adapter({folder})")
                return result

            self._patches.set(model, "load_adapter", load_adapter)

    def uninstall(self) -> None:
        self._patches.undo()
