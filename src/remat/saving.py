"""Small file helpers: atomic writes and strict JSON reads.

A save interrupted halfway must leave the previous save readable, so files are written to a
temporary name in the same folder and moved over the old one in a single rename.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def write_json_atomically(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in `path`, or a ValueError that names the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint config at {path}") from None
    if not text.strip():
        raise ValueError(f"{path}: the file is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
