"""A budget's profile as JSON, saved in `checkpoint_config.json` beside the budget: a resumed run plans from
it without measuring, where the machine and the model are still those it measured (`remat.budget`).

Only the planner's own value types are rebuilt (by name, from a fixed list), with keyword arguments: a
crafted file can make a malformed profile (refused, and measured again), never run code.
"""

from __future__ import annotations

import dataclasses
import platform
from typing import Any

import torch

from ..errors import SavedFileError
from ..policies import LayerProfile
from .chooser import HeadProfile, Measurements, Outside, StepMemory, TimePrices
from .state import ModelState

FORMAT = 1
_TYPES: dict[str, Any] = {
    cls.__name__: cls for cls in (Measurements, LayerProfile, Outside, StepMemory, TimePrices, HeadProfile, ModelState)
}


def machine() -> dict[str, Any]:
    """What a profile's figures depend on beyond the model: the accelerator (or the CPU) and torch."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"cpu {platform.machine()} {platform.processor() or ''}".strip()
    return {"device": device, "torch": torch.__version__}


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, "fields": fields}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        fields = {k: _encode(v) for k, v in zip(value._fields, value, strict=True)}
        return {"type": type(value).__name__, "fields": fields}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"items": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a profile holds a {type(value).__name__}, which remat does not save")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict) and set(value) == {"items"}:
        return {_decode(k): _decode(v) for k, v in value["items"]}
    if isinstance(value, dict) and set(value) == {"type", "fields"} and value["type"] in _TYPES:
        cls = _TYPES[value["type"]]
        fields = {k: _decode(v) for k, v in value["fields"].items()}
        if cls is LayerProfile:  # its dicts are dicts; its values tuples
            fields["held"], fields["seconds"] = dict(fields["held"]), dict(fields["seconds"])
        return cls(**fields)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"unexpected {type(value).__name__}")


def profile_to_json(profile: Any) -> dict[str, Any]:
    """`profile` (a `remat.planner.Profile`) as plain JSON values, with the machine it was measured on."""
    return {
        "format": FORMAT,
        "machine": machine(),
        "measurements": _encode(profile.measurements),
        "state": _encode(profile.state),
        "notes": list(profile.notes),
        "profiling_seconds": profile.profiling_seconds,
    }


@dataclasses.dataclass(frozen=True)
class SavedProfile:
    """A profile read from a save: `source` names the file, for the log line that says it was used."""

    source: str
    data: dict[str, Any]

    def differences(self) -> list[str]:
        """Why it cannot be used here (empty: it can): another machine or torch, or a malformed profile."""
        if self.data.get("format") != FORMAT:
            return [f"it has format {self.data.get('format')!r}, this remat reads {FORMAT}"]
        here, there = machine(), self.data.get("machine")
        if here != there:
            return [f"it was measured on {there}, this is {here}"]
        try:
            self.profile(None)
        except SavedFileError as err:
            return [str(err)]
        return []

    def profile(self, controller: Any) -> Any:
        """The `Profile`, planning for `controller`'s model (checked against its state like any profile)."""
        from ..compat.transformers_compat import native_every_n
        from .profile import Profile

        try:
            measurements, state = _decode(self.data["measurements"]), _decode(self.data["state"])
            notes = tuple(str(n) for n in self.data.get("notes", ()))
            seconds = float(self.data.get("profiling_seconds", 0.0))
            if not isinstance(measurements, Measurements) or not isinstance(state, ModelState):
                raise ValueError("not a profile")
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise SavedFileError(f"{self.source}: the saved profile is malformed ({err})") from None
        config = None if controller is None else controller.config
        return Profile(measurements, config, notes, seconds, native_every_n(), state=state, wrapper=controller)
