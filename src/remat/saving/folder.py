"""A folder is a transaction: saves commit whole, in order; loads read one whole save.

It knows files, not models, so that every save (`cm.save_pretrained`, a Trainer / TRL checkpoint,
`CheckpointConfig.save_pretrained`) goes through `save_pair` and every load (`from_pretrained`,
`load_adapter` on Trainer resume, `CheckpointConfig.from_pretrained`) through `read_pair`.

A save writes only its own files into the folder it is given, and never deletes or moves
anything else there (a training log, `checkpoint-500/`, the user's README), except the stale
weight shards that transformers' own `save_pretrained` would have removed there (see
`save_pair`'s `remove`):

1. every file of the save is written into a staging folder inside the target folder
   (`.remat-staging-<random>/`, whose `LOCK` its writer holds), so the renames stay on one
   file system; `checkpoint_config.json` is written last;
2. under the folder's lock (`.remat-lock`, held only for this step), crashed saves are finished
   or dropped (recovery), a manifest (`COMMIT`) naming the files and the state of the files
   they replace is written, and each file is renamed into place; the staging folder goes.

A load takes the same lock, shared (loads read side by side; a commit waits until they are
done, and they wait for a commit), recovers, opens the files it needs in place (the config
first, then the files it names; regular files only, checked without blocking), checks them
(fingerprints) and, still holding the lock, lets PEFT read them from the folder; then it lets
go. Nothing is copied: a load writes nothing anywhere (the system's temporary folder may be
full, read-only or missing), and a load killed at any moment leaves nothing behind but, until
the next save or load, the folder's lock file. So every load returns one whole save, the save
that commits last wins whole, and a load waits for one commit at most (a commit waits for the
loads already reading).

A crash before the manifest leaves the folder untouched (the staging folder is dropped by the
next save or load); a crash after it is finished by the next save or load ("rolled forward")
unless a newer save has written those files since. A staging folder whose writer still holds
its `LOCK` is left alone. Recovery never leaves the folder: it follows no symlink (a staging
folder, a `LOCK`, a manifest or a manifest entry that is a link makes the staging folder one
remat did not write: it is dropped), never opens anything but a regular file (a FIFO, socket,
device or folder where remat's `LOCK`, manifest or a file it names goes drops the staging
folder: nothing in a folder can make a save or load wait), and a manifest that is missing,
unreadable, nested too deep or has missing or mistyped fields is an unfinished save: dropped
with one warning. A staging folder a live writer is still filling is never reported: it is made
and locked under the folder's lock, so recovery (which holds that lock) finds it locked; one
with nothing written in it (its writer died at once) is removed without a word.

Files get the permissions any file the process creates gets (the umask), like PEFT's own.

What the lock promises (`flock` / `LockFileEx` through `filelock`; on network file systems only
where locks pass between machines) is the README's "What the lock promises". Where the folder
cannot be written a load takes no lock: it reads, checks, and reads again if a commit came in
between (`FolderChangedError` when PEFT's read overlapped one). Without native locks saves and loads
go on unlocked (one warning says so).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import FolderChangedError, LockFileError
from .files import fsync_file, fsync_folder, json_object, open_regular, parse_json, read_regular, write_file_atomically
from .locks import Lock
from .locks import take_lock as _take_lock

logger = logging.getLogger("remat")

CONFIG_NAME = "checkpoint_config.json"
STAGING_PREFIX = ".remat-staging-"
FOLDER_LOCK = ".remat-lock"
_MANIFEST = "COMMIT"
_STAGING_LOCK = "LOCK"
_OURS = (_MANIFEST, _STAGING_LOCK, FOLDER_LOCK)
_READ_ATTEMPTS = 50  # unlocked loads only: how often a load reads again after a commit came in between
_UNLOCKED_STALE_SECONDS = 600.0  # without native locks, recovery drops only staging folders this old


def _take_folder_lock(folder: str, *, shared: bool = False) -> Lock:
    """The folder's lock: exclusive for a commit or recovery, shared for a load's reading."""
    path = os.path.join(folder, FOLDER_LOCK)
    try:
        lock = _take_lock(path, wait=True, remove=True, shared=shared)
    except LockFileError:
        logger.warning("%s: %s is not a regular file, not remat's lock file; removing it", folder, FOLDER_LOCK)
        with contextlib.suppress(FileNotFoundError):  # another process removed it first
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)  # an empty folder; one with files in it is an error naming it
            else:
                os.unlink(path)
        lock = _take_lock(path, wait=True, remove=True, shared=shared)
    assert lock is not None  # waited for it
    return lock


@contextlib.contextmanager
def _reading_lock(folder: str) -> Iterator[Lock]:
    """The folder's shared lock for one load, or its exclusive lock if a crashed commit had to
    be finished first (then the load reads under that)."""
    lock = _take_folder_lock(folder, shared=True)
    try:
        if lock.held and _recover(folder, exclusive=False):
            lock.release()
            lock = _take_folder_lock(folder)
            if lock.held:
                _recover(folder)
        yield lock
    finally:
        lock.release()


_writing = threading.local()
_live: set[str] = set()  # this process's staging folders, from creation to commit


def is_staging(path: str | os.PathLike) -> bool:
    """Whether this thread is writing the staging folder `path` (a save inside a save, e.g. the
    model's `save_pretrained` inside a Trainer checkpoint, writes in place)."""
    return os.path.abspath(os.fspath(path)) in getattr(_writing, "folders", set())


def save_pair(
    target: str | os.PathLike,
    config_text: Callable[[str], str],
    write: Callable[[str], Iterable[str] | None] | None = None,
    *,
    keep: Iterable[str] = (),
    remove: Callable[[], Iterable[str]] | None = None,
) -> list[str]:
    """The one save: `write(staging)` writes the save's files and returns those to commit in
    order (None: all it wrote), `config_text(staging)` returns `checkpoint_config.json`; then all
    is committed into `target`. Files in `keep` that `target` has are not replaced (the user's
    README.md). `remove()` names earlier files to delete once committed, under the same lock
    (`stale_shards`). Returns the relative paths committed."""
    target = os.path.abspath(os.fspath(target))
    os.makedirs(target, exist_ok=True)
    staging, staging_lock = _new_staging(target)
    committing = False
    try:
        folders = _writing.__dict__.setdefault("folders", set())
        folders.add(staging)
        try:
            order = write(staging) if write is not None else None
            write_file_atomically(os.path.join(staging, CONFIG_NAME), config_text(staging))
        finally:
            folders.discard(staging)
        files = [f for f in (order if order is not None else _files_under(staging)) if f != CONFIG_NAME]
        files.append(CONFIG_NAME)
        for relative in files:
            fsync_file(os.path.join(staging, relative))
        with _take_folder_lock(target):
            _recover(target)
            kept = set(keep)
            files = [f for f in files if not (f in kept and os.path.lexists(os.path.join(target, f)))]
            # recovery finishes this commit only if nothing newer replaced those files since
            manifest = [{"path": f, "replaces": _state(os.path.join(target, f))} for f in files]
            write_file_atomically(os.path.join(staging, _MANIFEST), json.dumps({"files": manifest}))
            committing = True  # from here on an interruption is finished by recovery
            _commit(staging, target, files)
            if remove is not None:
                _remove_replaced(target, remove(), set(files))
    except BaseException:
        if not committing:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        _live.discard(staging)
        staging_lock.release()
    return files


def _commit(staging: str, target: str, files: list[str]) -> None:
    folders = {target}
    for relative in files:
        destination = os.path.join(target, relative)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        _rename(os.path.join(staging, relative), destination)
        folders.add(os.path.dirname(destination))
    for folder in folders:
        fsync_folder(folder)
    shutil.rmtree(staging, ignore_errors=True)  # the manifest, the lock and what was not committed


def _remove_replaced(target: str, names: Iterable[str], committed: set[str]) -> None:
    """Remove files of earlier saves from the top of `target` (never one just committed, a
    folder, or remat's own); one that cannot be removed stays, with a warning."""
    removed = False
    for name in names:
        path = os.path.join(target, name)
        if name in committed or os.sep in name or name.startswith(STAGING_PREFIX) or name in _OURS:
            continue
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                os.unlink(path)
                removed = True
        except FileNotFoundError:
            continue
        except OSError as err:
            logger.warning("%s: could not remove %s, a file of an earlier save (%s)", target, name, err)
    if removed:
        fsync_folder(target)


def _rename(source: str, destination: str) -> None:
    """One step of a commit (tests hook it to crash or interleave there)."""
    os.replace(source, destination)


def _new_staging(target: str, attempts: int = 10) -> tuple[str, Lock]:
    """A new staging folder in `target` and its lock, made and locked under the folder's lock, so
    that no recovery ever sees it unlocked (unlocked: its writer died)."""
    for _ in range(attempts):
        with _take_folder_lock(target):
            staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target)
            _live.add(staging)
            try:
                lock = _take_lock(os.path.join(staging, _STAGING_LOCK), wait=True, remove=False)
            except FileNotFoundError:
                _live.discard(staging)
                continue  # removed before its lock file was made
        if lock is not None and (lock.held or os.path.isdir(staging)):
            return staging, lock
        _live.discard(staging)
    raise OSError(f"{target}: could not make a staging folder for the save (other processes removed {attempts})")


def _files_under(folder: str) -> list[str]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(STAGING_PREFIX)]
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names if n not in _OURS]
    return sorted(found)


def _state(path: str) -> list[int] | None:
    """Size and modification time, to tell later whether the file was rewritten."""
    try:
        return list(_version(os.lstat(path)))
    except FileNotFoundError:
        return None


def _version(info: os.stat_result) -> tuple[int, int]:
    return info.st_size, info.st_mtime_ns


def recover(target: str | os.PathLike) -> None:
    """Finish or drop what crashed saves left in `target` (no lock without staging folders)."""
    target = os.path.abspath(os.fspath(target))
    if not os.path.isdir(target) or not any(n.startswith(STAGING_PREFIX) for n in os.listdir(target)):
        return
    with _take_folder_lock(target) as lock:
        if lock.held:
            _recover(target)


def _recover(target: str, *, exclusive: bool = True) -> bool:
    """Called with the folder's lock held. Under a shared lock (`exclusive` False) only staging
    folders are dropped; a crashed commit to finish returns True, to recover again exclusive."""
    for name in sorted(os.listdir(target)):
        staging = os.path.join(target, name)
        if not name.startswith(STAGING_PREFIX) or os.path.islink(staging) or not os.path.isdir(staging):
            continue  # not a staging folder remat made (a link is left alone, never followed)
        if staging in _live:
            continue  # this process is writing it
        try:
            inside = os.listdir(staging)
            age = time.time() - os.lstat(staging).st_mtime
        except OSError:
            continue  # removed meanwhile (another load's recovery), or not ours to read
        empty = not [n for n in inside if n != _STAGING_LOCK]
        try:
            lock = _take_lock(os.path.join(staging, _STAGING_LOCK), wait=False, remove=False)
        except LockFileError:
            logger.warning("%s: dropping %s, which remat did not write (its LOCK is not a regular file)", target, name)
            shutil.rmtree(staging, ignore_errors=True)
            continue
        except OSError:
            continue  # it cannot be locked from here (another account's), or is being removed: leave it
        if lock is None:
            continue  # its writer is alive
        if not lock.held and age < _UNLOCKED_STALE_SECONDS:
            continue  # no native locks: it may be a live writer's
        try:
            if empty:
                logger.debug("%s: removing %s, a save that crashed before writing anything", target, name)
                shutil.rmtree(staging, ignore_errors=True)
                continue
            entries = _read_manifest(staging, target)
            remaining = [e for e in entries or () if os.path.lexists(os.path.join(staging, e["path"]))]
            if entries is None:
                logger.warning(
                    "%s: dropping %s, a save that did not finish (no complete, well-formed manifest)", target, name
                )
            elif any(_state(os.path.join(target, e["path"])) != e["replaces"] for e in remaining):
                logger.warning("%s: a newer save overtook an interrupted one (%s); dropping the older", target, name)
            elif not exclusive:
                return True
            else:
                logger.warning("%s: finishing a save that was interrupted after it was complete on disk", target)
                _commit(staging, target, [e["path"] for e in remaining])
                continue
            shutil.rmtree(staging, ignore_errors=True)
        finally:
            lock.release()
    return False


def _read_manifest(staging: str, target: str) -> list[dict[str, Any]] | None:
    """The manifest's entries, or None if there is none or it is not one remat wrote (a link,
    not JSON, a field missing or mistyped, a path leaving either folder or through a link)."""
    try:
        data = parse_json(read_regular(os.path.join(staging, _MANIFEST), follow_links=False), _MANIFEST)
    except (OSError, ValueError):
        return None
    entries = data.get("files") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    roots = {staging: os.path.realpath(staging), target: os.path.realpath(target)}
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path", "replaces"}:
            return None
        path, replaces = entry["path"], entry["replaces"]
        if replaces is not None and not (
            isinstance(replaces, list)
            and len(replaces) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in replaces)
        ):
            return None
        if not isinstance(path, str) or not path or os.path.isabs(path) or os.path.normpath(path) != path:
            return None
        parts = path.split(os.sep)
        if ".." in parts or parts[0].startswith(STAGING_PREFIX) or parts[-1] in _OURS:
            return None
        for root, real in roots.items():
            parent = os.path.realpath(os.path.dirname(os.path.join(root, path)))
            if parent != real and not parent.startswith(real + os.sep):
                return None
        with contextlib.suppress(FileNotFoundError):  # a file already moved is fine
            if not stat.S_ISREG(os.lstat(os.path.join(staging, path)).st_mode):
                return None
        if not _can_land(target, path):
            return None
    return entries


def _can_land(target: str, path: str) -> bool:
    """Whether a file can be renamed to `path` in `target` (else the commit would fail at every
    recovery, and the folder could never be loaded or saved again)."""
    parts = path.split(os.sep)
    for depth in range(1, len(parts) + 1):
        try:
            mode = os.lstat(os.path.join(target, *parts[:depth])).st_mode
        except FileNotFoundError:
            return True
        if (depth < len(parts) and not stat.S_ISDIR(mode)) or (depth == len(parts) and stat.S_ISDIR(mode)):
            return False
    return True


class Snapshot:
    """What one load read, in place: `config` (the parsed `checkpoint_config.json`, None if
    absent), `locked` (read under the folder's lock) and the regular files it opened, held open
    until the load ends."""

    def __init__(self, folder: str, locked: bool):
        self.folder, self.locked = folder, locked
        self.config: dict[str, Any] | None = None
        self._opened: dict[str, tuple[int, os.stat_result]] = {}
        self._absent: set[str] = set()
        self._closed = False

    def path(self, relative: str) -> str:
        return os.path.join(self.folder, relative)

    name = path  # for messages

    def has(self, relative: str) -> bool:
        return relative in self._opened

    def open(self, relative: str) -> int | None:
        """A descriptor on `relative` if it is a regular file (links followed, as PEFT does), None
        if absent; anything else is a ValueError naming it (PEFT's `open()` could block on it)."""
        if relative in self._opened:
            return self._opened[relative][0]
        if os.path.isabs(relative) or ".." in relative.split(os.sep) or relative in self._absent:
            return None
        try:
            fd = open_regular(self.path(relative))
        except FileNotFoundError:
            self._absent.add(relative)
            return None
        self._opened[relative] = (fd, os.fstat(fd))
        return fd

    def unchanged(self) -> None:
        """Raise `FolderChangedError` if a file read was replaced or rewritten since it was opened, or
        one that was absent appeared (a commit without the lock, another program)."""
        if self._closed:
            return
        for relative, (fd, before) in self._opened.items():
            try:
                now = os.stat(self.path(relative))
            except FileNotFoundError:
                now = None
            after = os.fstat(fd)
            if now is None or not os.path.samestat(now, before) or _version(after) != _version(before):
                raise FolderChangedError(
                    f"{self.name(relative)} was replaced or rewritten while it was being loaded (a save without "
                    "the folder's lock, or another program); load again"
                )
        for relative in self._absent:
            if os.path.lexists(self.path(relative)):
                raise FolderChangedError(
                    f"{self.name(relative)} appeared while the folder was being loaded; load again"
                )

    def close(self) -> None:
        self._closed = True
        opened, self._opened = self._opened, {}
        for fd, _ in opened.values():
            os.close(fd)


@contextlib.contextmanager
def read_pair(
    folder: str | os.PathLike,
    files: Callable[[dict[str, Any] | None], Iterable[str]] = lambda config: (),
    verify: Callable[[Snapshot], Any] = lambda snapshot: None,
) -> Iterator[Snapshot]:
    """The one load, in place: open `checkpoint_config.json` and the files `files(config)` names,
    `verify(snapshot)`, and yield the snapshot with the lock still held, so PEFT reads inside
    the `with` what was verified; checked unchanged on leaving. Unlocked, a `FolderChangedError`
    before the yield reads again."""
    folder = os.path.abspath(os.fspath(folder))
    for attempt in range(1, _READ_ATTEMPTS + 1):
        with _reading_lock(folder) as lock:
            snapshot = Snapshot(folder, lock.held)
            try:
                fd = snapshot.open(CONFIG_NAME)
                if fd is not None:
                    snapshot.config = json_object(_read_all(fd), snapshot.name(CONFIG_NAME))
                for relative in files(snapshot.config):
                    snapshot.open(relative)
                verify(snapshot)
            except FolderChangedError:
                snapshot.close()
                if lock.held or attempt == _READ_ATTEMPTS:
                    raise
                time.sleep(0.01 * attempt)
                continue
            except BaseException:
                snapshot.close()
                raise
            try:
                yield snapshot
                snapshot.unchanged()
            finally:
                snapshot.close()
            return


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)
