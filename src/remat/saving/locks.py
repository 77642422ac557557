"""Locks on files, from `filelock` (flock on Unix, LockFileEx on Windows), on a descriptor remat
opens itself, never blocking: a lock file that is not a regular file is never opened
(`LockFileError`). A holder may remove the lock file on release (a shared holder only when it is the
last): a waiter that then gets the lock on the removed file takes the one at the path. Shared
locks are `flock(LOCK_SH)`; without `fcntl` (Windows) they are taken exclusive. Where no lock
can be taken (no write access, no native locks) the lock comes back not held.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time

import filelock

from ..errors import LockFileError
from .files import CLOEXEC, NOFOLLOW, NONBLOCK

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("remat")


_POLL_SECONDS = 0.005
_warned_no_locks = False
# flock's answers where the file system has no locks (ENOLCK: NFSv3 without lockd; EINVAL: FUSE)
_NO_NATIVE_LOCKS = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


def _open_lock_file(path: str) -> int:
    """A descriptor on the lock file, made if missing; read-only if another account made it
    (flock locks it all the same, so two accounts sharing a folder still take turns)."""
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
        raise LockFileError(errno.EINVAL, "not a regular file where remat's lock file goes", path)
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


def _last_holder(fd: int) -> bool:
    """Whether a shared lock turns exclusive without waiting (no one else holds the file)."""
    try:
        return filelock.lock_descriptor(fd, blocking=False)
    except OSError:
        return False


class Lock:
    """A held lock on a file (`fd` None: none could be taken). `remove`: the holder deletes the
    file before letting go."""

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
        try:
            if self.remove and (not self.shared or _last_holder(fd)):
                with contextlib.suppress(OSError):  # gone already; or Windows, which keeps an open file
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
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):
                kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
                raise LockFileError(errno.ELOOP, f"{kind} where remat's lock file goes", path)
        try:
            fd = _open_lock_file(path)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # replaced since the lstat
                raise LockFileError(err.errno, "not a regular file where remat's lock file goes", path) from None
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
                logger.warning(
                    "this system has no file locks: saves into one folder from several processes are not ordered"
                )
            return Lock(None, path, remove, shared)
        if not got:
            os.close(fd)
            return None
        try:
            current = os.lstat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            return Lock(fd, path, remove, shared)
        # The holder before us deleted the file we locked: take the one at the path now.
        with contextlib.suppress(OSError):
            filelock.unlock_descriptor(fd)
        os.close(fd)
