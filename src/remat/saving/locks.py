"""Locks on files, from `filelock` (flock on Unix, LockFileEx on Windows), on a descriptor remat
opens itself: a lock file that is a symlink is never opened (`NotOurs`), and a lock file can be
removed by its holder on release without two processes ever holding "the" lock at once (a
waiter that gets the lock on a removed file notices it and takes the one at the path).

Where no lock can be taken (no write access to the folder, a system without native locks), the
lock comes back not held and the caller decides what that means (see `remat.saving.folder`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os

import filelock

from .files import CLOEXEC, NOFOLLOW

logger = logging.getLogger("remat")


class NotOurs(OSError):
    """A lock file that is a symlink: remat did not make it and will not open it."""


_warned_no_locks = False

# What flock answers where the file system has no locks of its own: no locking at all (ENOSYS),
# NFSv3 without lockd (ENOLCK), and file systems that refuse the operation (EOPNOTSUPP / ENOTSUP,
# EINVAL on some FUSE mounts). All mean the same here: go ahead unlocked, with one warning.
_NO_NATIVE_LOCKS = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


def _open_lock_file(path: str) -> int:
    """A descriptor on the lock file, made if missing. A lock file another account made (0644
    under umask 022) cannot be opened for writing: it is opened read-only instead, which flock
    locks all the same, so two accounts sharing a group-writable folder still take turns."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | NOFOLLOW | CLOEXEC, 0o666)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM):
            raise
    return os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC)


class Lock:
    """A held lock on a file (or, `fd` None, the absence of one where none can be taken).
    `remove`: the holder deletes the file before letting go, so no lock file stays behind
    (a waiter that then gets the lock on the deleted file notices and takes the new one)."""

    def __init__(self, fd: int | None, path: str, remove: bool):
        self.fd, self.path, self.remove = fd, path, remove

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if self.remove:
                with contextlib.suppress(OSError):  # gone already; or Windows, which keeps an open file
                    os.unlink(self.path)
        finally:
            with contextlib.suppress(OSError):
                filelock.unlock_descriptor(fd)
            os.close(fd)


def take_lock(path: str, *, wait: bool, remove: bool) -> Lock | None:
    """The exclusive lock on `path` (made if missing), or None if `wait` is False and another
    holds it. A lock that cannot be taken here (no write access, no native locks) comes back
    not held. Raises `NotOurs` for a symlink."""
    global _warned_no_locks
    while True:
        if os.path.islink(path):
            raise NotOurs(errno.ELOOP, "a symlink where remat's lock file goes", path)
        try:
            fd = _open_lock_file(path)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise NotOurs(errno.ELOOP, "a symlink where remat's lock file goes", path) from None
            if err.errno == errno.ENOENT and os.path.isdir(os.path.dirname(path) or "."):
                continue  # another account's lock file, removed by its holder as we reopened it
            if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return Lock(None, path, remove)
            raise
        try:
            got = filelock.lock_descriptor(fd, blocking=wait, poll_interval=0.005)
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_NATIVE_LOCKS:
                raise
            if not _warned_no_locks:
                _warned_no_locks = True
                logger.warning(
                    "this system has no file locks: saves into one folder from several processes are not ordered"
                )
            return Lock(None, path, remove)
        if not got:
            os.close(fd)
            return None
        try:
            current = os.lstat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            return Lock(fd, path, remove)
        # The holder before us deleted the file we locked: take the one at the path now.
        with contextlib.suppress(OSError):
            filelock.unlock_descriptor(fd)
        os.close(fd)
