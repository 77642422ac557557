"""Files that are whole or absent: atomic writes with the umask's permissions, strict JSON reads
that name the file, fingerprints, fsync."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from typing import Any

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def write_file_atomically(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and one rename. The
    file gets the process umask's permissions (0644 under umask 022), as PEFT's files do."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".tmp-{secrets.token_hex(8)}.json")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_folder(folder)


def read_json_object(path: str, name: str | None = None) -> dict[str, Any]:
    """The JSON object in `path`, or a ValueError that names the file (`name`, if the file read
    is a copy) and what is wrong."""
    name = name or path
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint config at {name}") from None
    if not text.strip():
        raise ValueError(f"{name}: the file is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(data).__name__}")
    return data


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(path: str) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
