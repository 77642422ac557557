"""The torch and transformers releases remat is tested with, and one WARNING on any other (remat
overrides private Trainer methods, so an untested release may break in ways no error names).
pyproject.toml (one minor release of headroom), the README and `TESTED` agree (tests/test_packaging.py).
Checked once per package and version when the first `CheckpointedModel` is built, not on import."""

from __future__ import annotations

import importlib.metadata
import logging
import re
from collections.abc import Callable

logger = logging.getLogger("remat")

# (oldest, newest) minor release tested, inclusive: torch 2.13; transformers 4.57.6, 5.17.0, 5.24.0.
TESTED = {"torch": ((2, 13), (2, 13)), "transformers": ((4, 57), (5, 24))}

_warned: set[tuple[str, str]] = set()


def minor_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "2.13.0+cpu" or "5.25.0.dev0"; None if unreadable."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def installed_version(package: str) -> str:
    """The installed distribution's version string (tests replace this to fake a release)."""
    return importlib.metadata.version(package)


def warn_if_untested(version_of: Callable[[str], str] | None = None) -> list[str]:
    """Log (and return) one WARNING for each of torch and transformers installed outside the tested
    range, once per package and version in this process; `version_of` defaults to `installed_version`."""
    said = []
    for package, (oldest, newest) in TESTED.items():
        try:
            version = (version_of or installed_version)(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        release = minor_release(version)
        if release is None or oldest <= release <= newest or (package, version) in _warned:
            continue
        _warned.add((package, version))
        tested = "{}.{}".format(*oldest) + ("" if oldest == newest else " to {}.{}".format(*newest))
        said.append(
            f"{package} {version} is not a release remat is tested with ({package} {tested}); it may work, or fail in "
            f"ways no error names (the README's Install section shows how to install a tested release)"
        )
        logger.warning(said[-1])
    return said
