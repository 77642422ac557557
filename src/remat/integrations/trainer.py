"""Trainer support for `Trainer(model=cm)`: checkpoints hold what `cm.save_pretrained` holds.

transformers' Trainer decides how to save and resume by `isinstance(model, (PreTrainedModel,
PeftModel))`. A `CheckpointedModel` is neither, so a plain `transformers.Trainer(model=cm)`
saves `cm.state_dict()` whole (base weights included, under `model.`-prefixed names) and
resumes by loading it back; it never sees `checkpoint_config.json`. Nothing on the model can
change that without patching Trainer's class, which remat does not do.

`RematTrainerMixin` closes the gap for the Trainer it is mixed into: while Trainer saves,
resumes or loads its best model, it hands Trainer the wrapped model (`cm.model`), so
Trainer's own PEFT/PreTrainedModel paths run unchanged: adapters only for a PeftModel, full
weights for a plain model, and `checkpoint_config.json` beside them in every checkpoint folder.
Resuming applies the saved config to the map (the layer names must match). `RematTrainer` is
the mixin over `transformers.Trainer`; `remat_trainer_class(SFTTrainer)` builds one for any
Trainer subclass (TRL's trainers, your own).

`Trainer(model=cm.model)` needs none of this: while wrapped, the model's `save_pretrained`
writes the config and a PeftModel's `load_adapter` applies it (see `remat.persistence`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Any

import safetensors
import torch
from transformers import Trainer
from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from ..config import CONFIG_NAME
from ..model import CheckpointedModel
from ..persistence import adapters_to_load, check_layers_match, read_saved, write_config_beside

logger = logging.getLogger("remat")
_WRAPPER_PREFIX = "model."

__all__ = ["RematTrainer", "RematTrainerMixin", "remat_trainer_class"]


class RematTrainerMixin:
    """Mix in before a `transformers.Trainer` (sub)class: `class T(RematTrainerMixin, SFTTrainer)`.

    Only the model Trainer saves and loads changes, and only while `self.model` is a
    `CheckpointedModel`; any other model goes through the base class untouched.
    """

    model: Any

    def _remat_model(self) -> CheckpointedModel | None:
        """The CheckpointedModel Trainer saves and loads, or None where the mixin steps aside."""
        cm = self.model if isinstance(self.model, CheckpointedModel) else None
        if cm is not None and (getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False)):
            # FSDP and DeepSpeed save and reload the model Trainer prepared (the wrapper) through
            # their own checkpoint code, around `_save`: swapping in `cm.model` here would leave
            # those files and `_save`'s under different names.
            if not getattr(self, "_remat_said_steps_aside", False):
                self._remat_said_steps_aside = True
                logger.warning(
                    "RematTrainer under FSDP/DeepSpeed saves like transformers' Trainer: the wrapper's "
                    "full state, no %s; for adapter checkpoints with the map, pass cm.model to Trainer",
                    CONFIG_NAME,
                )
            return None
        return cm

    @contextlib.contextmanager
    def _remat_wrapped_model(self) -> Iterator[CheckpointedModel | None]:
        """`self.model` is the wrapped model for the duration (Trainer's save/load code reads
        `self.model` in several places, so handing it an argument would not be enough)."""
        cm = self._remat_model()
        if cm is None:
            yield None
            return
        self.model = cm.model
        try:
            yield cm
        finally:
            self.model = cm

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        with self._remat_wrapped_model() as cm:
            if cm is None:
                return super()._save(output_dir, state_dict=state_dict)  # type: ignore[misc]
            # DeepSpeed / FSDP hand over `cm.state_dict()`: names relative to the wrapped model.
            if state_dict is not None:
                state_dict = {_relative(key): value for key, value in state_dict.items()}
            super()._save(output_dir, state_dict=state_dict)  # type: ignore[misc]
        if getattr(self.args, "should_save", True):  # type: ignore[attr-defined]
            folder = output_dir if output_dir is not None else self.args.output_dir  # type: ignore[attr-defined]
            # Written here too: the model's own save_pretrained skips it while remat is disabled.
            write_config_beside(cm, folder)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        cm = self._remat_model()
        if cm is None or (model is not None and model is not cm):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        if _saved_whole(cm, resume_from_checkpoint):
            logger.info(
                "%s holds the whole wrapper (written by transformers' Trainer(model=cm)): loading it as is",
                resume_from_checkpoint,
            )
            super()._load_from_checkpoint(resume_from_checkpoint, cm)  # type: ignore[misc]
        else:
            with self._remat_wrapped_model():
                super()._load_from_checkpoint(resume_from_checkpoint, cm.model)  # type: ignore[misc]
        _apply_saved_config(cm, resume_from_checkpoint, "resuming")

    def _load_best_model(self) -> None:
        cm = self._remat_model()
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        if cm is not None and best is not None and _saved_whole(cm, best):
            super()._load_best_model()  # type: ignore[misc]  # a folder of a plain Trainer(model=cm)
        else:
            with self._remat_wrapped_model():
                super()._load_best_model()  # type: ignore[misc]
        if cm is not None:
            _apply_saved_config(cm, best, "loading the best model")

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer uploads `output_dir` after copying a fixed list of model files into it from
        the checkpoint; the checkpoint config goes along, so the pushed adapters carry the map."""
        saved = os.path.join(checkpoint_folder, CONFIG_NAME)
        if self._remat_model() is not None and os.path.isfile(saved) and self._pushes_from_here():
            shutil.copy(saved, os.path.join(self.args.output_dir, CONFIG_NAME))  # type: ignore[attr-defined]
        super()._push_from_checkpoint(checkpoint_folder)  # type: ignore[misc]

    def _pushes_from_here(self) -> bool:
        """The conditions under which Trainer's own `_push_from_checkpoint` copies its files (a
        config copied while the previous upload still runs could travel with older adapters)."""
        args = self.args  # type: ignore[attr-defined]
        if not self.is_world_process_zero() or args.hub_strategy == "end":  # type: ignore[attr-defined]
            return False
        pending = getattr(self, "push_in_progress", None)
        return args.hub_always_push or pending is None or pending.is_done()


def _saved_whole(cm: CheckpointedModel, folder: str) -> bool:
    """Whether the folder's weights are `cm.state_dict()` itself (names with the wrapper's
    prefix), as transformers' Trainer writes them for `Trainer(model=cm)`. Loading those into
    `cm.model` would match no name and silently keep untrained weights."""
    names = _saved_names(folder)
    wrapped = set(cm.model.state_dict())
    return bool(names) and not names <= wrapped and names <= {_WRAPPER_PREFIX + name for name in wrapped}


def _saved_names(folder: str) -> set[str]:
    """Tensor names in the folder's single-file weights (safetensors, or a .bin written with
    `save_safetensors=False`), read without loading the tensors."""
    file = os.path.join(folder, SAFE_WEIGHTS_NAME)
    if os.path.isfile(file):
        with safetensors.safe_open(file, framework="pt") as saved:
            return set(saved.keys())
    file = os.path.join(folder, WEIGHTS_NAME)
    if os.path.isfile(file):
        return set(torch.load(file, map_location="meta", weights_only=True))
    return set()


def _relative(key: str) -> str:
    return key[len(_WRAPPER_PREFIX) :] if key.startswith(_WRAPPER_PREFIX) else key


def _apply_saved_config(cm: CheckpointedModel, folder: str | None, cause: str) -> None:
    """Apply the folder's checkpoint config, if it has one, after checking its layers."""
    if folder is None or not os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        logger.warning("%s from %s: no %s there, the current checkpoint map stays", cause, folder, CONFIG_NAME)
        return
    saved = read_saved(folder)
    check_layers_match(saved.layers, [plan.name for plan in cm.checkpoint_map], saved.file)
    adapters_to_load(saved)
    cm._state.adopt_saved_config(saved.config, f"{cause} from {folder}")


@functools.cache
def remat_trainer_class(base: type[Trainer]) -> type[Trainer]:
    """`base` with `RematTrainerMixin` in front, e.g. `remat_trainer_class(trl.SFTTrainer)`."""
    if not (isinstance(base, type) and issubclass(base, Trainer)):
        raise TypeError(f"remat_trainer_class needs a transformers.Trainer subclass, got {base!r}")
    if issubclass(base, RematTrainerMixin):
        return base
    return type(f"Remat{base.__name__}", (RematTrainerMixin, base), {"__module__": __name__})


class RematTrainer(RematTrainerMixin, Trainer):
    """`transformers.Trainer` that saves and resumes a `CheckpointedModel` like its wrapped
    model: adapters (not the full weights) plus `checkpoint_config.json` in every checkpoint."""
