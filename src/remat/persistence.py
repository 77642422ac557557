"""Saving and loading a `CheckpointedModel`: the adapters exactly as PEFT writes them, plus
`checkpoint_config.json` with the config, the layers it was planned for, and a fingerprint
(sha256) of every adapter weight file it belongs with.

`cm.save_pretrained(folder)` writes its files into `folder` and touches nothing else there;
a crash at any moment leaves the previous save or the new one (see `remat.saving`). Loading
checks the pair: adapter weights that are not the ones the config was saved with are a clear
error, not a silent mix of two saves.

Every refusal on load happens before anything changes: the layers, the fingerprints, the
wrapper's arguments and, when loading into a PeftModel that already has the adapters, their
configs and tensor shapes are checked first. What PEFT itself does while loading (inject
layers, register adapters) is undone if it fails halfway, or if wrapping fails after it.

While a model is wrapped, its own `save_pretrained` also writes `checkpoint_config.json`, and
a PeftModel's `load_adapter` applies the one it finds (after the same checks): that is how
every checkpoint folder Trainer writes for `Trainer(model=cm.model)` carries the map, and how
resuming restores it. Both are instance-level overrides, removed by `disable()`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .config import CONFIG_NAME, CheckpointConfig
from .patches import InstancePatches
from .saving import read_json_object, recover_staging, sha256_file, staged_save, write_json_atomically

if TYPE_CHECKING:
    from torch import nn

    from .model import CheckpointedModel

logger = logging.getLogger("remat")

_PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
WRAPPER_ARGUMENTS = ("offload_transport", "swap_mover", "layer_class", "offload_host_budget")
# Fields of a PEFT config that say nothing about the adapter's structure.
_PEFT_BOOKKEEPING = {"base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version"}


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _plain_name(name: str) -> str:
    """A layer name without PEFT's wrapper prefix, so a save from a PeftModel matches its base."""
    return name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name


# -- what a save holds --------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedAdapter:
    name: str
    folder: str  # relative to the save; "" for PEFT's "default" adapter
    weights: str  # file name inside `folder`
    sha256: str | None  # None for saves from before fingerprints

    def path(self, root: str, file: str | None = None) -> str:
        return os.path.join(root, self.folder, file or self.weights)


@dataclass(frozen=True)
class Saved:
    folder: str
    file: str
    config: CheckpointConfig
    layers: list[str] | None
    adapters: tuple[SavedAdapter, ...] | None  # None: the config does not say (an older save)


def read_saved(folder: str) -> Saved:
    file = os.path.join(folder, CONFIG_NAME)
    data = read_json_object(file)
    config = CheckpointConfig.from_dict(data, source=file)
    layers = data.get("layers")
    if layers is not None and not (isinstance(layers, list) and all(isinstance(n, str) for n in layers)):
        raise ValueError(f"{file}: 'layers' must be a list of layer names")
    return Saved(folder, file, config, layers, _read_adapters(data.get("adapters"), file))


def _read_adapters(value: Any, file: str) -> tuple[SavedAdapter, ...] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: 'adapters' must be an object {{adapter name: files}}")
    out = []
    for name, entry in value.items():
        ok = isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("folder", "weights", "sha256"))
        if (
            not ok
            or entry["weights"] not in ADAPTER_WEIGHTS
            or os.path.isabs(entry["folder"])
            or ".." in entry["folder"]
        ):
            raise ValueError(f"{file}: adapter {name!r} must name a folder, a weights file and its sha256")
        out.append(SavedAdapter(name, entry["folder"], entry["weights"], entry["sha256"]))
    return tuple(out)


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


def adapters_to_load(saved: Saved) -> list[SavedAdapter]:
    """The adapters this save holds, after checking each against the fingerprint in the config.
    Raises (naming the file) for weights without their `adapter_config.json` and for weights
    that are not the ones the config was saved with."""
    root_weights = [w for w in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(saved.folder, w))]
    if root_weights and not os.path.isfile(os.path.join(saved.folder, ADAPTER_CONFIG)):
        raise ValueError(
            f"{os.path.join(saved.folder, root_weights[0])} holds adapter weights but there is no {ADAPTER_CONFIG} "
            "beside it, so they cannot be loaded as PEFT adapters; restore that file (PEFT writes both)"
        )
    if saved.adapters is None:  # an older save: PEFT's default adapter, if there is one
        if not root_weights:
            return []
        return [SavedAdapter("default", "", root_weights[0], None)]
    listed = {a.path(saved.folder) for a in saved.adapters}
    unlisted = [w for w in root_weights if os.path.join(saved.folder, w) not in listed]
    if unlisted:
        logger.warning(
            "%s: %s is not one of the adapters %s was saved with; it is not loaded",
            saved.folder,
            unlisted[0],
            CONFIG_NAME,
        )
    for adapter in saved.adapters:
        weights, config = adapter.path(saved.folder), adapter.path(saved.folder, ADAPTER_CONFIG)
        preferred = adapter.path(saved.folder, ADAPTER_WEIGHTS[0])
        if adapter.weights != ADAPTER_WEIGHTS[0] and os.path.isfile(preferred):
            raise ValueError(
                f"{saved.file} was saved with {weights}, but {preferred} (from another save) is beside it and PEFT "
                f"loads that one first; remove {os.path.basename(preferred)} or save again. Nothing was loaded"
            )
        for needed in (weights, config):
            if not os.path.isfile(needed):
                raise FileNotFoundError(f"{saved.file} names adapter {adapter.name!r}, but {needed} is missing")
        found = sha256_file(weights)
        if found != adapter.sha256:
            raise ValueError(
                f"{weights} is not the adapter file {saved.file} was saved with (sha256 {found[:12]}..., expected "
                f"{adapter.sha256[:12]}...): the folder mixes two saves. Save again, or load the weights and the "
                "config that were written together"
            )
    return list(saved.adapters)


# -- saving -------------------------------------------------------------------------------------


def config_payload(owner: Any, adapters: dict[str, Any] | None) -> str:
    """The JSON of `owner.config` (a CheckpointedModel, or the state behind one) with the layer
    names of its map and the adapter fingerprints."""
    payload = json.loads(owner.config.to_json_string())
    payload["layers"] = [plan.name for plan in owner.checkpoint_map]
    if adapters is not None:
        payload["adapters"] = adapters
    return json.dumps(payload, indent=2, sort_keys=True) + "\n"


def adapter_fingerprints(model: Any, folder: str, selected: list[str] | None = None) -> dict[str, Any]:
    """{adapter name: folder, weights file, sha256} for the adapters PEFT wrote into `folder`."""
    if not is_peft_model(model):
        return {}
    out: dict[str, Any] = {}
    for name in selected or list(model.peft_config):
        relative = "" if name == "default" else name
        weights = next((w for w in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(folder, relative, w))), None)
        if weights is not None:
            out[name] = {
                "folder": relative,
                "weights": weights,
                "sha256": sha256_file(os.path.join(folder, relative, weights)),
            }
    return out


def write_config_beside(owner: Any, folder: str, selected: list[str] | None = None) -> None:
    """Write `checkpoint_config.json` into a folder PEFT or transformers just saved into,
    naming the adapter files there."""
    os.makedirs(folder, exist_ok=True)
    adapters = adapter_fingerprints(owner.model, folder, selected)
    write_json_atomically(os.path.join(folder, CONFIG_NAME), config_payload(owner, adapters))


def _adapter_layers(model: nn.Module) -> list[str]:
    """PEFT layers inside a model that is not a PeftModel (PEFT applied after wrapping)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover
        return []
    return [name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def save_checkpointed_model(cm: CheckpointedModel, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    if os.fspath(save_directory) == "":
        raise ValueError("save_pretrained needs a folder, got an empty path; pass '.' for the current directory")
    if not kwargs.get("is_main_process", True):
        return  # the main process writes the save; the others write nothing
    model = cm.model
    peft = is_peft_model(model)
    stray = [] if peft else _adapter_layers(model)
    if stray:
        raise ValueError(
            f"cm.model has PEFT adapter layers ({stray[0]}, ...) but is not a PeftModel, so there is no PEFT "
            "model to save them with and they would be lost. Wrap the PeftModel instead: "
            "peft_model = get_peft_model(model, lora_config); cm = CheckpointedModel(peft_model). Nothing was saved."
        )
    target = os.path.abspath(os.fspath(save_directory))
    if os.path.isfile(target):
        raise ValueError(f"save_pretrained needs a folder, but {target} is a file")
    selected = kwargs.get("selected_adapters")

    def write(staging: str) -> None:
        if peft:
            original_method(model, "save_pretrained")(staging, **kwargs)
        adapters = adapter_fingerprints(model, staging, selected)
        write_json_atomically(os.path.join(staging, CONFIG_NAME), config_payload(cm, adapters))

    committed = staged_save(target, write, keep=("README.md",))
    if peft and "README.md" not in committed:
        logger.info("%s already has a README.md: kept it, PEFT's model card was not written", target)


# -- loading ------------------------------------------------------------------------------------


def load_checkpointed_model(
    cls: type[CheckpointedModel], model: nn.Module, path: str | os.PathLike, *, is_trainable: bool, **kwargs: Any
) -> CheckpointedModel:
    folder = os.path.abspath(os.fspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no saved CheckpointedModel at {folder}")
    recover_staging(folder)
    saved = read_saved(folder)
    wrapper_kwargs = {k: kwargs.pop(k) for k in WRAPPER_ARGUMENTS if k in kwargs}
    # Every check that needs no change comes first: PEFT's loading changes the model. (Swapping
    # is checked after it: PEFT freezes the base weights that block swap needs frozen.)
    adapters = adapters_to_load(saved)
    fresh = bool(adapters) and not is_peft_model(model)
    discovery = cls.check_wrappable(model, saved.config, check_swap=not fresh, **wrapper_kwargs)
    check_layers_match(saved.layers, discovery.names, saved.file)
    if is_peft_model(model):
        _check_loadable_into(model, adapters, folder)
    undo = _ModelChanges(model)
    try:
        if adapters:
            model = _load_adapters(model, adapters, folder, is_trainable, kwargs)
        cm = cls(model, saved.config, **wrapper_kwargs)
    except BaseException:
        undo.revert()
        raise
    return cm.for_training() if is_trainable else cm.for_inference()


def _load_adapters(
    model: nn.Module, adapters: list[SavedAdapter], root: str, is_trainable: bool, kwargs: dict[str, Any]
) -> nn.Module:
    if not is_peft_model(model):
        from peft import PeftModel

        first = next((a for a in adapters if a.name == "default"), adapters[0])
        adapters = [a for a in adapters if a is not first]
        model = PeftModel.from_pretrained(
            model, os.path.join(root, first.folder), adapter_name=first.name, is_trainable=is_trainable, **kwargs
        )
    for adapter in adapters:
        original_method(model, "load_adapter")(
            os.path.join(root, adapter.folder), adapter_name=adapter.name, is_trainable=is_trainable, **kwargs
        )
    return model


def _check_loadable_into(model: Any, adapters: list[SavedAdapter], root: str) -> None:
    """Loading into a PeftModel that already has an adapter of the same name replaces its weights:
    refuse, before anything changes, unless the saved adapter has the same structure."""
    from peft import PeftConfig
    from peft.utils import get_peft_model_state_dict

    for adapter in adapters:
        if adapter.name not in model.peft_config:
            continue  # a new adapter: PEFT adds it (undone if that fails)
        folder = os.path.join(root, adapter.folder)
        saved_config = PeftConfig.from_pretrained(folder)
        differs = _config_differences(model.peft_config[adapter.name], saved_config)
        if differs:
            raise ValueError(
                f"the model's adapter {adapter.name!r} differs from the saved one in {folder} ({differs}); load into "
                "the base model (not a PeftModel) to get the saved adapter as it was. Nothing was loaded"
            )
        expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model, adapter_name=adapter.name).items()}
        found = _tensor_shapes(adapter.path(root))
        if expected != found:
            diff = sorted(set(expected.items()) ^ set(found.items()))[:3]
            raise ValueError(
                f"the saved weights of adapter {adapter.name!r} ({adapter.path(root)}) do not fit the model's adapter "
                f"(names or shapes differ, e.g. {diff}). Nothing was loaded"
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


class _ModelChanges:
    """What loading adapters may change on a model, recorded so a failure can put it back:
    which module sits where (PEFT replaces targets by its layers), requires_grad, the adapters
    a PeftModel has and their weights (loading into an existing adapter overwrites them)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.children = [(module, dict(module._modules)) for module in model.modules()]
        self.requires_grad = [(p, p.requires_grad) for p in model.parameters()]
        self.attributes = set(model.__dict__)
        self.adapters = list(model.peft_config) if is_peft_model(model) else None
        marks = [f".{name}." for name in self.adapters or ()]
        self.values = [(p, p.detach().clone()) for n, p in model.named_parameters() if any(m in n for m in marks)]

    def revert(self) -> None:
        if self.adapters is not None:
            for name in [n for n in self.model.peft_config if n not in self.adapters]:
                with contextlib.suppress(Exception):  # a half-added adapter: the steps below finish the job
                    self.model.delete_adapter(name)
                self.model.peft_config.pop(name, None)
        for module, children in self.children:
            module._modules.clear()
            module._modules.update(children)
        for param, flag in self.requires_grad:
            param.requires_grad_(flag)
        with torch.no_grad():
            for param, value in self.values:
                param.copy_(value)
        for name in set(self.model.__dict__) - self.attributes:
            if name == "_require_grads_hook":
                self.model._require_grads_hook.remove()
            del self.model.__dict__[name]


# -- instance overrides while wrapped ----------------------------------------------------------


def original_method(model: Any, name: str) -> Any:
    """The method as the class defines it, even while remat's override sits on the instance."""
    return getattr(type(model), name).__get__(model)


class _SaveWithConfig:
    """`model.save_pretrained` while wrapped: the model's own save, then `checkpoint_config.json`.
    `owner` is the state behind the wrapper (it reaches the model weakly: no reference cycle)."""

    def __init__(self, owner: Any):
        self.owner = owner

    def __call__(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        result = original_method(self.owner.model, "save_pretrained")(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_config_beside(self.owner, os.fspath(save_directory), kwargs.get("selected_adapters"))
        return result


class _LoadAdapterWithConfig:
    """A PeftModel's `load_adapter` while wrapped: checks the folder's checkpoint config (layers,
    adapter fingerprints) before PEFT loads anything, then applies it."""

    def __init__(self, owner: Any):
        self.owner = owner

    def __call__(self, model_id: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        folder = os.fspath(model_id)
        saved = None
        if os.path.isdir(folder):
            recover_staging(folder)
            if os.path.isfile(os.path.join(folder, CONFIG_NAME)):
                saved = read_saved(folder)
                check_layers_match(saved.layers, [p.name for p in self.owner.checkpoint_map], saved.file)
                adapters_to_load(saved)
        model = self.owner.model
        undo = _ModelChanges(model)
        try:
            result = original_method(model, "load_adapter")(model_id, *args, **kwargs)
        except BaseException:
            undo.revert()  # PEFT failed halfway (a half-added adapter): the model is as it was
            raise
        if saved is not None:
            self.owner.adopt_saved_config(saved.config, f"load_adapter({folder})")
        return result


class SaveLoadOverrides:
    """`save_pretrained` (and a PeftModel's `load_adapter`) on the wrapped model's instance."""

    def __init__(self) -> None:
        self._patches = InstancePatches()

    def install(self, owner: Any, model: Any) -> None:
        self._patches.set(model, "save_pretrained", _SaveWithConfig(owner))
        if is_peft_model(model):
            self._patches.set(model, "load_adapter", _LoadAdapterWithConfig(owner))

    def uninstall(self) -> None:
        self._patches.undo()
