"""The wrapped model's own `save_pretrained` and (for a PeftModel) `load_adapter`, which Trainer
calls to checkpoint and resume: instance overrides (removed by `disable()`) through the same
save and load as `cm.save_pretrained` / `CheckpointedModel.from_pretrained`. `owner` is the
controller behind the wrapper.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError
from ..refs import InstancePatches
from ..saving.folder import CONFIG_NAME, is_staging, recover
from .pair_format import expected_for, read_model_pair, save_model_pair
from .peft_names import is_peft_model, original_method
from .rollback import ModelChanges


class _SaveWithConfig:
    """The model's own save and `checkpoint_config.json`, committed as one; as is inside a save
    that already stages (a Trainer checkpoint) or on a process that is not the main one."""

    def __init__(self, owner: Any):
        self.owner = owner

    def __call__(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        save = original_method(self.owner.model, "save_pretrained")
        if not kwargs.get("is_main_process", True) or is_staging(save_directory):
            return save(save_directory, *args, **kwargs)
        results = []
        save_model_pair(
            self.owner,
            save_directory,
            lambda staging: results.append(save(staging, *args, **kwargs)),
            selected=kwargs.get("selected_adapters"),
        )
        return results[0]


class _LoadAdapterWithConfig:
    """The pair checked before PEFT loads anything, then the saved config applied. `loaded_from`
    tells Trainer support which folder it just applied."""

    def __init__(self, owner: Any):
        self.owner = owner
        self.loaded_from: str | None = None

    def __call__(self, model_id: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        folder = os.fspath(model_id)
        model = self.owner.model
        load = original_method(model, "load_adapter")
        self.loaded_from = None
        recover(folder)  # a first save that crashed mid-commit may not have its config in place yet
        if not os.path.isfile(os.path.join(folder, CONFIG_NAME)):
            return _undone_if_it_fails(model, lambda: load(model_id, *args, **kwargs))  # not a remat save
        with read_model_pair(folder, expected_for(self.owner)) as loaded:
            wanted = os.path.normpath(kwargs.get("subfolder") or "")
            wanted = "" if wanted == "." else wanted
            if loaded.saved.adapters is not None and wanted not in {a.folder for a in loaded.adapters}:
                raise ConfigError(
                    f"{loaded.saved.file} names no adapter in {os.path.join(folder, wanted)}; load one of "
                    f"{sorted(a.name for a in loaded.adapters)} from the folder they were saved in. Nothing was loaded"
                )
            result = _undone_if_it_fails(model, lambda: _load_checked(loaded, load, args, kwargs))
        self.loaded_from = os.path.abspath(folder)
        self.owner.adopt_saved_config(loaded.saved.config, f"load_adapter({folder})")
        return result


def _load_checked(loaded: Any, load: Any, args: tuple, kwargs: dict) -> Any:
    """PEFT's load, then a check that no file changed meanwhile (a `FolderChangedError` is undone)."""
    result = load(loaded.snapshot.folder, *args, **kwargs)
    loaded.snapshot.unchanged()
    return result


def _undone_if_it_fails(model: Any, load: Any) -> Any:
    undo = ModelChanges(model)
    try:
        return load()
    except BaseException:
        undo.revert()  # PEFT failed halfway (a half-added adapter): the model is as it was
        raise


class SaveLoadOverrides:
    def __init__(self) -> None:
        self._patches = InstancePatches()

    def install(self, owner: Any, model: Any) -> None:
        self._patches.set(model, "save_pretrained", _SaveWithConfig(owner))
        if is_peft_model(model):
            self._patches.set(model, "load_adapter", _LoadAdapterWithConfig(owner))

    def uninstall(self) -> None:
        self._patches.undo()
