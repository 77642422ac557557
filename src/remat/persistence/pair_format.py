"""What `checkpoint_config.json` holds beside PEFT's adapters (layer names relative to the transformers
model, the architecture, the sha256 of every file PEFT reads, so a folder mixing two saves is refused),
and every check a load makes before anything changes. Older saves load: format 2 lacks `architecture`
and `config_sha256` (those checks are skipped), format 1 `adapters`, older ones carry full layer names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from peft import PeftModel
from peft.utils import CONFIG_NAME as ADAPTER_CONFIG
from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME, get_peft_model_state_dict

from ..config import CheckpointConfig
from ..errors import FolderChangedError, NotSavedError, SavedFileError, StateError
from ..saving.files import no_config, sha256_file
from ..saving.folder import CONFIG_NAME, Snapshot, read_pair, save_pair

logger = logging.getLogger("remat")

ADAPTER_WEIGHTS = (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME)  # PEFT writes one; `load_peft_weights` looks in this order
ADAPTER_LAYER = "peft:"  # marks a saved layer a PEFT tuner adds outside the transformers model
_LEGACY_PEFT_PREFIXES = ("base_model.model.", "base_model.")  # injected tuners, prompt learning
_AGAIN = "; save again to rewrite it"


def adapter_folder(adapter_name: str) -> str:
    """Where `PeftModel.save_pretrained` puts an adapter (PEFT exports no helper; a test checks it)."""
    return "" if adapter_name == "default" else adapter_name


def is_peft_model(model: Any) -> bool:
    return isinstance(model, PeftModel)


def adapter_parameters(model: Any, name: str) -> list[Any]:
    """The weights of adapter `name`: what PEFT keeps under that key in its tuner layers' dicts (`lora_A[name]`,
    `delora_A[name]`), its wrappers' (`modules_to_save[name]`) and a prompt encoder's; never a module of the base
    model that shares the name."""
    found: dict[int, Any] = {}
    for module in model.modules():
        for attr in (*getattr(module, "adapter_layer_names", ()), "modules_to_save", "prompt_encoder"):
            container = module._modules.get(attr)
            if container is not None and hasattr(container, "keys") and name in container.keys():  # noqa: SIM118
                item = container[name]
                found.update((id(p), p) for p in (item.parameters() if hasattr(item, "parameters") else [item]))
    return list(found.values())


def original_method(model: Any, name: str) -> Any:
    """The method as the class defines it, even while remat's override sits on the instance."""
    return getattr(type(model), name).__get__(model)


class PairOwner(Protocol):
    """What a save needs: the model, the config and the map (a controller)."""

    @property
    def model(self) -> Any: ...

    config: CheckpointConfig
    checkpoint_map: Sequence[Any]


@dataclass(frozen=True)
class SavedAdapter:
    name: str
    folder: str  # relative to the save: where PEFT writes this adapter ("" for "default")
    weights: str  # file name inside `folder`
    sha256: str | None  # None for saves from before fingerprints
    config_sha256: str | None  # of its adapter_config.json; None for saves before format 3
    trainable: bool | None = None  # whether its weights required grad when saved; None: not said (older saves)

    def file(self, name: str | None = None) -> str:  # relative to the save
        return os.path.join(self.folder, name or self.weights)


@dataclass(frozen=True)
class Saved:
    file: str  # checkpoint_config.json, for messages
    config: CheckpointConfig
    layers: list[str] | None
    adapters: tuple[SavedAdapter, ...] | None  # None: the config does not say (an older save)
    architecture: dict[str, Any] | None  # None: an older save
    budget_profile: dict[str, Any] | None = None  # a budget's profile (`remat.planner.saved`), checked when used
    active_adapters: tuple[str, ...] | None = None  # the PeftModel's active adapters when saved; None: not said


def parse_saved(snapshot: Snapshot) -> Saved:
    file, data = snapshot.path(CONFIG_NAME), snapshot.config
    if data is None:
        if snapshot.has(ADAPTER_CONFIG):  # PEFT's own save
            raise NotSavedError(
                f"{snapshot.path(ADAPTER_CONFIG)} is a PEFT adapter saved without remat (no {CONFIG_NAME}): load it "
                "with PEFT and wrap that: CheckpointedModel(PeftModel.from_pretrained(model, folder, "
                "is_trainable=True), config)"
            )
        raise no_config(file)
    config = CheckpointConfig.from_dict(data, source=file)
    layers, architecture, adapters = data.get("layers"), data.get("architecture"), data.get("adapters")
    if layers is not None and not (isinstance(layers, list) and all(isinstance(n, str) for n in layers)):
        raise SavedFileError(f"{file}: 'layers' must be a list of layer names{_AGAIN}")
    if architecture is not None and not (
        isinstance(architecture, dict) and all(isinstance(v, (str, int, type(None))) for v in architecture.values())
    ):
        raise SavedFileError(f"{file}: 'architecture' must be an object of names and numbers{_AGAIN}")
    if adapters is not None and not isinstance(adapters, dict):
        raise SavedFileError(f"{file}: 'adapters' must be an object {{adapter name: files}}{_AGAIN}")
    found = []
    for name, entry in (adapters or {}).items():
        ok = isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("folder", "weights", "sha256"))
        ok = ok and isinstance(entry.get("config_sha256"), (str, type(None))) and entry["weights"] in ADAPTER_WEIGHTS
        ok = ok and isinstance(entry.get("trainable"), (bool, type(None)))
        if not ok or os.path.isabs(entry["folder"]) or ".." in entry["folder"].split("/"):
            raise SavedFileError(
                f"{file}: adapter {name!r} must name a folder, a weights file and their sha256 (and whether it "
                f"was trainable: true or false){_AGAIN}"
            )
        files = (entry["folder"], entry["weights"], entry["sha256"], entry.get("config_sha256"))
        found.append(SavedAdapter(name, *files, entry.get("trainable")))
    profile = data.get("budget_profile")
    profile = profile if isinstance(profile, dict) else None  # not one: measured again, nothing refused
    active = data.get("active_adapters")
    if active is not None and not (isinstance(active, list) and all(isinstance(n, str) for n in active)):
        raise SavedFileError(f"{file}: 'active_adapters' must be a list of adapter names{_AGAIN}")
    adapters_found = None if adapters is None else tuple(found)
    return Saved(file, config, layers, adapters_found, architecture, profile, None if active is None else tuple(active))


def pair_files(config: dict[str, Any] | None) -> list[str]:
    """The files a load opens beside `checkpoint_config.json`: PEFT's files at the top and in
    every adapter folder the config names (both weight formats: a stale one PEFT prefers)."""
    folders = {""}
    adapters = config.get("adapters") if isinstance(config, dict) else None
    if isinstance(adapters, dict):
        folders |= {e["folder"] for e in adapters.values() if isinstance(e, dict) and isinstance(e.get("folder"), str)}
    return [os.path.join(f, name) for f in sorted(folders) for name in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS)]


def relative_names(model: Any, names: Iterable[str]) -> list[str]:
    """Layer names relative to `model`'s transformers model (found by identity: any tuner), so a save from
    a PeftModel matches its base model; a layer a tuner adds outside it (ShadowPEFT's) is marked."""
    if not is_peft_model(model):
        return list(names)
    base = model.get_base_model()
    name = next((name for name, module in model.named_modules() if module is base), "")
    prefix = f"{name}." if name else ""
    return [n[len(prefix) :] if n.startswith(prefix) else ADAPTER_LAYER + n for n in names]


def _saved_readings(names: list[str]) -> list[list[str]]:
    """Saved layer names as written, and without each legacy PEFT prefix all of them carry."""
    readings = [names]
    for prefix in _LEGACY_PEFT_PREFIXES:
        if names and all(n.startswith(prefix) for n in names):
            readings.append([n[len(prefix) :] for n in names])
    return readings


def _same_layers(mine: list[str], saved: list[str]) -> bool:
    """The same layers: equal, or some equal and each other saved one inside this model's at its index (remat before
    the hybrid-layer fix found Zamba's hybrid layers on transformers 4.x as their Mamba block, the others as they are:
    one layer per index all the same). A map of other layers altogether (`layer_class=` a block's MLP) is not."""
    pairs = list(zip(mine, saved, strict=False))
    inside = all(s == m or s.startswith(m + ".") for m, s in pairs)
    return len(mine) == len(saved) and inside and (mine == saved or any(s == m for m, s in pairs))


def _summary(names: list[str]) -> str:
    return ", ".join(_saved_readings(names)[-1][:2]) + (", ..." if len(names) > 2 else "")


def architecture_of(model: Any, num_layers: int) -> dict[str, Any]:
    """`model_type`, layer count and hidden size (the text model's, for several configs)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    hidden = hidden if isinstance(hidden, int) else None
    return {"model_type": getattr(config, "model_type", None) or None, "num_layers": num_layers, "hidden_size": hidden}


def _describe(architecture: dict[str, Any]) -> str:
    kind = architecture.get("model_type") or "model of unknown type"
    return f"a {kind} model ({architecture.get('num_layers')} layers, hidden size {architecture.get('hidden_size')})"


@dataclass(frozen=True)
class Expected:
    """The model a load goes into: its relative layer names, its architecture, and whether PEFT
    is still to load adapters into it (then layers an adapter adds come with the adapter)."""

    layers: list[str]
    architecture: dict[str, Any]
    adapters_to_come: bool
    map_taken: bool = True  # False: a frozen adapter loaded beside those training, its saved map not applied

    @classmethod
    def of(cls, model: Any, names: list[str]) -> Expected:
        return cls(relative_names(model, names), architecture_of(model, len(names)), not is_peft_model(model))

    @classmethod
    def for_owner(cls, owner: PairOwner) -> Expected:
        return cls.of(owner.model, [plan.name for plan in owner.checkpoint_map])

    def check(self, saved: Saved) -> None:
        """Refuse another architecture, other layers, or indices this model lacks, naming file and fix."""
        mine, theirs, file, config = self.architecture, saved.architecture or {}, saved.file, saved.config
        values = [(k, mine.get(k), theirs.get(k)) for k in ("model_type", "hidden_size")]  # depth: see layers
        if differs := [k for k, here, there in values if None not in (here, there) and here != there]:
            raise SavedFileError(
                f"{file} was saved from {_describe(theirs)}, but this model is {_describe(mine)} ({', '.join(differs)} "
                "differ); load it into the architecture it was saved from. Nothing was loaded"
            )
        if not self.map_taken:  # its layers and indices are the save's business (another release names them so)
            return
        num_layers, fix = len(self.layers), "load it into the model it was saved from"
        if saved.layers is not None:
            base_layers = [n for n in saved.layers if not n.startswith(ADAPTER_LAYER)]
            if self.adapters_to_come and self.layers == base_layers:
                num_layers = len(saved.layers)  # the adapter's own layers come with PEFT's load
            elif not any(_same_layers(self.layers, reading) for reading in _saved_readings(saved.layers)):
                release = (
                    ""  # as many layers, named otherwise: transformers renames modules between releases (Llava's)
                    if len(saved.layers) != len(self.layers)
                    else ". If it is this model saved under another transformers release, which named its layers "
                    "otherwise, PEFT may still place the adapters (it converts renamed keys): load them with "
                    "PeftModel.from_pretrained(model, folder), check that it warns of no missing or unexpected keys, "
                    "then wrap it with the saved settings: CheckpointConfig.from_pretrained(folder)"
                )
                raise SavedFileError(
                    f"{file} was planned for {len(saved.layers)} layers ({_summary(saved.layers)}), but this model "
                    f"has {len(self.layers)} ({_summary(self.layers)}); {fix}{release}. Nothing was loaded"
                )
        fields = {"layer_policies": sorted(config.layer_policies)}
        if isinstance(config.swap_layers, tuple):
            fields["swap_layers"] = list(config.swap_layers)
        for field, indices in fields.items():
            if beyond := [i for i in indices if i >= num_layers]:
                raise SavedFileError(
                    f"{file}: {field} names layer(s) {beyond}, but this model has {num_layers} layers "
                    f"(0..{num_layers - 1}); remove them from {field} in that file, or {fix}"
                )
        if isinstance(config.swap_layers, int) and config.swap_layers > num_layers:
            raise SavedFileError(
                f"{file}: swap_layers={config.swap_layers} asks for more layers than this model has ({num_layers}); "
                f"lower swap_layers in that file, or {fix}"
            )


def checked_adapters(saved: Saved, snapshot: Snapshot) -> list[SavedAdapter]:
    """The adapters this save holds, each checked against its fingerprints (else `FolderChangedError`)."""
    root_weights = [w for w in ADAPTER_WEIGHTS if snapshot.has(w)]
    if root_weights and not snapshot.has(ADAPTER_CONFIG):
        raise SavedFileError(
            f"{snapshot.path(root_weights[0])} holds adapter weights but there is no {ADAPTER_CONFIG} beside it, so "
            "they cannot be loaded as PEFT adapters; restore that file (PEFT writes both)"
        )
    if saved.adapters is None:  # an older save: PEFT's default adapter, if there is one
        return [SavedAdapter("default", "", root_weights[0], None, None)] if root_weights else []
    if unlisted := [w for w in root_weights if w not in {a.file() for a in saved.adapters}]:
        what = snapshot.path(unlisted[0])
        logger.warning("%s is not one of the adapters %s was saved with; it is not loaded", what, saved.file)
    for adapter in saved.adapters:
        preferred = adapter.file(ADAPTER_WEIGHTS[0])
        if adapter.weights != ADAPTER_WEIGHTS[0] and snapshot.has(preferred):
            raise SavedFileError(
                f"{saved.file} was saved with {snapshot.path(adapter.file())}, but {snapshot.path(preferred)} (from "
                f"another save) is beside it and PEFT loads that one first; remove {os.path.basename(preferred)}, or "
                "save again with safe_serialization=True. Nothing was loaded"
            )
        checks = ((adapter.file(), adapter.sha256), (adapter.file(ADAPTER_CONFIG), adapter.config_sha256))
        for relative, _ in checks:
            if not snapshot.has(relative):
                raise NotSavedError(
                    f"{saved.file} names adapter {adapter.name!r}, but {snapshot.path(relative)} is missing; save again"
                )
        for relative, expected in checks:
            if expected is not None and (found := sha256_file(snapshot.path(relative))) != expected:
                edited = (  # an edit of the config (an offline base_model_name_or_path) is the user's to accept
                    f" Only if you edited it yourself (another save's file would load with its own settings): remat "
                    f"loads into the model you pass (base_model_name_or_path is not read); to accept your edit, remove "
                    f"adapters.{adapter.name}.config_sha256 from {saved.file}."
                    if relative.endswith(ADAPTER_CONFIG)
                    else ""
                )
                raise FolderChangedError(
                    f"{snapshot.path(relative)} is not the adapter file {saved.file} was saved with (sha256 "
                    f"{found[:12]}..., expected {expected[:12]}...): it changed after the save (edited, damaged, or "
                    f"written by another save into the folder). Save again, or load the files that were written "
                    f"together.{edited} Nothing was loaded"
                )
    return list(saved.adapters)


def fingerprints(model: Any, folder: str, selected: list[str] | None, training: bool) -> dict[str, Any]:
    """The `adapters` entry for the adapters PEFT wrote into `folder`; with `training`, whether each adapter trains
    (DPO's reference adapter is saved frozen beside the one trained)."""
    if not is_peft_model(model):
        return {}
    out: dict[str, Any] = {}
    for name in selected or list(model.peft_config):
        here = os.path.join(folder, adapter_folder(name))
        weights = next((w for w in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(here, w))), None)
        config = os.path.join(here, ADAPTER_CONFIG)
        if weights is not None and os.path.isfile(config):
            sums = {"sha256": sha256_file(os.path.join(here, weights)), "config_sha256": sha256_file(config)}
            out[name] = {"folder": adapter_folder(name), "weights": weights, **sums}
            if training and (own := adapter_parameters(model, name)):  # else not said: a load does what it asks
                out[name]["trainable"] = any(p.requires_grad for p in own)
    return out


def save_model_pair(
    owner: PairOwner, target: str | os.PathLike, write: Callable[[str], object], *, selected: list[str] | None = None
) -> list[str]:
    """Save `owner`'s pair into `target`; `write(staging)` writes the model's own files."""
    model, written = owner.model, {}
    # cm's and Trainer's saves; no adapter has a weight left after merge_and_unload() (cm's or PEFT's own)
    if is_peft_model(model) and not any(get_peft_model_state_dict(model, adapter_name=n) for n in model.peft_config):
        raise StateError(
            "save_pretrained: cm.model is a PeftModel that holds no adapter weight any more (merge_and_unload() or "
            "unload() took the adapters out), so the save would write an empty adapter. Save the model that call "
            "returned: merged.save_pretrained(folder). Nothing was saved"
        )

    def config_text(staging: str) -> str:
        payload = json.loads(owner.config.to_json_string())
        expected = Expected.for_owner(owner)  # what a load checks
        payload["layers"], payload["architecture"] = expected.layers, expected.architecture
        # a wrapper loaded for inference, or a save nothing of which trains (the adapters saved, not the one another
        # adapter's `set_adapter` left training), says nothing of what trains: a load with is_trainable=True kept such
        # a save's adapters frozen (the first step failed in torch)
        saved = (selected or list(model.peft_config)) if is_peft_model(model) else []
        params = [p for name in saved for p in adapter_parameters(model, name)] if saved else model.parameters()
        training = not getattr(owner, "inference", False) and any(p.requires_grad for p in params)
        payload["adapters"] = fingerprints(model, staging, selected, training)
        if is_peft_model(model):
            payload["active_adapters"] = [name for name in model.active_adapters if name in payload["adapters"]]
        payload.update(getattr(owner, "save_extras", dict)())  # a budget's profile
        written.update(payload["adapters"])
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"

    files = save_pair(target, config_text, write, keep=("README.md",), stale_shards=not is_peft_model(model))
    for entry in written.values():  # a .bin save beside an earlier save's .safetensors, which PEFT loads first
        if entry["weights"] != ADAPTER_WEIGHTS[0] and os.path.isfile(
            stale := os.path.join(target, entry["folder"], ADAPTER_WEIGHTS[0])
        ):
            logger.warning(
                "%s is an earlier save's, and PEFT loads it before the %s written now (remat's load refuses the "
                "pair): remove it, or save with safe_serialization=True",
                stale,
                entry["weights"],
            )
    return files


@dataclass(frozen=True)
class Loaded:
    saved: Saved
    snapshot: Snapshot  # the verified files, read in place: PEFT reads from here
    adapters: list[SavedAdapter]


@contextlib.contextmanager
def read_model_pair(folder: str | os.PathLike, expected: Expected) -> Iterator[Loaded]:
    """Read and check a save for `expected`; the files stay verified inside the `with`."""
    found: list[Any] = []

    def verify(snapshot: Snapshot) -> None:
        saved = parse_saved(snapshot)
        expected.check(saved)
        found[:] = [saved, checked_adapters(saved, snapshot)]

    with read_pair(folder, files=pair_files, verify=verify) as snapshot:
        yield Loaded(found[0], snapshot, found[1])
