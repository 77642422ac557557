"""File helpers for saves that lose nothing: atomic writes, staged commits, strict JSON reads.

A save writes only its own files into the folder it is given, and never deletes or moves
anything else there (a training log, `checkpoint-500/`, the user's README). A crash at any
moment leaves either the previous save or the new one, never a mix:

1. every file of the save is written into a staging folder inside the target folder
   (`.remat-staging-<random>/`, locked by its writer), so the final renames stay on one file system;
2. once all of them are on disk, a manifest (`COMMIT`) naming them is written there, atomically;
3. each file is renamed into place; then the staging folder, which holds nothing else, goes.

A crash before step 2 leaves the target untouched (the staging folder is dropped by the next
save or load); a crash after it is finished by the next save or load ("rolled forward"), which
moves the remaining files into place, unless a newer save has written them since. A staging
folder whose writer is still alive (it holds the folder's lock) is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger("remat")

STAGING_PREFIX = ".remat-staging-"
_MANIFEST = "COMMIT"
_LOCK = "LOCK"


def write_json_atomically(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and one rename."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
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
    _fsync_folder(folder)


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


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def staged_save(target: str, write: Callable[[str], Iterable[str] | None], *, keep: Iterable[str] = ()) -> list[str]:
    """Run `write(staging_folder)`, then commit what it wrote into `target` as described above.

    `write` returns the files (relative paths) to commit in order, or None for everything it
    wrote (the order then puts `checkpoint_config.json` last). Files named in `keep` are not
    committed if `target` already has them (the user's own README.md, say). Returns the
    relative paths committed.
    """
    os.makedirs(target, exist_ok=True)
    recover_staging(target)
    staging, lock = _new_staging(target)  # the lock is held until the commit is done
    try:
        try:
            order = write(staging)
            files = list(order) if order is not None else _files_under(staging)
            keep = set(keep)
            files = [f for f in files if not (f in keep and os.path.exists(os.path.join(target, f)))]
            for relative in files:
                _fsync_file(os.path.join(staging, relative))
            # Each file with the state of the one it replaces: recovery finishes this commit only
            # if nothing newer was written there since (see `recover_staging`).
            manifest = [{"path": f, "replaces": _state(os.path.join(target, f))} for f in files]
            write_json_atomically(os.path.join(staging, _MANIFEST), json.dumps({"files": manifest}))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _commit(staging, target, files)
    finally:
        lock.close()
    return files


def recover_staging(target: str) -> None:
    """Finish the commits and drop the half-written stagings that crashed saves left in `target`.

    A staging folder is left alone while its writer lives (it holds the folder's lock: another
    process, or another thread of this one). A commit is finished only if the files it was
    about to replace are still the ones it saw; if a newer save has written there since, the
    older one is dropped.
    """
    if not os.path.isdir(target):
        return
    for name in sorted(os.listdir(target)):
        staging = os.path.join(target, name)
        if not name.startswith(STAGING_PREFIX) or os.path.islink(staging) or not os.path.isdir(staging):
            continue
        try:
            lock = _lock(staging, wait=False)
        except OSError:
            continue  # another writer holds it, or the folder cannot be written: leave it
        try:
            entries = _read_manifest(staging, target)
            remaining = [e for e in entries or () if os.path.lexists(os.path.join(staging, e["path"]))]
            if entries is None:
                logger.warning("%s: removing the staging folder of a save that was interrupted (%s)", target, name)
            elif any(_state(os.path.join(target, e["path"])) != e["replaces"] for e in remaining):
                logger.warning("%s: a newer save overtook an interrupted one (%s); dropping the older", target, name)
            else:
                logger.warning("%s: finishing a save that was interrupted after it was complete on disk", target)
                _commit(staging, target, [e["path"] for e in remaining])
                continue
            shutil.rmtree(staging, ignore_errors=True)
        finally:
            lock.close()


def _read_manifest(staging: str, target: str) -> list[dict[str, Any]] | None:
    """The manifest's entries, or None if there is none (the save never completed) or it is
    not one remat wrote: every path must stay inside the staging and target folders."""
    try:
        with open(os.path.join(staging, _MANIFEST), encoding="utf-8") as handle:
            entries = json.load(handle)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(entries, list):
        return None
    roots = [os.path.realpath(staging), os.path.realpath(target)]
    for entry in entries:
        path = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(path, str) or os.path.isabs(path) or os.path.normpath(path) != path:
            return None
        if ".." in path.split(os.sep) or path.startswith(STAGING_PREFIX) or os.path.islink(os.path.join(staging, path)):
            return None
        for root in roots:
            if not os.path.realpath(os.path.join(root, path)).startswith(root + os.sep):
                return None
    return entries


def _commit(staging: str, target: str, files: list[str]) -> None:
    folders = {target}
    for relative in files:
        destination = os.path.join(target, relative)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        os.replace(os.path.join(staging, relative), destination)
        folders.add(os.path.dirname(destination))
    for folder in folders:
        _fsync_folder(folder)
    shutil.rmtree(staging, ignore_errors=True)  # the manifest, the lock and what was not committed


def _state(path: str) -> list[int] | None:
    """What a file is, to tell later whether it was rewritten: size and modification time."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return [stat.st_size, stat.st_mtime_ns]


def _files_under(folder: str) -> list[str]:
    from .config import CONFIG_NAME

    found = []
    for root, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    found = [f for f in found if f not in (_MANIFEST, _LOCK)]
    return sorted(found, key=lambda f: (f == CONFIG_NAME, f))


def _new_staging(target: str, attempts: int = 10) -> tuple[str, Any]:
    """A new staging folder in `target` and its lock. Until it is locked the folder looks like a
    crashed save to another process's `recover_staging`, which may remove it; then another is made."""
    for _ in range(attempts):
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target)
        try:
            lock = _lock(staging, wait=True)
        except FileNotFoundError:
            continue  # removed before its lock file was made
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(lock.fileno()), os.stat(os.path.join(staging, _LOCK))):
                return staging, lock
        lock.close()  # removed while we waited for its lock: the file we hold is gone
    raise OSError(f"{target}: could not make a staging folder for the save (other processes removed {attempts})")


def _lock(staging: str, *, wait: bool) -> Any:
    """An exclusive lock on the staging folder's lock file (raises OSError if `wait` is False
    and someone holds it). Closing the returned file releases it; so does the holder's death."""
    handle = open(os.path.join(staging, _LOCK), "a+b")  # noqa: SIM115 - held across the commit
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BaseException:
        handle.close()
        raise
    return handle


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(path: str) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
