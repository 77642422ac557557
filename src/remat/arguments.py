"""Checks for the arguments a `CheckpointedModel` is built with, run before anything changes.

A wrong argument must fail where it is given, naming it, not at the first training step with
an unrelated error from deep inside a hook.
"""

from __future__ import annotations

import math
import re
from typing import Any

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

MAX_COUNT = 2**63 - 1
"""The largest byte count or token count accepted (torch's and every allocator's int64): a
larger one is no size any machine has, and would overflow float arithmetic downstream."""

TRANSPORT_METHODS = ("handles", "allocate_host", "return_freed_host_memory", "to_host", "to_device")
MOVER_METHODS = ("host_copy", "fetch")


def parse_bytes(value: Any, name: str) -> int:
    """A byte count from an int (bytes) or a string with a unit: "1.5GiB", "512 MiB", "2GB".

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers
    of 1024, as the standards say; a bare number is bytes.
    """
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of bytes (int) or a size like '8GiB', got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be a number of bytes (int) or a size like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        return _at_most(value, name, "bytes")
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or (unit or "b") not in _UNITS:
        raise ValueError(
            f"{name} must be a size like '8GiB', '512MiB' or '2GB' (units: {', '.join(sorted(_UNITS))}), got {value!r}"
        )
    size = float(match.group(1)) * _UNITS[unit or "b"]
    if not size <= MAX_COUNT:  # hundreds of digits: no size a machine has (and no int a float can give)
        raise ValueError(f"{name} must be at most {MAX_COUNT} bytes, got {value[:40]!r}{'...' * (len(value) > 40)}")
    return int(size)


def parse_count(value: Any, name: str, what: str) -> int:
    """A whole number of things (tokens), from 1 to `MAX_COUNT`; anything else is a ValueError
    naming `name` and `what` it counts."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 ({what}), got {value!r}")
    return _at_most(value, name, what)


def _at_most(value: int, name: str, what: str) -> int:
    if value > MAX_COUNT:
        shown = str(value) if value < 10**30 else f"an int of {len(str(value))} digits"
        raise ValueError(f"{name} must be at most {MAX_COUNT} ({what}), got {shown}")
    return value


def check_implements(value: Any, methods: tuple[str, ...], name: str) -> None:
    """`value` must have each of `methods` (the protocol remat calls it through)."""
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise TypeError(f"{name} must provide {', '.join(methods)}; {type(value).__name__} lacks {', '.join(missing)}")
