"""Saving and loading a `CheckpointedModel`: the adapters exactly as PEFT writes them, plus
`checkpoint_config.json` (the config, the layers it was planned for, the architecture, and the
fingerprints of every file PEFT reads to rebuild each adapter). This joins, for the wrapper,
the folder transaction (`remat.saving`) with the files beside this one: the format
(`pair_format`), PEFT's names (`peft_names`), PEFT loading (`peft_loading`) and its rollback
(`rollback`), and the model's own save/load while wrapped (`overrides`).

`save_checkpointed_model(owner, folder)` writes its files into `folder` and touches nothing
else there; a crash at any moment leaves the previous save or the new one; saves from several
processes commit one after another, the last one whole. `load_checkpointed_model` reads one
whole save and checks it (architecture, layers, layer indices, fingerprints, the wrapper's
arguments, the structure of adapters the model already has) before anything changes, then
PEFT reads those same files in place while the folder's shared lock keeps commits out; what PEFT
itself does while loading is undone if it fails halfway, or if wrapping fails after it.

`owner` is what the wrapper hands down (its controller: `.model`, `.config`,
`.checkpoint_map`); the class to build is handed in by `CheckpointedModel.from_pretrained`.
Nothing here imports the wrapper.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch import nn

from ..arguments import WrapperOptions
from ..config import CheckpointConfig
from ..errors import ConfigError, FolderChangedError, NotSavedError
from .overrides import SaveLoadOverrides
from .pair_format import Expected, PairOwner, expected_for, read_model_pair, save_model_pair
from .peft_loading import check_loadable_into, check_trainable_load, load_adapters
from .peft_names import is_peft_model, original_method
from .rollback import ModelChanges

logger = logging.getLogger("remat")

_READ_AGAIN = 10  # loads of a folder this process cannot lock: how often a commit during PEFT's read is retried

__all__ = ["SaveLoadOverrides", "apply_saved_config", "load_checkpointed_model", "save_checkpointed_model"]


def _adapter_layers(model: nn.Module) -> list[str]:
    """PEFT layers inside a model that is not a PeftModel (PEFT applied after wrapping)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def save_checkpointed_model(owner: PairOwner, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    if os.fspath(save_directory) == "":
        raise ConfigError("save_pretrained needs a folder, got an empty path; pass '.' for the current directory")
    if not kwargs.get("is_main_process", True):
        return  # the main process writes the save; the others write nothing
    model = owner.model
    peft = is_peft_model(model)
    stray = [] if peft else _adapter_layers(model)
    if stray:
        raise ConfigError(
            f"cm.model has PEFT adapter layers ({stray[0]}, ...) but is not a PeftModel, so there is no PEFT "
            "model to save them with and they would be lost. Wrap the PeftModel instead: "
            "peft_model = get_peft_model(model, lora_config); cm = CheckpointedModel(peft_model). Nothing was saved."
        )
    target = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(target):
        raise ConfigError(f"save_pretrained needs a folder, but {target} is a file: pass a folder")

    def write(staging: str) -> None:
        if peft:
            original_method(model, "save_pretrained")(staging, **kwargs)

    committed = save_model_pair(owner, target, write, selected=kwargs.get("selected_adapters"))
    if peft and "README.md" not in committed:
        logger.info("%s already has a README.md: kept it, PEFT's model card was not written", target)


def load_checkpointed_model(
    cls: Any, model: nn.Module, path: str | os.PathLike, *, is_trainable: bool, **kwargs: Any
) -> Any:
    """`cls.from_pretrained`: `cls` is the wrapper class (handed in, so nothing here imports it)."""
    folder = os.path.abspath(os.fspath(path))
    if not os.path.isdir(folder):
        raise NotSavedError(f"no saved CheckpointedModel at {folder}; save one with cm.save_pretrained(folder)")
    options = WrapperOptions.taken_from(kwargs)
    # Every check that needs no change comes first: PEFT's loading changes the model. The layers
    # are found once, planned once; again only in the PeftModel PEFT builds around a base model
    # (its layers, with any its tuner adds), whose swap is checked after PEFT froze the weights.
    discovery = cls._discover(model, options)
    base = model
    for attempt in range(1, _READ_AGAIN + 1):
        with read_model_pair(folder, Expected.of(base, discovery.names)) as loaded:
            fresh = bool(loaded.adapters) and not is_peft_model(base)
            checkpoint_map = None if fresh else cls._plan(base, discovery, loaded.saved.config)
            if is_peft_model(base):
                check_loadable_into(base, loaded)
            check_trainable_load(base, loaded, is_trainable)
            undo = ModelChanges(base)
            try:
                model = base
                if loaded.adapters:
                    model = load_adapters(base, loaded, is_trainable, kwargs)
                    loaded.snapshot.unchanged()  # PEFT read the files checked (FolderChangedError: undone)
                found = discovery
                if fresh:
                    found = cls._discover(model, options)
                    Expected.of(model, found.names).check(loaded.saved)
                    checkpoint_map = cls._plan(model, found, loaded.saved.config)
                cm = cls(model, loaded.saved.config, **vars(options), _prepared=(found, checkpoint_map))
            except FolderChangedError:
                undo.revert()
                if loaded.snapshot.locked or attempt == _READ_AGAIN:
                    raise
                loaded.snapshot.close()  # a folder read without its lock: a commit came in; read again
                continue
            except BaseException:
                undo.revert()
                raise
        break
    return cm.for_training() if is_trainable else cm.for_inference()


def apply_saved_config(owner: Any, folder: str, cause: str) -> CheckpointConfig:
    """Read and check the pair in `folder` for `owner`'s model, then apply its config (Trainer
    resume, best model at the end). Returns the config applied."""
    with read_model_pair(folder, expected_for(owner)) as loaded:
        config = loaded.saved.config
    owner.adopt_saved_config(config, f"{cause} from {folder}")
    return config
