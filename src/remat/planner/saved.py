"""A budget's profile as JSON, saved in `checkpoint_config.json` beside the budget: a resumed run plans from
it without measuring, where the machine and the model are still those it measured (`remat.budget`).

Only the planner's own value types are rebuilt (by name, from a fixed list), with keyword arguments: a
crafted file can make a malformed profile (refused, and measured again), never run code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import transformers

from ..compat.accelerator import device_name
from ..errors import SavedFileError
from ..policies import LayerProfile
from .chooser import HeadProfile, Measurements, Outside, StepMemory, TimePrices
from .state import ModelState, attention_of

# 2: the head's options measured with the last layer kept too (1 under-priced some plans: measure again); 3: the
# profiled rows' length kept (2 priced a packed row as the profile's rows, up to 1.7x under: measure again); 4: whether
# what grows with the length's square grows per row (3 priced T5's fewer, longer rows per row, 3x under); 5: a digest
# of the frozen parameters' shapes (4 planned a model whose embeddings were resized since at the old head's bytes); 6:
# an image batch's tokens are its pixels, audio's its frames or samples (5 counted rows x channels: any image size
# took the profiled size's plan, 7.9x over at 3x the side); 7: the step's bytes no token count changes (6 priced
# fewer, longer rows' step peak with the weights in the fit: a BERT row of 256 after rows of 64 at 2.08x its
# prediction); 8: prompt learning's virtual tokens counted in each row (7 left them out: a resumed step priced 1.76x
# what it held); 9: an encoder-decoder's profiled target tokens (8 priced a step's longer targets of the same kind at
# the profile's: 1.47x under on T5)
FORMAT = 9
_TYPES: dict[str, Any] = {
    cls.__name__: cls for cls in (Measurements, LayerProfile, Outside, StepMemory, TimePrices, HeadProfile, ModelState)
}


def machine() -> dict[str, Any]:
    """What a profile's figures depend on beyond the model: the accelerator (or the CPU's model), torch and
    transformers (whose layers hold what they hold)."""
    return {"device": device_name(), "torch": torch.__version__, "transformers": transformers.__version__}


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        saved = (f for f in dataclasses.fields(value) if f.metadata.get("saved", True))
        fields = {f.name: _encode(getattr(value, f.name)) for f in saved}
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


def profile_to_json(profile: Any, model: Any, without_optimizer: bool) -> dict[str, Any]:
    """`profile` (a `remat.planner.Profile`) as plain JSON values, with the machine it was measured on."""
    return {
        "format": FORMAT,
        "machine": machine(),
        "attention": attention_of(model),
        "without_optimizer": without_optimizer,
        "measurements": _encode(profile.measurements),
        "state": _encode(profile.state),
        "notes": list(profile.notes),
        "profiling_seconds": profile.profiling_seconds,
    }


def _impossible(m: Measurements) -> str | None:
    """Numbers no measurement gives, which the chooser would plan with all the same (negative bytes fit any budget;
    a NaN time changes which map is fastest)."""
    for each in (m, m.shorter) if m.shorter is not None else (m,):
        counts = [*each.outside, each.tokens, *(p.input_bytes for p in each.layers)]
        counts += [each.step.optimizer] if each.step is not None else []
        counts += [b for p in each.layers for pair in p.held.values() for b in pair]
        if any(not math.isfinite(c) or c < 0 for c in counts):
            return "a byte or token count below zero or not a number"
        if each.length is not None and not (type(each.length) is int and 0 < each.length <= each.tokens):
            return f"a row length of {each.length!r}"
        if each.target_tokens is not None and not (type(each.target_tokens) is int and each.target_tokens > 0):
            return f"{each.target_tokens!r} target tokens"
        if type(each.square_per_row) is not bool:
            return f"square_per_row of {each.square_per_row!r}"
        times = [each.base_seconds, *(t for p in each.layers for t in p.seconds.values())]
        if not all(math.isfinite(t) for t in times):
            return "a time that is not a number"
    return None


@dataclasses.dataclass(frozen=True)
class SavedProfile:
    """A profile read from a save: `source` names the file, for the log line that says it was used."""

    source: str
    data: dict[str, Any]

    @property
    def without_optimizer(self) -> bool:
        return self.data.get("without_optimizer") is True

    def differences(self, model: Any) -> list[str]:
        """Why it cannot be used for `model` here (empty: it can): another machine, torch or transformers, another
        attention implementation, or a malformed profile (one the chooser cannot plan from)."""
        from .chooser import frontier

        if self.data.get("format") != FORMAT:
            return [f"it has format {self.data.get('format')!r}, this remat reads {FORMAT}"]
        here, there = machine(), self.data.get("machine")
        if here != there:
            return [f"it was measured on {there}, this is {here}"]
        if (attention := attention_of(model)) != self.data.get("attention"):
            return [f"it was measured with {self.data.get('attention')!r} attention, the model runs {attention!r}"]
        try:
            measurements = self.profile(None).measurements
            if why := _impossible(measurements):
                return [f"{self.source}: the saved profile is malformed ({why})"]
            for tokens in (None, 2 * measurements.tokens):
                frontier(measurements.scaled(tokens), "activations")
        except SavedFileError as err:
            return [str(err)]
        except Exception as err:  # numbers the chooser cannot plan with: measured again
            return [f"{self.source}: the saved profile is malformed ({type(err).__name__}: {err})"]
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
