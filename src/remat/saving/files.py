"""Files that are whole or absent, and locks on them. Only regular files are opened, checked without blocking (a FIFO
would make `open()` wait forever). Locks are `filelock`'s on a descriptor opened without following a link; a holder
may remove the file on release, so a waiter then locked on the removed file takes the one at the path. No write
access or no native locks: the lock is not held."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import stat
import time
from typing import Any

import filelock

from ..errors import LockFileError, NotSavedError, SavedFileError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("remat")

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
MAX_JSON_DEPTH = 64  # remat's own files nest 4 levels; json raises RecursionError near 1000
_FIX = "; correct the file, or save again"
_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket"}
_KINDS |= {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symlink"}
_POLL_SECONDS = 0.005
_warned_no_locks = False
# flock's answers where the file system has no locks (ENOLCK: NFSv3 without lockd; EINVAL: FUSE)
_NO_NATIVE_LOCKS = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
_NOT_A_FILE = "not a regular file where remat's lock file goes"


def _not_regular(path: str, mode: int | None) -> SavedFileError:
    """The error for anything but a regular file (`mode` None: a symlink not followed)."""
    kind = "a symlink" if mode is None else _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return SavedFileError(f"{path} is {kind}, not a regular file; remat reads only regular files (remove it)")


def open_regular(path: str, *, follow_links: bool = True) -> int:
    """A read-only descriptor on the regular file at `path`, opened without ever blocking;
    a `SavedFileError` for anything else (a symlink too, unless `follow_links`)."""
    info = os.stat(path) if follow_links else os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, info.st_mode)
    try:
        fd = os.open(path, os.O_RDONLY | NONBLOCK | CLOEXEC | (0 if follow_links else NOFOLLOW))
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # replaced since the stat
            raise _not_regular(path, None if err.errno == errno.ELOOP else 0) from None
        raise
    if not stat.S_ISREG(mode := os.fstat(fd).st_mode):  # replaced between the stat and the open
        os.close(fd)
        raise _not_regular(path, mode)
    return fd


def json_object(data: bytes, name: str) -> dict[str, Any]:
    """The JSON object in `data`, or a `SavedFileError` naming `name` (never a RecursionError)."""
    if not data.strip():
        raise SavedFileError(f"{name}: the file is empty{_FIX}")
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise SavedFileError(f"{name}: not UTF-8 text ({err}){_FIX}") from None
    except json.JSONDecodeError as err:
        raise SavedFileError(f"{name}: not valid JSON ({err}){_FIX}") from None
    except RecursionError:
        raise SavedFileError(f"{name}: nested too deeply to be a file remat wrote{_FIX}") from None
    stack = [(value, 1)]  # walked without recursion
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise SavedFileError(
                    f"{name}: nested more than {MAX_JSON_DEPTH} levels deep, which no file remat writes is{_FIX}"
                )
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    if not isinstance(value, dict):
        raise SavedFileError(f"{name}: expected a JSON object, got {type(value).__name__}{_FIX}")
    return value


def no_config(path: str) -> NotSavedError:
    """The error for a folder without `checkpoint_config.json`; a model's `config.json` there is named (before
    `cm.checkpoint_config`, `cm.config.save_pretrained(folder)` wrote remat's: now it writes the model's)."""
    hint = ""
    if os.path.isfile(os.path.join(os.path.dirname(path), "config.json")):
        hint = (
            " (the folder's config.json is a model's: cm.config is the model's config, remat's is "
            "cm.checkpoint_config: cm.save_pretrained(folder) saves it with the adapters, "
            "cm.checkpoint_config.save_pretrained(folder) alone)"
        )
    return NotSavedError(f"no checkpoint config at {path}; save one with save_pretrained{hint}")


def read_json_object(path: str, *, follow_links: bool = True) -> dict[str, Any]:
    """The JSON object in the regular file `path`, or an error naming the file."""
    try:
        fd = open_regular(path, follow_links=follow_links)
    except FileNotFoundError:
        raise no_config(path) from None
    with os.fdopen(fd, "rb") as handle:
        return json_object(handle.read(), path)


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


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_folder(path: str) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(path, os.O_RDONLY | NONBLOCK | CLOEXEC | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _open_lock_file(path: str) -> int:
    """A descriptor on the lock file, made if missing; read-only if another account made it (flock still locks)."""
    flags = NOFOLLOW | CLOEXEC | NONBLOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o666)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM):
            raise
        try:
            fd = os.open(path, os.O_RDONLY | flags)
        except FileNotFoundError:  # none there, and none can be made here: no lock to take
            raise err from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced by something else since the lstat
        os.close(fd)
        raise LockFileError(errno.EINVAL, _NOT_A_FILE, path)
    return fd


def _lock_descriptor(fd: int, *, shared: bool, wait: bool) -> bool:
    if not shared or fcntl is None:
        return filelock.lock_descriptor(fd, blocking=wait, poll_interval=_POLL_SECONDS)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise
        if not wait:
            return False
        time.sleep(_POLL_SECONDS)


class Lock:
    """A held lock on a file (`fd` None: none could be taken); `remove`: deleted before letting go."""

    def __init__(self, fd: int | None, path: str, remove: bool, shared: bool = False):
        self.fd, self.path, self.remove, self.shared = fd, path, remove, shared

    @property
    def held(self) -> bool:
        return self.fd is not None

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:  # a shared holder removes the file only if its lock turns exclusive at once (it is the last)
            with contextlib.suppress(OSError):  # gone already; or Windows, which keeps an open file
                if self.remove and (not self.shared or filelock.lock_descriptor(fd, blocking=False)):
                    os.unlink(self.path)
        finally:
            with contextlib.suppress(OSError):
                filelock.unlock_descriptor(fd)
            os.close(fd)


def take_lock(path: str, *, wait: bool, remove: bool, shared: bool = False) -> Lock | None:
    """The lock on `path` (made if missing), or None if `wait` is False and another holds it."""
    global _warned_no_locks
    while True:
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(mode := os.lstat(path).st_mode):
                kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
                raise LockFileError(errno.ELOOP, f"{kind} where remat's lock file goes", path)
        try:
            fd = _open_lock_file(path)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # replaced since the lstat
                raise LockFileError(err.errno, _NOT_A_FILE, path) from None
            if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return Lock(None, path, remove, shared)
            raise
        try:
            got = _lock_descriptor(fd, shared=shared, wait=wait)
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_NATIVE_LOCKS:
                raise
            if not _warned_no_locks:
                _warned_no_locks = True
                logger.warning("no file locks here: saves into one folder from several processes are not ordered")
            return Lock(None, path, remove, shared)
        if not got:
            os.close(fd)
            return None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                return Lock(fd, path, remove, shared)
        Lock(fd, path, remove=False).release()  # the holder before us deleted the file we locked: take the one there
