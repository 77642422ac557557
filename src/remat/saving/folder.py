"""A folder is a transaction: saves commit whole, in order; loads read one whole save (README, "Saving, loading,
Trainer"). A save writes into a staging folder inside the target (one file system; made and its `LOCK` taken under
the folder's lock, so recovery never takes a live writer for a dead one), the config last. Then, under the folder's
lock, crashed saves are recovered, a manifest (`COMMIT`) names the files and the state of those they replace, and
each is renamed into place: a crash before the manifest leaves the folder as it was, after it recovery finishes the
commit unless a newer save overtook it. A load takes the lock shared and checks the files in place where PEFT reads
them; unlocked (a folder it cannot write) it reads again if a commit came in between. Recovery never leaves the
folder: a link or non-regular file where a `LOCK`, manifest or entry goes, or a bad manifest, drops that staging.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import ConfigError, ConfigTypeError, FolderAccessError, FolderChangedError, LockFileError, RematError
from .files import Lock, fsync_folder, json_object, open_regular, read_json_object, write_file_atomically
from .files import take_lock as _take_lock

logger = logging.getLogger("remat")

CONFIG_NAME = "checkpoint_config.json"
STAGING_PREFIX = ".remat-staging-"
FOLDER_LOCK = ".remat-lock"
_MANIFEST = "COMMIT"
_STAGING_LOCK = "LOCK"
_OURS = (_MANIFEST, _STAGING_LOCK, FOLDER_LOCK)
_READ_ATTEMPTS = 50  # unlocked loads only: how often a load reads again after a commit came in between
_UNLOCKED_STALE_SECONDS = 600.0  # without native locks, recovery drops only staging folders this old
_SHARD_LIKE = re.compile(r"-\d{5}-of-\d{5}")  # transformers only ever removes such files


def _take_folder_lock(folder: str, *, shared: bool = False) -> Lock:
    """The folder's lock: exclusive for a commit or recovery, shared for a load's reading."""
    path = os.path.join(folder, FOLDER_LOCK)
    try:
        lock = _take_lock(path, wait=True, remove=True, shared=shared)
    except LockFileError:
        try:
            (os.rmdir if os.path.isdir(path) and not os.path.islink(path) else os.unlink)(path)  # a folder if empty
        except FileNotFoundError:
            pass  # another process removed it first
        except OSError as err:  # a folder with files in it, or a folder this process cannot write
            why = f"not remat's lock file, and remat cannot remove it ({err.strerror}): remove it yourself"
            raise LockFileError(err.errno, why, path) from None
        else:
            logger.warning("%s: %s was not a regular file, not remat's lock file; removed it", folder, FOLDER_LOCK)
        lock = _take_lock(path, wait=True, remove=True, shared=shared)
    assert lock is not None  # waited for it
    return lock


@contextlib.contextmanager
def _reading_lock(folder: str) -> Iterator[Lock]:
    """The folder's shared lock for one load; exclusive if a crashed commit had to be finished first."""
    with _os_refusal("load from", folder, "load from a folder you can read; nothing was loaded"):
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


@contextlib.contextmanager
def _os_refusal(doing: str, folder: str, fix: str) -> Iterator[None]:
    """The OS refusing remat's own files in `folder` (no permission, a read-only mount), said as the user's folder and
    `fix`: the OS's error named the hidden staging folder or lock file, which the user never made."""
    try:
        yield
    except OSError as err:
        if isinstance(err, RematError) or not (isinstance(err, PermissionError) or err.errno == errno.EROFS):
            raise  # anything else (a full disk) is the OS's own error, with its own path
        raise FolderAccessError(err.errno, f"cannot {doing} {folder}: {err.strerror or err}; {fix}") from None


_writing = threading.local()
_live: set[str] = set()  # this process's staging folders, from creation to commit


def is_staging(path: str | os.PathLike) -> bool:
    """Whether this thread writes the staging folder `path` (a save inside one, as in a Trainer checkpoint)."""
    return os.path.abspath(os.fspath(path)) in getattr(_writing, "folders", set())


def save_folder(target: object) -> str:
    """The absolute folder a save was given: a str or a path, not empty (refused before anything is written)."""
    if not isinstance(target, (str, os.PathLike)):
        raise ConfigTypeError(f"save_pretrained needs a folder (a str or a path), got {target!r}")
    if os.fspath(target) == "":
        raise ConfigError("save_pretrained needs a folder, got an empty path; pass '.' for the current directory")
    return os.path.abspath(os.fspath(target))


def save_pair(
    target: str | os.PathLike,
    config_text: Callable[[str], str],
    write: Callable[[str], object] | None = None,
    *,
    keep: tuple[str, ...] = (),
    stale_shards: bool = False,
) -> list[str]:
    """`write(staging)` writes the files, `config_text(staging)` returns the config; all is committed into
    `target` but files in `keep` it has. `stale_shards`: `write` is transformers' full-model save."""
    target = save_folder(target)
    made, folder = [], target  # the folders this save makes, the target first
    while not os.path.lexists(folder):
        made, folder = [*made, folder], os.path.dirname(folder)
    if not os.path.isdir(folder):
        kind = "a file" if os.path.isfile(folder) else "not a folder"
        within = "" if folder == target else f" (on the way to {target})"
        raise ConfigError(f"save_pretrained needs a folder, but {folder} is {kind}{within}: pass a folder")
    try:
        with _os_refusal("save into", target, "save to a folder you can write to; nothing was written"):
            staging, staging_lock = _staging_in_new_or_old(target)
    except BaseException:
        _remove_made(made)
        raise
    committing = False
    try:
        folders = _writing.__dict__.setdefault("folders", set())
        folders.add(staging)
        try:
            with _shard_stand_ins(staging) if stale_shards else contextlib.nullcontext([]) as replaced:
                if write is not None:
                    write(staging)
            write_file_atomically(os.path.join(staging, CONFIG_NAME), config_text(staging))
        finally:
            folders.discard(staging)
        files = [f for f in _files_under(staging) if f != CONFIG_NAME] + [CONFIG_NAME]
        for relative in files:
            with os.fdopen(open_regular(os.path.join(staging, relative)), "rb") as handle:
                os.fsync(handle.fileno())
        with _take_folder_lock(target):
            _recover(target)
            files = [f for f in files if not (f in keep and os.path.lexists(os.path.join(target, f)))]
            # recovery finishes this commit only if nothing newer replaced those files since
            manifest = [{"path": f, "replaces": _state(os.path.join(target, f))} for f in files]
            write_file_atomically(os.path.join(staging, _MANIFEST), json.dumps({"files": manifest}))
            committing = True  # from here on an interruption is finished by recovery
            _commit(staging, target, files)
            _remove_replaced(target, replaced, set(files))
    except BaseException:
        if not committing:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        _live.discard(staging)
        staging_lock.release()
        if not committing:
            _remove_made(made)
    return files


def _staging_in_new_or_old(target: str, attempts: int = 5) -> tuple[str, Lock]:
    """`target` made if need be, and a staging folder in it. Another save into it, refused meanwhile, may remove the
    folder it made (empty) between the two: made again."""
    for _ in range(attempts - 1):
        with contextlib.suppress(FileNotFoundError):
            os.makedirs(target, exist_ok=True)
            return _new_staging(target)
    os.makedirs(target, exist_ok=True)
    return _new_staging(target)


def _remove_made(made: list[str]) -> None:
    """A refused save leaves no folder of its own behind: each it made, the deepest first, if still empty (another
    writer's files stay)."""
    for folder in made:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


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


def _remove_replaced(target: str, names: list[str], committed: set[str]) -> None:
    """Remove the earlier save's files `names` from `target` (never one just committed, nor a folder)."""
    for name in sorted(set(names) - committed):
        path = os.path.join(target, name)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as err:
            logger.warning("%s: could not remove %s, a file of an earlier save (%s)", target, name, err)
    if names:
        fsync_folder(target)


def _rename(source: str, destination: str) -> None:
    """One step of a commit (tests hook it to crash or interleave there)."""
    os.replace(source, destination)


def _new_staging(target: str, attempts: int = 10) -> tuple[str, Lock]:
    """A new staging folder in `target` and its lock, both made under the folder's lock (see above)."""
    for _ in range(attempts):
        with _take_folder_lock(target):
            staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target)
            _live.add(staging)
            with contextlib.suppress(FileNotFoundError):  # removed before its lock file was made: again
                lock = _take_lock(os.path.join(staging, _STAGING_LOCK), wait=True, remove=False)
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
    with contextlib.suppress(FileNotFoundError):
        return _version(os.lstat(path))
    return None


def _version(info: os.stat_result) -> list[int]:
    return [info.st_size, info.st_mtime_ns]


def recover(target: str | os.PathLike) -> None:
    """Finish or drop what crashed saves left in `target` (no lock without staging folders)."""
    target = os.path.abspath(os.fspath(target))
    if os.path.isdir(target) and any(n.startswith(STAGING_PREFIX) for n in os.listdir(target)):
        with _take_folder_lock(target) as lock:
            if lock.held:
                _recover(target)


def _recover(target: str, *, exclusive: bool = True) -> bool:
    """Under the folder's lock; shared (`exclusive` False), a crashed commit to finish returns True."""
    for name in sorted(os.listdir(target)):
        staging = os.path.join(target, name)
        made_by_remat = name.startswith(STAGING_PREFIX) and not os.path.islink(staging) and os.path.isdir(staging)
        if not made_by_remat or staging in _live:
            continue  # not a staging folder remat made (a link is never followed), or one this process writes
        try:
            empty = set(os.listdir(staging)) <= {_STAGING_LOCK}
            age = time.time() - os.lstat(staging).st_mtime
            lock = _take_lock(os.path.join(staging, _STAGING_LOCK), wait=False, remove=False)
        except LockFileError:
            logger.warning("%s: dropping %s, which remat did not write (its LOCK is not a regular file)", target, name)
            shutil.rmtree(staging, ignore_errors=True)
            continue
        except OSError:
            continue  # removed meanwhile (another recovery), or another account's, which cannot be locked here
        if lock is None or (not lock.held and age < _UNLOCKED_STALE_SECONDS):
            continue  # its writer is alive (without native locks: may be, unless it is this old)
        with lock:
            entries = [] if empty else _read_manifest(staging, target)
            remaining = [e for e in entries or () if os.path.lexists(os.path.join(staging, e["path"]))]
            if empty:
                logger.debug("%s: removing %s, a save that crashed before writing anything", target, name)
            elif entries is None:
                logger.warning("%s: dropping %s, a save that did not finish (no well-formed manifest)", target, name)
            elif any(_state(os.path.join(target, e["path"])) != e["replaces"] for e in remaining):
                logger.warning("%s: a newer save overtook an interrupted one (%s); dropping the older", target, name)
            elif not exclusive:
                return True
            else:
                logger.warning("%s: finishing a save that was interrupted after it was complete on disk", target)
                _commit(staging, target, [e["path"] for e in remaining])
                continue
            shutil.rmtree(staging, ignore_errors=True)
    return False


def _read_manifest(staging: str, target: str) -> list[dict[str, Any]] | None:
    """The manifest's entries, or None if there is none or it is not one remat wrote."""
    try:
        entries = read_json_object(os.path.join(staging, _MANIFEST), follow_links=False)["files"]
    except (OSError, ValueError, KeyError):
        return None
    return entries if isinstance(entries, list) and all(_well_formed(e, staging, target) for e in entries) else None


def _well_formed(entry: Any, staging: str, target: str) -> bool:
    """A path leaving neither folder (nor through a link) to a regular file that can land (else recoveries fail)."""
    if not isinstance(entry, dict) or set(entry) != {"path", "replaces"}:
        return False
    path, replaces = entry["path"], entry["replaces"]
    if replaces is not None and not (isinstance(replaces, list) and [type(v) for v in replaces] == [int, int]):
        return False
    if not isinstance(path, str) or not path or os.path.isabs(path) or os.path.normpath(path) != path:
        return False
    parts = path.split(os.sep)
    if ".." in parts or parts[0].startswith(STAGING_PREFIX) or parts[-1] in _OURS:
        return False
    for root in (staging, target):
        real, parent = os.path.realpath(root), os.path.realpath(os.path.dirname(os.path.join(root, path)))
        if parent != real and not parent.startswith(real + os.sep):
            return False
    with contextlib.suppress(FileNotFoundError):  # a file already moved is fine
        if not stat.S_ISREG(os.lstat(os.path.join(staging, path)).st_mode):
            return False
    for depth in range(1, len(parts) + 1):  # in `target`, each parent a folder (or missing), the file none
        try:
            mode = os.lstat(os.path.join(target, *parts[:depth])).st_mode
        except FileNotFoundError:
            return True
        if stat.S_ISDIR(mode) != (depth < len(parts)):
            return False
    return True


class Snapshot:
    """What one load read, in place: `config` (None if absent), `locked`, and the files it holds open."""

    def __init__(self, folder: str, locked: bool):
        self.folder, self.locked = folder, locked
        self.config: dict[str, Any] | None = None
        self._opened: dict[str, tuple[int, os.stat_result]] = {}
        self._absent: set[str] = set()

    def path(self, relative: str) -> str:
        return os.path.join(self.folder, relative)

    def has(self, relative: str) -> bool:
        return relative in self._opened

    def open(self, relative: str) -> int | None:
        """A descriptor on the regular file `relative` (links followed, as PEFT does), None if absent; anything else
        is an error naming it (PEFT's `open()` could block on it)."""
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
        """Raise `FolderChangedError` if a file read was replaced or rewritten, or an absent one appeared."""
        for relative, (fd, before) in self._opened.items():
            with contextlib.suppress(FileNotFoundError):
                now = os.stat(self.path(relative))
                if os.path.samestat(now, before) and _version(os.fstat(fd)) == _version(before):
                    continue
            raise FolderChangedError(
                f"{self.path(relative)} was replaced or rewritten while it was being loaded (a save without "
                "the folder's lock, or another program); load again"
            )
        if appeared := [r for r in self._absent if os.path.lexists(self.path(r))]:
            raise FolderChangedError(f"{self.path(appeared[0])} appeared while the folder was being loaded; load again")

    def close(self) -> None:
        opened, self._opened, self._absent = self._opened, {}, set()
        for fd, _ in opened.values():
            os.close(fd)


@contextlib.contextmanager
def read_pair(
    folder: str | os.PathLike,
    files: Callable[[dict[str, Any] | None], Iterable[str]] = lambda config: (),
    verify: Callable[[Snapshot], Any] = lambda snapshot: None,
) -> Iterator[Snapshot]:
    """Open the config and the files `files(config)` names, `verify(snapshot)`, and yield it with the lock
    held, so PEFT reads what was verified. Unlocked, a `FolderChangedError` before the yield reads again."""
    folder = os.path.abspath(os.fspath(folder))
    for attempt in range(1, _READ_ATTEMPTS + 1):
        with _reading_lock(folder) as lock, contextlib.closing(Snapshot(folder, lock.held)) as snapshot:
            try:
                if (fd := snapshot.open(CONFIG_NAME)) is not None:
                    with os.fdopen(os.dup(fd), "rb") as handle:  # the descriptor's offset is still 0
                        snapshot.config = json_object(handle.read(), snapshot.path(CONFIG_NAME))
                for relative in files(snapshot.config):
                    snapshot.open(relative)
                verify(snapshot)
            except FolderChangedError:
                if lock.held or attempt == _READ_ATTEMPTS:
                    raise
                time.sleep(0.01 * attempt)
                continue
            yield snapshot
            snapshot.unchanged()
            return


@contextlib.contextmanager
def _shard_stand_ins(staging: str) -> Iterator[list[str]]:
    """transformers' `save_pretrained` removes an earlier save's shards it does not rewrite; staged, it
    would see none. So each gets an empty stand-in; the list yielded names, after it, those removed."""
    target, removed = os.path.dirname(staging), []
    shards = [n for n in os.listdir(target) if _SHARD_LIKE.search(n) and not n.startswith(STAGING_PREFIX)]
    shards = [n for n in shards if os.path.isfile(os.path.join(target, n))]
    for name in shards:
        open(os.path.join(staging, name), "xb").close()
    try:
        yield removed
    finally:
        removed += [n for n in shards if not os.path.lexists(os.path.join(staging, n))]
        for name in shards:  # the stand-ins transformers left
            path = os.path.join(staging, name)
            with contextlib.suppress(FileNotFoundError):
                if (info := os.lstat(path)).st_size == 0 and stat.S_ISREG(info.st_mode):
                    os.unlink(path)
