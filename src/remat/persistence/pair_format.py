"""The pair's format: what `checkpoint_config.json` holds beside PEFT's adapters, and every
check a load makes before anything changes.

Beside the config it holds `layers` (the map's layer names relative to the transformers model,
whatever PEFT wrapper holds it), `architecture` (`model_type`, layer count, hidden size) and,
per adapter, its folder, weights file and the sha256 of that file and of its
`adapter_config.json`: everything PEFT reads, so a folder mixing two saves is refused.

Older saves still load: format 2 has no `architecture` and no `config_sha256` (those checks are
skipped), format 1 no `adapters` (PEFT's default adapter is loaded, unchecked); saves from
before relative layer names carry a PeftModel's full names, read without its prefix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import CheckpointConfig
from ..errors import FolderChangedError, NotSavedError, SavedFileError
from ..saving.files import sha256_file
from ..saving.folder import CONFIG_NAME, Snapshot, read_pair, save_pair
from ..saving.stale_shards import StaleShards
from .peft_names import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_folder, is_peft_model

logger = logging.getLogger("remat")

_LEGACY_PEFT_PREFIXES = ("base_model.model.", "base_model.")  # injected tuners, prompt learning


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

    def file(self, name: str | None = None) -> str:  # relative to the save
        return os.path.join(self.folder, name or self.weights)


@dataclass(frozen=True)
class Saved:
    folder: str
    file: str  # checkpoint_config.json in `folder`, for messages
    config: CheckpointConfig
    layers: list[str] | None
    adapters: tuple[SavedAdapter, ...] | None  # None: the config does not say (an older save)
    architecture: dict[str, Any] | None  # None: an older save

    @property
    def adapter_layers(self) -> bool:
        """Whether the map was planned with layers a PEFT tuner adds (see `ADAPTER_LAYER`)."""
        return any(n.startswith(ADAPTER_LAYER) for n in self.layers or ())


def parse_saved(snapshot: Snapshot) -> Saved:
    file = snapshot.name(CONFIG_NAME)
    data = snapshot.config
    if data is None:
        raise NotSavedError(f"no checkpoint config at {file}; save one with save_pretrained")
    config = CheckpointConfig.from_dict(data, source=file)
    layers = data.get("layers")
    if layers is not None and not (isinstance(layers, list) and all(isinstance(n, str) for n in layers)):
        raise SavedFileError(f"{file}: 'layers' must be a list of layer names; save again to rewrite it")
    architecture = data.get("architecture")
    if architecture is not None and not (
        isinstance(architecture, dict) and all(isinstance(v, (str, int, type(None))) for v in architecture.values())
    ):
        raise SavedFileError(f"{file}: 'architecture' must be an object of names and numbers; save again to rewrite it")
    return Saved(snapshot.folder, file, config, layers, _read_adapters(data.get("adapters"), file), architecture)


def _read_adapters(value: Any, file: str) -> tuple[SavedAdapter, ...] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SavedFileError(f"{file}: 'adapters' must be an object {{adapter name: files}}; save again to rewrite it")
    out = []
    for name, entry in value.items():
        ok = isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("folder", "weights", "sha256"))
        ok = ok and isinstance(entry.get("config_sha256"), (str, type(None)))
        if (
            not ok
            or entry["weights"] not in ADAPTER_WEIGHTS
            or os.path.isabs(entry["folder"])
            or ".." in entry["folder"].split("/")
        ):
            raise SavedFileError(
                f"{file}: adapter {name!r} must name a folder, a weights file and their sha256; save again to "
                "rewrite it"
            )
        out.append(SavedAdapter(name, entry["folder"], entry["weights"], entry["sha256"], entry.get("config_sha256")))
    return tuple(out)


def pair_files(config: dict[str, Any] | None) -> list[str]:
    """The files a load opens beside `checkpoint_config.json`: PEFT's files at the top and in
    every adapter folder the config names (both weight formats: a stale one PEFT prefers)."""
    folders = {""}
    adapters = config.get("adapters") if isinstance(config, dict) else None
    if isinstance(adapters, dict):
        folders |= {e["folder"] for e in adapters.values() if isinstance(e, dict) and isinstance(e.get("folder"), str)}
    return [os.path.join(f, name) for f in sorted(folders) for name in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS)]


def base_model_prefix(model: Any) -> str:
    """The name (with its trailing dot) of the transformers model inside `model`, "" for no
    PeftModel; found by identity, so it holds for any tuner."""
    if not is_peft_model(model):
        return ""
    base = model.get_base_model()
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else ""
    return ""


ADAPTER_LAYER = "peft:"  # marks a saved layer a PEFT tuner adds outside the transformers model


def relative_names(model: Any, names: Iterable[str]) -> list[str]:
    """Layer names relative to `model`'s transformers model, so a save from a PeftModel matches
    its base model; a layer a tuner adds outside it keeps its full name, marked `ADAPTER_LAYER`
    (ShadowPEFT's shadow backbone)."""
    prefix = base_model_prefix(model)
    if not prefix:
        return list(names)
    return [n[len(prefix) :] if n.startswith(prefix) else ADAPTER_LAYER + n for n in names]


def _saved_readings(names: list[str]) -> list[list[str]]:
    """Saved layer names as written, and without each legacy PEFT prefix all of them carry."""
    readings = [names]
    for prefix in _LEGACY_PEFT_PREFIXES:
        if names and all(n.startswith(prefix) for n in names):
            readings.append([n[len(prefix) :] for n in names])
    return readings


def _summary(names: list[str]) -> str:
    shown = _saved_readings(names)[-1][:2]
    return ", ".join(shown) + (", ..." if len(names) > 2 else "")


def architecture_of(model: Any, num_layers: int) -> dict[str, Any]:
    """`model_type`, layer count and hidden size (the text model's, for several configs)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    return {
        "model_type": getattr(config, "model_type", None) or None,
        "num_layers": num_layers,
        "hidden_size": hidden if isinstance(hidden, int) else None,
    }


def _describe(architecture: dict[str, Any]) -> str:
    return (
        f"a {architecture.get('model_type') or 'model of unknown type'} model ({architecture.get('num_layers')} "
        f"layers, hidden size {architecture.get('hidden_size')})"
    )


@dataclass(frozen=True)
class Expected:
    """The model a load goes into: its relative layer names, its architecture, and whether PEFT
    is still to load adapters into it (then layers an adapter adds come with the adapter)."""

    layers: list[str]
    architecture: dict[str, Any] | None = None
    adapters_to_come: bool = False

    @classmethod
    def of(cls, model: Any, names: list[str]) -> Expected:
        return cls(relative_names(model, names), architecture_of(model, len(names)), not is_peft_model(model))

    def check(self, saved: Saved) -> None:
        if saved.architecture is not None and self.architecture is not None:
            differs = [
                k
                for k in ("model_type", "hidden_size")  # depth: the layers check below says more
                if saved.architecture.get(k) is not None
                and self.architecture.get(k) is not None
                and saved.architecture[k] != self.architecture[k]
            ]
            if differs:
                raise SavedFileError(
                    f"{saved.file} was saved from {_describe(saved.architecture)}, but this model is "
                    f"{_describe(self.architecture)} ({', '.join(differs)} differ); load it into the architecture it "
                    "was saved from. Nothing was loaded"
                )
        num_layers = len(self.layers)
        if saved.layers is not None:
            base_layers = [n for n in saved.layers if not n.startswith(ADAPTER_LAYER)]
            if self.adapters_to_come and self.layers == base_layers:
                num_layers = len(saved.layers)  # the adapter's own layers come with PEFT's load
            elif self.layers not in _saved_readings(saved.layers):
                raise SavedFileError(
                    f"{saved.file} was planned for {len(saved.layers)} layers ({_summary(saved.layers)}), but this "
                    f"model has {len(self.layers)} ({_summary(self.layers)}); load it into the model it was saved from"
                )
        check_saved_indices(saved.config, num_layers, saved.file)


def check_saved_indices(config: CheckpointConfig, num_layers: int, file: str) -> None:
    """Refuse indices this model lacks, naming the file and the fix (plan's error would not)."""
    fields = {"layer_policies": sorted(config.layer_policies)}
    if isinstance(config.swap_layers, tuple):
        fields["swap_layers"] = list(config.swap_layers)
    for field, indices in fields.items():
        beyond = [i for i in indices if i >= num_layers]
        if beyond:
            raise SavedFileError(
                f"{file}: {field} names layer(s) {beyond}, but this model has {num_layers} layers "
                f"(0..{num_layers - 1}); remove them from {field} in that file, or load it into the model it was "
                "saved from"
            )
    if isinstance(config.swap_layers, int) and config.swap_layers > num_layers:
        raise SavedFileError(
            f"{file}: swap_layers={config.swap_layers} asks for more layers than this model has ({num_layers}); "
            "lower swap_layers in that file, or load it into the model it was saved from"
        )


def checked_adapters(saved: Saved, snapshot: Snapshot) -> list[SavedAdapter]:
    """The adapters this save holds, each checked against its fingerprints (`FolderChangedError`
    for files that are not the ones the config was saved with)."""
    root_weights = [w for w in ADAPTER_WEIGHTS if snapshot.has(w)]
    if root_weights and not snapshot.has(ADAPTER_CONFIG):
        raise SavedFileError(
            f"{snapshot.name(root_weights[0])} holds adapter weights but there is no {ADAPTER_CONFIG} beside it, so "
            "they cannot be loaded as PEFT adapters; restore that file (PEFT writes both)"
        )
    if saved.adapters is None:  # an older save: PEFT's default adapter, if there is one
        return [SavedAdapter("default", "", root_weights[0], None, None)] if root_weights else []
    listed = {a.file() for a in saved.adapters}
    unlisted = [w for w in root_weights if w not in listed]
    if unlisted:
        logger.warning(
            "%s: %s is not one of the adapters %s was saved with; it is not loaded",
            saved.folder,
            unlisted[0],
            CONFIG_NAME,
        )
    for adapter in saved.adapters:
        preferred = adapter.file(ADAPTER_WEIGHTS[0])
        if adapter.weights != ADAPTER_WEIGHTS[0] and snapshot.has(preferred):
            raise SavedFileError(
                f"{saved.file} was saved with {snapshot.name(adapter.file())}, but {snapshot.name(preferred)} (from "
                f"another save) is beside it and PEFT loads that one first; remove {os.path.basename(preferred)} or "
                "save again. Nothing was loaded"
            )
        for needed in (adapter.file(), adapter.file(ADAPTER_CONFIG)):
            if not snapshot.has(needed):
                raise NotSavedError(
                    f"{saved.file} names adapter {adapter.name!r}, but {snapshot.name(needed)} is missing; save again"
                )
        checks = ((adapter.file(), adapter.sha256), (adapter.file(ADAPTER_CONFIG), adapter.config_sha256))
        for relative, expected in checks:
            if expected is None:
                continue
            found = sha256_file(snapshot.path(relative))
            if found != expected:
                raise FolderChangedError(
                    f"{snapshot.name(relative)} is not the adapter file {saved.file} was saved with (sha256 "
                    f"{found[:12]}..., expected {expected[:12]}...): the folder mixes two saves. Save again, or load "
                    "the files that were written together. Nothing was loaded"
                )
    return list(saved.adapters)


def fingerprints(model: Any, folder: str, selected: list[str] | None = None) -> dict[str, Any]:
    """The `adapters` entry for the adapters PEFT wrote into `folder`."""
    if not is_peft_model(model):
        return {}
    out: dict[str, Any] = {}
    for name in selected or list(model.peft_config):
        relative = adapter_folder(name)
        weights = next((w for w in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(folder, relative, w))), None)
        config = os.path.join(folder, relative, ADAPTER_CONFIG)
        if weights is not None and os.path.isfile(config):
            out[name] = {
                "folder": relative,
                "weights": weights,
                "sha256": sha256_file(os.path.join(folder, relative, weights)),
                "config_sha256": sha256_file(config),
            }
    return out


def config_payload(owner: PairOwner, adapters: dict[str, Any]) -> str:
    payload = json.loads(owner.config.to_json_string())
    names = [plan.name for plan in owner.checkpoint_map]
    payload["layers"] = relative_names(owner.model, names)
    payload["architecture"] = architecture_of(owner.model, len(names))
    payload["adapters"] = adapters
    return json.dumps(payload, indent=2, sort_keys=True) + "\n"


def save_model_pair(
    owner: PairOwner,
    target: str | os.PathLike,
    write: Any = None,
    *,
    selected: list[str] | None = None,
) -> list[str]:
    """Save `owner`'s pair into `target` (`folder.save_pair`); a model that is no PeftModel gets
    transformers' clean-up of stale shards applied to `target` (`stale_shards`)."""
    model = owner.model
    if write is None or is_peft_model(model):
        shards, staged_write = None, write
    else:
        shards = StaleShards(os.path.abspath(os.fspath(target)))

        def staged_write(staging: str) -> Any:
            shards.place(staging)
            try:
                return write(staging)
            finally:
                shards.collect(staging)

    return save_pair(
        target,
        lambda staging: config_payload(owner, fingerprints(model, staging, selected)),
        staged_write,
        keep=("README.md",),
        remove=None if shards is None else lambda: shards.removed,
    )


@dataclass(frozen=True)
class Loaded:
    saved: Saved
    snapshot: Snapshot  # the verified files, read in place: PEFT reads from here
    adapters: list[SavedAdapter]

    def adapter_path(self, adapter: SavedAdapter) -> str:
        return self.snapshot.path(adapter.folder)


def expected_for(owner: PairOwner) -> Expected:
    return Expected.of(owner.model, [plan.name for plan in owner.checkpoint_map])


@contextlib.contextmanager
def read_model_pair(folder: str | os.PathLike, expected: Expected | None = None) -> Iterator[Loaded]:
    """Read and check a save for `expected`; the files stay verified inside the `with`."""
    found: dict[str, Any] = {}

    def verify(snapshot: Snapshot) -> None:
        saved = parse_saved(snapshot)
        if expected is not None:
            expected.check(saved)
        found["saved"], found["adapters"] = saved, checked_adapters(saved, snapshot)

    with read_pair(folder, files=pair_files, verify=verify) as snapshot:
        yield Loaded(found["saved"], snapshot, found["adapters"])
