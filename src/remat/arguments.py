"""Checks for the arguments a `CheckpointedModel` is built with, run where they are given (not at
the first step, from deep inside a hook), before anything changes."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from .errors import ConfigError, ConfigTypeError

# A bare letter (K, M, G, T, as docker's `--memory` and Java's `-Xmx` read "6g") and binary units (KiB, Ki, ...)
# are powers of 1024; decimal units with a B (KB, ...) powers of 1000, as `du --si` writes them. Any case.
_UNITS = {"": 1, "b": 1}
for _power, _p in enumerate("kmgt", 1):
    _UNITS |= {_p + "b": 1000**_power, _p: 1024**_power, _p + "i": 1024**_power, _p + "ib": 1024**_power}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_HELP = (
    "a size like '6GiB', '6G', '6144M', '6 GB' or an int of bytes: G, M, K, T alone and GiB, MiB, KiB, TiB are "
    "powers of 1024 ('6G' == '6GiB'); GB, MB, KB, TB are powers of 1000 ('6GB' == 6*10**9 bytes)"
)

MAX_COUNT = 2**63 - 1
"""The largest byte or token count accepted (int64, as torch counts): more would overflow float arithmetic."""


def parse_bytes(value: Any, name: str, least: int = 0) -> int:
    """A byte count of at least `least` from an int or a string with a unit (`_SIZE_HELP`); a TypeError or
    ValueError names `name` and the value as given ("0.5" is refused as "0.5", not as the 0 bytes it rounds to)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number of bytes (int) or a size like '8GiB', got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigTypeError(f"{name} must be a number of bytes (int) or {_SIZE_HELP}; got {value!r}")
    if isinstance(value, int):
        return _at_least(_at_most(value, name, "bytes"), least, name, value)
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if value.strip().startswith("-") and _SIZE.match(value.strip()[1:]):
        raise ConfigError(f"{name} is a size, which cannot be negative; got {value!r}")
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{name} must be {_SIZE_HELP}; got {value!r}")
    if unit in ("", "b") and "." in match.group(1):  # bytes are whole: '1.5' is a unit left out, not 1 byte
        meant = f"'{match.group(1)}MiB' or '{match.group(1)}GiB'"
        raise ConfigError(f"{name}: a size in bytes is a whole number; got {value!r}: add the unit meant ({meant})")
    size = float(match.group(1)) * _UNITS[unit]
    if not size <= MAX_COUNT:  # hundreds of digits: no size a machine has (and no int a float can give)
        raise ConfigError(f"{name} must be at most {MAX_COUNT} bytes, got {value[:40]!r}{'...' * (len(value) > 40)}")
    return _at_least(int(size), least, name, value)


def _at_least(size: int, least: int, name: str, given: Any) -> int:
    if size < least:
        why = ": every map holds something" if least > 0 else ""
        raise ConfigError(f"{name} must be at least {least} byte{'s' * (least != 1)}, got {given!r}{why}")
    return size


def parse_count(value: Any, name: str, what: str) -> int:
    """A whole number of `what` (tokens), from 1 to `MAX_COUNT`; else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1 ({what}), got {value!r}")
    return _at_most(value, name, what)


def check_flag(value: Any, name: str) -> bool:
    """True or False, as given: a string "False" or a config passed where the flag stands is refused, not read."""
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _at_most(value: int, name: str, what: str) -> int:
    if value > MAX_COUNT:
        shown = str(value) if value < 10**30 else f"an int of {len(str(value))} digits"
        raise ConfigError(f"{name} must be at most {MAX_COUNT} ({what}), got {shown}")
    return value


@dataclasses.dataclass(frozen=True)
class WrapperOptions:
    """The wrapper's own arguments, named once: the constructor takes them, `from_pretrained` picks them out."""

    offload_transport: Any = None  # remat.offload.Transport
    swap_mover: Any = None  # remat.swap.WeightMover
    layer_class: Any = None  # a class, a class name, or several (checked by remat.layers)
    offload_host_budget: int | str | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def taken_from(cls, kwargs: dict[str, Any]) -> WrapperOptions:
        return cls(**{name: kwargs.pop(name) for name in cls.names() if name in kwargs})

    def host_budget(self) -> int | None:
        """Checks each option, naming the one that is wrong; returns the host budget in bytes."""
        from .transport import OffloadTransport, WeightMover  # torch's: `import remat.config` stays without it

        for name, protocol in (("offload_transport", OffloadTransport), ("swap_mover", WeightMover)):
            value = getattr(self, name)  # must have each public method of the protocol
            methods = [m for m, v in vars(protocol).items() if callable(v) and not m.startswith("_")]
            missing = [m for m in methods if not callable(getattr(value, m, None))]
            if value is not None and missing:
                raise ConfigTypeError(
                    f"{name} must provide {', '.join(methods)}; {type(value).__name__} lacks {', '.join(missing)}"
                )
        budget = self.offload_host_budget
        return None if budget is None else parse_bytes(budget, "offload_host_budget")


def check_optimizer(value: Any) -> Any:
    """A torch optimizer, or None. accelerate's `AcceleratedOptimizer` gives the one inside it: its own `step()` does
    nothing between accumulation boundaries, so a step measured there counted no optimizer state and a plan for the
    whole step fitted a budget it exceeds. (Other wrappers keep state of their own: measured as they are.)"""
    import torch

    if type(value).__name__ == "AcceleratedOptimizer" and isinstance(inner := value.optimizer, torch.optim.Optimizer):
        value = inner
    if value is not None and not isinstance(value, torch.optim.Optimizer):
        raise ConfigTypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(value).__name__}")
    return value
