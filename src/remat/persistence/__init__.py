"""Saving and loading a `CheckpointedModel`: PEFT's adapters plus `checkpoint_config.json`, through the
folder transaction (`remat.saving`). A load checks the whole save before anything changes; what PEFT
then does is undone if it or wrapping fails. The model's own `save_pretrained` and `load_adapter` go
the same way."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from torch import nn
from transformers import PreTrainedModel

from ..arguments import WrapperOptions, check_flag
from ..config import CheckpointConfig
from ..errors import ConfigError, ConfigTypeError, FolderChangedError, NotSavedError
from ..refs import InstancePatches
from ..saving.folder import CONFIG_NAME, is_staging, recover, save_folder
from .pair_format import Expected, PairOwner, is_peft_model, original_method, read_model_pair, save_model_pair
from .peft_loading import check_peft_load, load_adapters, refuse_dropped, undone_on_failure

logger = logging.getLogger("remat")

_READ_AGAIN = 10  # loads of a folder this process cannot lock: how often a commit during PEFT's read is retried
_HUB_ID = re.compile(r"[\w-][\w.-]*/[\w-][\w.-]*")  # "owner/name", as the Hub names repos

__all__ = [
    "SaveLoadOverrides",
    "apply_saved_config",
    "is_mixed_peft_model",
    "load_checkpointed_model",
    "resume_undone_on_failure",
    "save_checkpointed_model",
    "stray_adapter_layers",
]


def is_mixed_peft_model(model: nn.Module) -> bool:
    """PEFT's `PeftMixedModel` (`get_peft_model(..., mixed=True)`): adapters PEFT applied, which it cannot save."""
    from peft import PeftMixedModel

    return isinstance(model, PeftMixedModel)


def stray_adapter_layers(within: nn.Module, model: nn.Module) -> list[str]:
    """The PEFT adapter layers `within` a `model` that is not a PeftModel (PEFT applied around it after wrapping, or
    transformers' own `add_adapter`): no PEFT model of the wrapper's saves them."""
    if is_peft_model(model):
        return []
    return [name for name, module in within.named_modules() if isinstance(module, BaseTunerLayer)]


def save_checkpointed_model(owner: PairOwner, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    model = owner.model
    peft = is_peft_model(model)
    # a full model's own save (transformers'): what `cm.model.save_pretrained` writes; accelerate's no-Trainer save,
    # `unwrap_model(model).save_pretrained(...)`, wrote the config alone here, the weights silently nowhere
    own = not peft and isinstance(model, PreTrainedModel)
    saver = PreTrainedModel if own else PeftModel
    known = ["state_dict", *list(inspect.signature(saver.save_pretrained).parameters)[2:-1]]
    _refuse_misspelt(kwargs, known, peft="transformers' save" if own else "PEFT's save")
    refuse_push_to_hub(kwargs)
    target = save_folder(save_directory)
    if not kwargs.get("is_main_process", True):
        return  # the main process writes the save; the others write nothing
    if is_mixed_peft_model(model):
        raise ConfigError(
            "cm.model is a PeftMixedModel (get_peft_model(..., mixed=True)), which PEFT cannot save "
            "(NotImplementedError in its own save_pretrained), so its adapters would be lost. Train one adapter type "
            "in a PeftModel to save it with remat. Nothing was saved."
        )
    if stray := stray_adapter_layers(model, model):
        raise ConfigError(
            f"cm.model has PEFT adapter layers ({stray[0]}, ...) but is not a PeftModel, so there is no PEFT "
            "model to save them with and they would be lost. Wrap the PeftModel instead: peft_model = "
            "get_peft_model(model, lora_config); cm = CheckpointedModel(peft_model). Nothing was saved."
        )
    if kwargs.get("state_dict") is not None:
        given, selected = kwargs["state_dict"], kwargs.get("selected_adapters")
        kwargs["state_dict"] = (  # a full model's: the wrapper's names would be saved as unknown weights
            _from_under_wrapper(given, model.state_dict().keys())
            if own
            else _adapters_state_dict(model, given, selected)
        )

    def write(staging: str) -> None:
        if peft or own:  # else (a model with no save of its own) the config alone
            original_method(model, "save_pretrained")(staging, **kwargs)

    committed = save_model_pair(owner, target, write, selected=kwargs.get("selected_adapters"))
    if peft and "README.md" not in committed:
        logger.info("%s already has a README.md: kept it, PEFT's model card was not written", target)


def _from_under_wrapper(given: Any, own: Any) -> Any:
    """A state dict named as the wrapper names it (`cm.state_dict()`: under `model.`) named as the model does."""
    if given and not own & given.keys() and all(key.startswith("model.") for key in given):
        return {key.removeprefix("model."): value for key, value in given.items()}
    return given


def _adapters_state_dict(model: nn.Module, given: Any, selected: Any) -> dict[str, Any]:
    """A `state_dict=` for PEFT's save. The wrapper's own (`cm.state_dict()`, accelerate's `get_state_dict(cm)`) has
    its names under `model.`, where PEFT found no adapter and wrote an empty file: taken from under it. One that still
    holds none of an adapter's weights, or given for a model without PEFT (whose save is the config alone), would
    write nothing of what it holds: refused, before anything is written. (Names PEFT does not know, and a model
    whose adapters hold no weight any more, are left to the checks after this one.)"""
    if not is_peft_model(model):
        raise ConfigError(
            f"save_pretrained(state_dict=...): cm.model is a {type(model).__name__}, with no save of its own, so remat "
            "saves checkpoint_config.json alone and the weights would not be written: save them yourself. Nothing was "
            "saved."
        )
    own = dict(model.named_parameters(remove_duplicate=False))
    given = _from_under_wrapper(given, own.keys())
    names = list(model.peft_config) if selected is None else selected if isinstance(selected, list) else []
    empty = " (it is empty: an FSDP full state dict is empty off rank 0; pass is_main_process=...)"
    for name in [name for name in names if name in model.peft_config]:
        saved = functools.partial(get_peft_model_state_dict, model, adapter_name=name, save_embedding_layers=False)
        if saved() and not saved(state_dict=given):
            raise ConfigError(
                f"save_pretrained(state_dict=...): the state dict holds none of adapter {name!r}'s weights (its "
                f"names are those of cm.model, e.g. {next(iter(own))!r}), so PEFT would write an empty adapter. "
                f"Pass cm.model's state dict, or none{'' if given else empty}. Nothing was saved."
            )
    return given


def _refuse_keywords_peft_would_drop(kwargs: dict[str, Any]) -> None:
    """The keywords `from_pretrained` hands PEFT (the wrapper's own options aside): PEFT ignored a config field or a
    misspelt `is_trainable` without a word, and answered `adapter_name=` with its own internal error."""
    fields = [field.name for field in dataclasses.fields(CheckpointConfig)]
    own_config = isinstance(kwargs.get("config"), CheckpointConfig)  # (a PeftConfig is PEFT's to take)
    if given := sorted(set(kwargs) & {*fields, *(["config"] if own_config else [])}):
        then = "cm.enable(config)" if given[0] == "config" else f"cm.enable({given[0]}=...)"
        raise ConfigTypeError(
            f"from_pretrained loads the checkpoint config saved in the folder, so {given[0]}= would be ignored; "
            f"change it after loading: cm = CheckpointedModel.from_pretrained(model, folder); {then}"
        )
    if "adapter_name" in kwargs:
        raise ConfigTypeError(
            "from_pretrained loads every adapter of the save under the name it was saved with; adapter_name= is for "
            "one adapter: cm.model.load_adapter(folder, adapter_name=...) loads a save's adapter under another name"
        )
    _refuse_misspelt(kwargs, [*fields, *WrapperOptions.names(), "is_trainable"], "from_pretrained", "PEFT's loading")


def _refuse_misspelt(
    kwargs: dict[str, Any], known: list[str], call: str = "save_pretrained", peft: str = "PEFT's save"
) -> None:
    """A keyword one letter or two from a `known` one is a typo: PEFT and transformers take any keyword and ignore
    those they do not read, so `safe_serilization=False` would save safetensors without a word."""
    for key in kwargs:
        if key not in known and (close := difflib.get_close_matches(key, known, n=1, cutoff=0.8)):
            raise ConfigTypeError(
                f"{call} got the keyword {key!r}: did you mean {close[0]!r}? (other keywords go to {peft}, which "
                "would ignore it); nothing was changed"
            )


def load_checkpointed_model(
    cls: Any, model: nn.Module, path: str | os.PathLike, *, is_trainable: bool, **kwargs: Any
) -> Any:
    """`cls.from_pretrained`: `cls` is the wrapper class (handed in, so nothing here imports it)."""
    check_flag(is_trainable, "from_pretrained's is_trainable")
    folder = _saved_folder(cls, model, path)
    _refuse_keywords_peft_would_drop(kwargs)
    options = WrapperOptions.taken_from(kwargs)
    # Every check comes before PEFT's loading changes the model. Layers are found and planned again only
    # in the PeftModel PEFT builds around a base model (its tuner may add layers; PEFT froze the weights).
    discovery = cls._discover(model, options)
    for attempt in range(1, _READ_AGAIN + 1):
        with read_model_pair(folder, Expected.of(model, discovery.names)) as loaded:
            fresh = bool(loaded.adapters) and not is_peft_model(model)
            checkpoint_map = None if fresh else cls._plan(model, discovery, loaded.saved.config)
            check_peft_load(model, loaded, is_trainable)
            try:
                with undone_on_failure(model):
                    built, found = model, discovery
                    if loaded.adapters:
                        built = load_adapters(model, loaded, is_trainable, kwargs)
                        loaded.snapshot.unchanged()  # PEFT read the files checked (a FolderChangedError is undone)
                    if fresh:
                        found = cls._discover(built, options)
                        Expected.of(built, found.names).check(loaded.saved)
                        checkpoint_map = cls._plan(built, found, loaded.saved.config)
                    cm = cls(built, loaded.saved.config, **vars(options), _prepared=(found, checkpoint_map))
                    try:  # a Ctrl-C here left the adapters and the install in the model, with no wrapper returned
                        cm._controller.budget.take_saved(loaded.saved.budget_profile, loaded.saved.file)
                        if is_trainable:
                            cm.for_training()
                        else:
                            cm.for_inference()
                    except BaseException:
                        cm._controller.disable(cause="a refused load", say=False)
                        raise
            except FolderChangedError:
                if loaded.snapshot.locked or attempt == _READ_AGAIN:
                    raise
                loaded.snapshot.close()  # a folder read without its lock: a commit came in; read again
                continue
        break
    return cm


def _saved_folder(cls: Any, model: Any, path: Any) -> str:
    """The folder `from_pretrained(model, path)` reads, or what to pass instead: remat reads a local folder and never
    downloads, so a Hub id gets the download, the config file its folder, a wrapper the calls that load into one."""
    if not isinstance(path, (str, os.PathLike)):
        swapped = isinstance(model, (str, os.PathLike)) and isinstance(path, nn.Module)
        raise ConfigTypeError(
            f"from_pretrained(model, folder): folder must be a str or os.PathLike, got {type(path).__name__}"
            + (f" (the arguments are swapped: from_pretrained(model, {os.fspath(model)!r}))" if swapped else "")
        )
    if isinstance(model, cls):
        # (transformers' own load_adapter, on a model without PEFT, adds layers that remat refuses to save)
        into = "cm.model.load_adapter(folder, adapter_name=...) loads its adapter into it, or "
        into = into if is_peft_model(model.model) else ""
        raise ConfigTypeError(
            f"from_pretrained(model, folder): this model is already a CheckpointedModel; {into}cm.disable(), then "
            "CheckpointedModel.from_pretrained(cm.model, folder) wraps its model again with the saved config"
        )
    folder, given = os.path.abspath(os.fspath(path)), os.fspath(path)
    if os.path.isfile(folder):
        holder = os.path.dirname(given) or "."
        raise NotSavedError(
            f"from_pretrained reads a folder, but {folder} is a file: pass the folder holding it, {holder!r}"
        )
    if not os.path.isdir(folder):
        fix = "pass the folder cm.save_pretrained(folder) wrote"
        if _HUB_ID.fullmatch(given) and not os.path.lexists(given.split("/")[0]):  # not a local folder mistyped
            fix = f"download a Hub repo first: from_pretrained(model, huggingface_hub.snapshot_download({given!r}))"
        raise NotSavedError(f"no saved CheckpointedModel at {folder}: from_pretrained reads a local folder; {fix}")
    return folder


def apply_saved_config(owner: Any, folder: str, cause: str) -> None:
    """Check the pair in `folder` for `owner`'s model, then apply its config (Trainer's resume, best model)."""
    with read_model_pair(folder, Expected.for_owner(owner)) as loaded:
        saved = loaded.saved
    owner.budget.take_saved(saved.budget_profile, saved.file)
    owner.adopt_saved_config(saved.config, f"{cause} from {folder}")


@contextlib.contextmanager
def resume_undone_on_failure(owner: Any) -> Iterator[None]:
    """Trainer resumes a checkpoint's adapters one `load_adapter` at a time, the first applying the saved config:
    when a later one is refused (or PEFT fails), the adapters loaded before it, the config and the saved budget
    profile are put back too, so a refused resume leaves the wrapper as it was."""
    config, off_by, budget = owner.config, owner.off_by, owner.budget
    kept = (budget.saved, budget.config, dict(budget.plans), budget.active, budget.active_bucket)
    try:
        with undone_on_failure(owner.model):
            yield
    except BaseException:
        budget.saved, budget.config, plans, budget.active, budget.active_bucket = kept
        budget.plans.clear()
        budget.plans.update(plans)  # the current bucket's plan: the map comes back as it was, not pending
        if (owner.config, owner.off_by) != (config, off_by):
            owner.replan(config, off_by, "a refused resume", said=True)
            logger.warning(
                "the resume was refused: the saved config is not applied, the map is back to %r", owner.checkpoint_map
            )
        raise


def refuse_push_to_hub(kwargs: dict[str, Any]) -> None:
    """A save is staged in a folder of its own, then committed: pushed from there, transformers named the repository
    after the staging folder, or uploaded it without `checkpoint_config.json`."""
    if kwargs.get("push_to_hub"):
        raise ConfigTypeError(
            "save_pretrained(push_to_hub=True) while wrapped would upload remat's staging folder, not the save: save, "
            "then upload the folder (huggingface_hub.upload_folder(folder_path=folder, repo_id=...)); nothing was saved"
        )


def _save_with_config(owner: Any, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
    """The model's own save and `checkpoint_config.json`, committed as one; as is inside a save
    that already stages (a Trainer checkpoint) or on a process that is not the main one."""
    refuse_push_to_hub(kwargs)
    save = original_method(owner.model, "save_pretrained")
    if not kwargs.get("is_main_process", True) or is_staging(save_directory):
        return save(save_directory, *args, **kwargs)
    results = []
    write = lambda staging: results.append(save(staging, *args, **kwargs))
    save_model_pair(owner, save_directory, write, selected=kwargs.get("selected_adapters"))
    return results[0]


class _LoadAdapterWithConfig:
    """The pair checked before PEFT loads anything, then the saved config applied. `loaded_from`
    tells Trainer support which folder it just applied, `main_loaded_from` the folders whose top adapter it loaded."""

    def __init__(self, owner: Any):
        self.owner = owner
        self.loaded_from: str | None = None
        self.main_loaded_from: set[str] = set()

    def __call__(self, model_id: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        folder, model = os.fspath(model_id), self.owner.model
        load = original_method(model, "load_adapter")
        self.loaded_from = None
        parent, name = os.path.split(os.path.normpath(folder))
        beside = not kwargs.get("subfolder") and not os.path.isfile(os.path.join(folder, CONFIG_NAME))
        if beside and name and os.path.isfile(os.path.join(parent, CONFIG_NAME)):
            # Trainer's resume loads a second adapter from its folder inside the save: loaded as the save's, checked
            folder, model_id, kwargs = parent, parent, {**kwargs, "subfolder": name}
        recover(folder)  # a first save that crashed mid-commit may not have its config in place yet
        if not os.path.isfile(os.path.join(folder, CONFIG_NAME)):
            with undone_on_failure(model):  # not a remat save; PEFT failing halfway is undone all the same
                result = load(model_id, *args, **kwargs)
            if not kwargs.get("subfolder"):
                self.main_loaded_from.add(os.path.abspath(folder))
            return result
        adapter = args[0] if args else kwargs.get("adapter_name")
        trainable = args[1] if len(args) > 1 else kwargs.get("is_trainable", False)
        restores = bool(trainable) or adapter in getattr(model, "peft_config", {})  # a resume, the best model
        expected = dataclasses.replace(Expected.for_owner(self.owner), map_taken=restores)
        with read_model_pair(folder, expected) as loaded:
            wanted = os.path.normpath(kwargs.get("subfolder") or "")
            wanted = "" if wanted == "." else wanted
            if loaded.saved.adapters is not None and wanted not in {a.folder for a in loaded.adapters}:
                raise ConfigError(
                    f"{loaded.saved.file} names no adapter in {os.path.join(folder, wanted)}; load one of "
                    f"{sorted(a.name for a in loaded.adapters)} from the folder they were saved in. Nothing was loaded"
                )
            if isinstance(adapter, str) and (chosen := [a for a in loaded.adapters if a.folder == wanted]):
                # into an adapter whose weights have other names or shapes PEFT would load nothing, and say so only
                # in the keys it returns (Trainer's resume then trained the untrained adapter); its other settings
                # (dropout) may differ, as PEFT allows
                one = dataclasses.replace(loaded, adapters=[dataclasses.replace(chosen[0], name=adapter)])
                check_peft_load(model, one, bool(trainable), settings=False)
            with undone_on_failure(model):
                result = load(loaded.snapshot.folder, *args, **kwargs)
                if isinstance(adapter, str) and chosen:
                    refuse_dropped(model, adapter, loaded.snapshot.path(chosen[0].file()))
                loaded.snapshot.unchanged()  # PEFT read the files checked (a `FolderChangedError` is undone)
        if wanted == "":
            self.main_loaded_from.add(os.path.abspath(folder))
        if not restores:  # a frozen adapter beside the one training (TRL's DPO reference): its map was another run's
            logger.info(
                "load_adapter(%s): adapter %r loaded frozen beside those training; the map trains them, so the map "
                "saved with it is not taken (load it with is_trainable=True, or into an adapter the model has, to "
                "take it)",
                folder,
                adapter,
            )
            return result
        self.loaded_from = os.path.abspath(folder)  # its map applied (a resume of this folder need not again)
        self.owner.budget.take_saved(loaded.saved.budget_profile, loaded.saved.file)
        self.owner.adopt_saved_config(loaded.saved.config, f"load_adapter({folder})")
        return result


class SaveLoadOverrides(InstancePatches):
    """The model's own `save_pretrained` and (a PeftModel's) `load_adapter`, overridden on the instance."""

    def install(self, owner: Any, model: Any) -> None:
        self.set(model, "save_pretrained", functools.partial(_save_with_config, owner))
        if is_peft_model(model):
            self.set(model, "load_adapter", _LoadAdapterWithConfig(owner))

    uninstall = InstancePatches.undo
