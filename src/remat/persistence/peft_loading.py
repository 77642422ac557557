"""Loading checked adapters through PEFT: the checks that need PEFT, made before anything changes,
and `undone_on_failure`, which puts the model back as it was when PEFT's load fails halfway."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import safetensors
import torch
from peft import PeftConfig, PeftModel
from peft.config import PromptLearningConfig
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.utils import get_peft_model_state_dict
from torch import nn

from ..errors import ConfigError, SavedFileError
from ..saving.files import read_json_object
from .pair_format import ADAPTER_CONFIG, Loaded, adapter_parameters, is_peft_model, original_method

logger = logging.getLogger("remat")

_PEFT_BOOKKEEPING = {"base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version"}


@contextlib.contextmanager
def undone_on_failure(model: Any) -> Iterator[None]:
    """Put back what PEFT's load may change in place (modules, requires_grad, a PeftModel's adapters
    and their weights, instance attributes, train or eval mode: an inference load turns eval on) if the block raises,
    halfway or after."""
    children = [(module, dict(module._modules)) for module in model.modules()]
    modes = [(module, module.training) for module in model.modules()]
    requires_grad = [(p, p.requires_grad) for p in model.parameters()]
    attributes = set(model.__dict__)
    adapters = list(model.peft_config) if is_peft_model(model) else None
    active = list(model.active_adapters) if adapters is not None else None
    values = [(p, p.detach().clone()) for name in adapters or () for p in adapter_parameters(model, name)]
    try:
        yield
    except BaseException:
        if active is not None and list(model.active_adapters) != active:
            with contextlib.suppress(Exception):  # requires_grad, which set_adapter changes, is put back below
                _activate(model, active)
        added = [n for n in model.peft_config if n not in adapters] if adapters is not None else []
        for name in added:
            with contextlib.suppress(Exception):  # a half-added adapter: the steps below finish the job
                model.delete_adapter(name)
            model.peft_config.pop(name, None)
        for module, kept in children:
            module._modules.clear()
            module._modules.update(kept)
        for param, flag in requires_grad:
            param.requires_grad_(flag)
        for module, training in modes:
            module.training = training
        with torch.no_grad():
            for param, value in values:
                param.copy_(value)
        for name in set(model.__dict__) - attributes:
            hook = model.__dict__.pop(name)
            if name == "_require_grads_hook" and hasattr(hook, "remove"):
                hook.remove()  # transformers' enable_input_require_grads, called by PEFT
        raise


def load_adapters(model: nn.Module, loaded: Loaded, is_trainable: bool, kwargs: dict[str, Any]) -> nn.Module:
    """Every saved adapter into `model` (a base model becomes a PeftModel); returns the model. With `is_trainable`,
    an adapter saved frozen (DPO's reference adapter) stays frozen; the adapters active when saved are active again
    (PEFT would make "default" active, and a save made with another gave other logits)."""
    adapters = list(loaded.adapters)
    trainable = lambda adapter: is_trainable and adapter.trainable is not False
    if not is_peft_model(model):
        first = next((a for a in adapters if a.name == "default"), adapters[0])
        adapters.remove(first)
        path = loaded.snapshot.path(first.folder)
        model = PeftModel.from_pretrained(model, path, adapter_name=first.name, is_trainable=trainable(first), **kwargs)
    for adapter in adapters:
        original_method(model, "load_adapter")(
            loaded.snapshot.path(adapter.folder), adapter_name=adapter.name, is_trainable=trainable(adapter), **kwargs
        )
    for adapter in loaded.adapters:
        refuse_dropped(model, adapter.name, loaded.snapshot.path(adapter.file()))
    active = loaded.saved.active_adapters
    if active is None and len(loaded.adapters) > 1:  # several adapters, saved before remat recorded which was active
        logger.warning(
            "%s: saved by an older remat, which did not record which adapter was active: %s is active now, as PEFT "
            "makes it%s. If another was active when saved: cm.model.set_adapter(name)",
            loaded.saved.file,
            list(model.active_adapters),
            " (every adapter loaded trainable)" if is_trainable else "",
        )
    if active and set(active) <= set(model.peft_config) and list(model.active_adapters) != list(active):
        flags = [(p, p.requires_grad) for p in model.parameters()]  # PEFT's set_adapter freezes the others
        _activate(model, list(active))
        for param, flag in flags:
            param.requires_grad_(flag)
    for adapter in loaded.adapters:  # also those the model had: as saved (PEFT leaves theirs as they were)
        if adapter.trainable is not None:
            for param in adapter_parameters(model, adapter.name):
                param.requires_grad_(trainable(adapter))
    return model


def refuse_dropped(model: Any, name: str, path: str) -> None:
    """Refuse a load (undone by `undone_on_failure`) where PEFT, with a warning at most, dropped saved tensors in
    `path` that found no place in adapter `name` (a Qwen2-MoE's expert LoRA saved on transformers 5.24, loaded on
    4.57), or left some of the adapter's own tensors as initialised, nothing saved for them (a shallower model's)."""
    shapes = lambda embeddings: {  # embedding layers saved whole (`save_embedding_layers`) count where saved
        k: tuple(v.shape)
        for k, v in get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=embeddings).items()
    }
    saved, placed, own = tensor_shapes(path).items(), set(shapes(True).items()), set(shapes(False).items())
    lost, unsaved = sorted(set(saved) - placed), sorted(own - set(saved))
    if lost or unsaved:
        what = f"{len(lost)} of its saved tensors find no place in this model (e.g. {lost[:2]}), which PEFT drops"
        if unsaved:
            what = f"{len(unsaved)} of the adapter's tensors here have no saved weights (e.g. {unsaved[:2]})"
        raise SavedFileError(
            f"{path}: adapter {name!r} does not fit this model: {what}. It is not the model the adapter was saved "
            "from (another depth; or another transformers release, which may name or fuse its modules otherwise). "
            "Nothing was loaded"
        )


def _activate(model: Any, names: list[str]) -> None:
    if len(names) == 1:
        model.set_adapter(names[0])
    else:
        model.base_model.set_adapter(names)


def check_peft_load(model: Any, loaded: Loaded, is_trainable: bool, *, settings: bool = True) -> None:
    """The checks that need PEFT, before it changes anything: a PeftModel's adapter is replaced only by one
    of the same structure (`settings`: its config too, else its weights' names and shapes), and a new
    prompt-learning adapter is refused as trainable (PEFT would, halfway)."""
    existing = model.peft_config if is_peft_model(model) else {}
    for adapter in (a for a in loaded.adapters if a.name in existing):
        if settings and (differs := _settings_differ(existing[adapter.name], loaded.snapshot.path(adapter.folder))):
            raise SavedFileError(
                f"the model's adapter {adapter.name!r} differs from the saved one in "
                f"{loaded.snapshot.path(adapter.folder)} ({differs}); load into the base model (not a PeftModel) to "
                "get the saved adapter as it was. Nothing was loaded"
            )
        expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model, adapter_name=adapter.name).items()}
        found = tensor_shapes(loaded.snapshot.path(adapter.file()))
        if expected != found:
            diff = sorted(set(expected.items()) ^ set(found.items()))[:3]
            raise SavedFileError(
                f"the saved weights of adapter {adapter.name!r} ({loaded.snapshot.path(adapter.file())}) do not fit "
                f"the model's adapter (names or shapes differ, e.g. {diff}); load into the base model. Nothing loaded"
            )
    for adapter in (a for a in loaded.adapters if is_trainable and a.trainable is not False and a.name not in existing):
        peft_type = read_json_object(loaded.snapshot.path(adapter.file(ADAPTER_CONFIG))).get("peft_type")
        config_class = PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type) if isinstance(peft_type, str) else None
        if config_class is not None and issubclass(config_class, PromptLearningConfig):
            raise ConfigError(
                f"adapter {adapter.name!r} in {loaded.snapshot.path(adapter.folder)} is a prompt-learning adapter "
                f"({peft_type}), which PEFT loads for inference only (it saved the prompts, not the encoder that "
                "made them); load it with is_trainable=False. Nothing was loaded"
            )


def _settings_differ(config: Any, saved_folder: str) -> str:
    """How a PeftModel's adapter config differs from the one saved in `saved_folder`, in words ("": the same)."""
    mine = _comparable(config.to_dict())
    theirs = _comparable(PeftConfig.from_pretrained(saved_folder).to_dict())
    keys = sorted(k for k in {*mine, *theirs} - _PEFT_BOOKKEEPING if mine.get(k) != theirs.get(k))
    return ", ".join(f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} saved" for k in keys)


def _comparable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_comparable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    return value


def tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the tensors in a weights file (safetensors or torch's), read without the tensors."""
    if path.endswith(".safetensors"):
        with safetensors.safe_open(path, framework="pt") as saved:
            return {k: tuple(saved.get_slice(k).get_shape()) for k in saved.keys()}  # noqa: SIM118
    return {k: tuple(v.shape) for k, v in torch.load(path, map_location="meta", weights_only=True).items()}
