"""Files that are whole or absent: atomic writes with the umask's permissions, strict JSON reads
that name the file, fingerprints, fsync. Only regular files are opened for reading, checked
without blocking: a FIFO or a device in a shared folder would make `open()` wait forever.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import stat
from typing import Any

from ..errors import NotSavedError, SavedFileError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
MAX_JSON_DEPTH = 64  # remat's own files nest 4 levels; json raises RecursionError near 1000


def not_regular(path: str, mode: int | None) -> SavedFileError:
    """The error for a FIFO, a socket, a device, a folder or (not followed) a symlink where a file
    is expected: remat does not open it."""
    return SavedFileError(f"{path} is {_kind(mode)}, not a regular file; remat reads only regular files (remove it)")


_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket"}
_KINDS |= {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symlink"}


def _kind(mode: int | None) -> str:
    return "a symlink" if mode is None else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


_FIX = "; correct the file, or save again"


def open_regular(path: str, *, follow_links: bool = True) -> int:
    """A read-only descriptor on the regular file at `path`, opened without ever blocking;
    a `SavedFileError` for anything else (a symlink too, unless `follow_links`)."""
    info = os.stat(path) if follow_links else os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise not_regular(path, info.st_mode)
    try:
        fd = os.open(path, os.O_RDONLY | NONBLOCK | CLOEXEC | (0 if follow_links else NOFOLLOW))
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # replaced since the stat
            raise not_regular(path, None if err.errno == errno.ELOOP else 0) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # replaced between the stat and the open
        os.close(fd)
        raise not_regular(path, mode)
    return fd


def read_regular(path: str, *, follow_links: bool = True) -> bytes:
    with os.fdopen(open_regular(path, follow_links=follow_links), "rb") as handle:
        return handle.read()


def parse_json(data: bytes | str, name: str) -> Any:
    """The JSON value in `data`, or a ValueError naming `name` (never a RecursionError)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text)
    except UnicodeDecodeError as err:
        raise SavedFileError(f"{name}: not UTF-8 text ({err}){_FIX}") from None
    except json.JSONDecodeError as err:
        raise SavedFileError(f"{name}: not valid JSON ({err}){_FIX}") from None
    except RecursionError:
        raise SavedFileError(f"{name}: nested too deeply to be a file remat wrote{_FIX}") from None
    if _depth_beyond(value, MAX_JSON_DEPTH):
        raise SavedFileError(
            f"{name}: nested more than {MAX_JSON_DEPTH} levels deep, which no file remat writes is{_FIX}"
        )
    return value


def _depth_beyond(value: Any, limit: int) -> bool:
    """Whether `value` nests more than `limit` deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def write_file_atomically(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and one rename."""
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
    """The JSON object in `path`, or an error naming the file (as `name`, if given)."""
    name = name or path
    try:
        data = read_regular(path)
    except FileNotFoundError:
        raise NotSavedError(f"no checkpoint config at {name}; save one with save_pretrained") from None
    return json_object(data, name)


def json_object(data: bytes, name: str) -> dict[str, Any]:
    if not data.strip():
        raise SavedFileError(f"{name}: the file is empty{_FIX}")
    data = parse_json(data, name)
    if not isinstance(data, dict):
        raise SavedFileError(f"{name}: expected a JSON object, got {type(data).__name__}{_FIX}")
    return data


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_file(path: str) -> None:
    fd = open_regular(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(path: str) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(path, os.O_RDONLY | NONBLOCK | CLOEXEC | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
