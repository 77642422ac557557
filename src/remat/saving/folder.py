"""A folder is a transaction: saves commit whole, in order; loads read one whole save.

This module knows files, not models (it imports nothing from remat above `remat.saving`), so that every save path
(`cm.save_pretrained`, a Trainer / TRL checkpoint, `CheckpointConfig.save_pretrained`) and
every load path (`CheckpointedModel.from_pretrained`, `load_adapter` on Trainer resume,
`CheckpointConfig.from_pretrained`) goes through the same two functions: `save_pair` and
`read_pair`.

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

A load takes the same lock, recovers, and copies the files it needs (the config first, then
the files it names) into a private folder (in the system's temporary folder, which needs room
for one copy of the adapters), then lets go; it checks the copy (fingerprints) and hands PEFT
the copy. So every load returns one whole save, the save that commits last wins
whole, and a load never waits for a save longer than one commit.

A crash before the manifest leaves the folder untouched (the staging folder is dropped by the
next save or load); a crash after it is finished by the next save or load ("rolled forward")
unless a newer save has written those files since. A staging folder whose writer still holds
its `LOCK` is left alone. Recovery never leaves the folder: it follows no symlink (a staging
folder, a `LOCK`, a manifest or a manifest entry that is a link makes the staging folder one
remat did not write: it is dropped), and a manifest that is missing, unreadable or has
missing or mistyped fields is an unfinished save: dropped with one warning.

Files get the permissions any file the process creates gets (the umask), like PEFT's own.

What the lock promises. The lock is `flock` (Unix) or `LockFileEx` (Windows) on
`.remat-lock` inside the folder, through `filelock`. Between processes on one machine it
orders commits and loads exactly. On a network file system it holds across machines only
where the file system passes such locks on (NFSv4; NFSv3 with lockd, where Linux maps
`flock` to byte-range locks); on mounts whose locks are local to each machine (NFS mounted
with `nolock` or `local_lock=all`, some SMB and FUSE mounts) two machines can commit into one
folder at the same moment. A load still never returns a mix: it hands PEFT only bytes whose
fingerprints it checked, and a folder that two machines' commits mixed is refused on load
("the folder mixes two saves") until one of them saves again. Where the folder cannot be
written (another account's folder, a read-only mount) a load takes no lock: it reads, checks,
and reads again if a commit came in between. Where the system has no native locks at all,
saves and loads go on unlocked (one warning says so).
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
from dataclasses import dataclass
from typing import Any

from .files import CLOEXEC, NOFOLLOW, fsync_file, fsync_folder, read_json_object, write_file_atomically
from .locks import Lock, NotOurs
from .locks import take_lock as _take_lock

logger = logging.getLogger("remat")

CONFIG_NAME = "checkpoint_config.json"
STAGING_PREFIX = ".remat-staging-"
FOLDER_LOCK = ".remat-lock"
_MANIFEST = "COMMIT"
_STAGING_LOCK = "LOCK"
_OURS = (_MANIFEST, _STAGING_LOCK, FOLDER_LOCK)
_READ_ATTEMPTS = 50  # unlocked loads only: how often a load reads again after a commit came in between
_UNLOCKED_STALE_SECONDS = 600.0
"""Without native locks a live writer cannot be told from a crashed one: recovery then drops
only staging folders of other processes that nothing has touched for this long."""


class FolderChanged(ValueError):
    """The files a load read do not belong together: a commit came in between (an unlocked
    load reads again), or the folder mixes two saves."""


# -- the folder's lock ------------------------------------------------------------------------------


@contextlib.contextmanager
def _folder_lock(folder: str) -> Iterator[Lock]:
    """The folder's lock, held for one commit or one load's reading."""
    path = os.path.join(folder, FOLDER_LOCK)
    try:
        lock = _take_lock(path, wait=True, remove=True)
    except NotOurs:
        logger.warning("%s: %s is a symlink, not remat's lock file; removing the link", folder, FOLDER_LOCK)
        os.unlink(path)
        lock = _take_lock(path, wait=True, remove=True)
    assert lock is not None  # waited for it
    try:
        yield lock
    finally:
        lock.release()


# -- saving --------------------------------------------------------------------------------------

_writing = threading.local()
_live: set[str] = set()  # this process's staging folders, from creation to commit


def is_staging(path: str | os.PathLike) -> bool:
    """Whether `path` is a staging folder this thread is writing right now (a save inside a
    save, e.g. the model's `save_pretrained` inside a Trainer checkpoint, writes in place)."""
    return os.path.abspath(os.fspath(path)) in getattr(_writing, "folders", set())


def save_pair(
    target: str | os.PathLike,
    config_text: Callable[[str], str],
    write: Callable[[str], Iterable[str] | None] | None = None,
    *,
    keep: Iterable[str] = (),
    remove: Callable[[], Iterable[str]] | None = None,
) -> list[str]:
    """The one save: `write(staging)` writes the save's other files (PEFT's adapters, a
    Trainer's files), `config_text(staging)` returns `checkpoint_config.json` (it may
    fingerprint what `write` wrote); then all of it is committed into `target` as the module
    docstring says. `write` returns the files (relative paths) to commit in order, or None for
    everything it wrote. Files named in `keep` are not committed if `target` already has them
    (the user's own README.md). `remove()` names files of earlier saves in `target` that go
    once this save is committed, under the same lock (the stale shards transformers' own save
    removes: `remat.saving.stale_shards`); a crash before they go leaves them beside the whole
    new save. Returns the relative paths committed."""
    target = os.path.abspath(os.fspath(target))
    os.makedirs(target, exist_ok=True)
    staging, staging_lock = _new_staging(target)
    _live.add(staging)
    try:
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
            with _folder_lock(target):
                _recover(target)
                kept = set(keep)
                files = [f for f in files if not (f in kept and os.path.lexists(os.path.join(target, f)))]
                # Each file with the state of the one it replaces, taken under the lock: recovery
                # finishes this commit only if nothing newer was written there since.
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
    """Remove files of earlier saves from the top of `target` (never one this save committed,
    a folder, or remat's own); one that cannot be removed is left with a warning (the save is
    committed)."""
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
    """A new staging folder in `target` and its lock. Until it is locked the folder looks like a
    crashed save to another process's recovery, which may remove it; then another is made."""
    for _ in range(attempts):
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target)
        try:
            lock = _take_lock(os.path.join(staging, _STAGING_LOCK), wait=True, remove=False)
        except FileNotFoundError:
            continue  # removed before its lock file was made
        if lock is not None and (lock.held or os.path.isdir(staging)):
            return staging, lock
    raise OSError(f"{target}: could not make a staging folder for the save (other processes removed {attempts})")


def _files_under(folder: str) -> list[str]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(STAGING_PREFIX)]
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names if n not in _OURS]
    return sorted(found)


def _state(path: str) -> list[int] | None:
    """What a file is, to tell later whether it was rewritten: size and modification time."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return [info.st_size, info.st_mtime_ns]


# -- recovery ------------------------------------------------------------------------------------


def recover(target: str | os.PathLike) -> None:
    """Finish or drop what crashed saves left in `target`, under the folder's lock (a folder
    without staging folders is not touched: no lock is taken)."""
    target = os.path.abspath(os.fspath(target))
    if not os.path.isdir(target) or not any(n.startswith(STAGING_PREFIX) for n in os.listdir(target)):
        return
    with _folder_lock(target) as lock:
        if lock.held:
            _recover(target)


def _recover(target: str) -> None:
    """Called with the folder's lock held: no commit runs meanwhile, and no staging folder of a
    live writer has a manifest (manifests are written under the lock)."""
    for name in sorted(os.listdir(target)):
        staging = os.path.join(target, name)
        if not name.startswith(STAGING_PREFIX) or os.path.islink(staging) or not os.path.isdir(staging):
            continue  # not a staging folder remat made (a link is left alone, never followed)
        if staging in _live:
            continue  # this process is writing it
        try:
            lock = _take_lock(os.path.join(staging, _STAGING_LOCK), wait=False, remove=False)
        except NotOurs:
            logger.warning("%s: dropping %s, which remat did not write (its LOCK is a symlink)", target, name)
            shutil.rmtree(staging, ignore_errors=True)
            continue
        except OSError:
            continue  # it cannot be locked from here (another account's): leave it
        if lock is None:
            continue  # its writer is alive
        if not lock.held and time.time() - os.lstat(staging).st_mtime < _UNLOCKED_STALE_SECONDS:
            continue  # no native locks: it may be a live writer's
        try:
            entries = _read_manifest(staging, target)
            remaining = [e for e in entries or () if os.path.lexists(os.path.join(staging, e["path"]))]
            if entries is None:
                logger.warning(
                    "%s: dropping %s, a save that did not finish (no complete, well-formed manifest)", target, name
                )
            elif any(_state(os.path.join(target, e["path"])) != e["replaces"] for e in remaining):
                logger.warning("%s: a newer save overtook an interrupted one (%s); dropping the older", target, name)
            else:
                logger.warning("%s: finishing a save that was interrupted after it was complete on disk", target)
                _commit(staging, target, [e["path"] for e in remaining])
                continue
            shutil.rmtree(staging, ignore_errors=True)
        finally:
            lock.release()


def _read_manifest(staging: str, target: str) -> list[dict[str, Any]] | None:
    """The manifest's entries, or None if there is none (the save never completed) or it is not
    one remat wrote: a link, not JSON, a field missing or of another type, a path that leaves
    the staging or the target folder or goes through a link."""
    try:
        fd = os.open(os.path.join(staging, _MANIFEST), os.O_RDONLY | NOFOLLOW | CLOEXEC)
        with os.fdopen(fd, encoding="utf-8") as handle:
            data = json.load(handle)
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
    return entries


# -- loading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """What one load read: `folder` (the folder, for messages), `copy` (a private folder holding
    the files read, same layout), `config` (the parsed `checkpoint_config.json`, None if
    absent), `locked` (read under the folder's lock)."""

    folder: str
    copy: str
    config: dict[str, Any] | None
    locked: bool

    def path(self, relative: str) -> str:
        return os.path.join(self.copy, relative)

    def has(self, relative: str) -> bool:
        return os.path.isfile(self.path(relative))

    def name(self, relative: str) -> str:
        """The file's path in the folder, for messages."""
        return os.path.join(self.folder, relative)


@contextlib.contextmanager
def read_pair(
    folder: str | os.PathLike,
    files: Callable[[dict[str, Any] | None], Iterable[str]] = lambda config: (),
    verify: Callable[[Snapshot], Any] = lambda snapshot: None,
) -> Iterator[Snapshot]:
    """The one load: under the folder's lock, recover, then copy `checkpoint_config.json` and the
    files `files(config)` names into a private folder; let go; `verify(snapshot)` (which raises
    `FolderChanged` for bytes that do not belong together). Yields the snapshot, whose files
    are what was verified. Without the lock (a folder this process cannot write), a
    `FolderChanged` reads again."""
    folder = os.path.abspath(os.fspath(folder))
    for attempt in range(1, _READ_ATTEMPTS + 1):
        with tempfile.TemporaryDirectory(prefix="remat-load-", ignore_cleanup_errors=True) as copy:
            with _folder_lock(folder) as lock:
                if lock.held:
                    _recover(folder)
                config = None
                if _copy_in(folder, copy, CONFIG_NAME):
                    config = read_json_object(os.path.join(copy, CONFIG_NAME), os.path.join(folder, CONFIG_NAME))
                for relative in files(config):
                    _copy_in(folder, copy, relative)
            snapshot = Snapshot(folder, copy, config, lock.held)
            try:
                verify(snapshot)
            except FolderChanged:
                if lock.held or attempt == _READ_ATTEMPTS:
                    raise
                time.sleep(0.01 * attempt)
                continue
            yield snapshot
            return


def _copy_in(folder: str, copy: str, relative: str) -> bool:
    source = os.path.join(folder, relative)
    if os.path.isabs(relative) or ".." in relative.split(os.sep) or not os.path.isfile(source):
        return False
    destination = os.path.join(copy, relative)
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    try:
        shutil.copyfile(source, destination)
    except FileNotFoundError:
        return False
    return True
