"""File helpers for saves that lose nothing: atomic writes, staged commits, strict JSON reads.

A save writes only its own files into the folder it is given, and never deletes or moves
anything else there (a training log, `checkpoint-500/`, the user's README). A crash at any
moment leaves either the previous save or the new one, never a mix:

1. every file of the save is written into a staging folder inside the target folder
   (`.remat-staging-<host>-<pid>-<random>/`), so the final renames stay on one file system;
2. once all of them are on disk, a manifest (`COMMIT`) naming them is written there, atomically;
3. each file is renamed into place; then the staging folder, which holds nothing else, goes.

A crash before step 2 leaves the target untouched (the staging folder is dropped by the next
save or load); a crash after it is finished by the next save or load ("rolled forward"), which
moves the remaining files into place. A staging folder whose writer is still alive (another
process on this host saving right now) is left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger("remat")

STAGING_PREFIX = ".remat-staging-"
_MANIFEST = "COMMIT"
_FOREIGN_STAGING_AGE = 3600  # seconds


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
    staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{_writer_id()}-", dir=target)
    try:
        order = write(staging)
        files = list(order) if order is not None else _files_under(staging)
        keep = set(keep)
        files = [f for f in files if not (f in keep and os.path.exists(os.path.join(target, f)))]
        for relative in files:
            _fsync_file(os.path.join(staging, relative))
        write_json_atomically(os.path.join(staging, _MANIFEST), json.dumps({"files": files}))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _commit(staging, target, files)
    return files


def recover_staging(target: str) -> None:
    """Finish the commits and drop the half-written stagings that crashed saves left in `target`."""
    if not os.path.isdir(target):
        return
    for name in sorted(os.listdir(target)):
        staging = os.path.join(target, name)
        if not (name.startswith(STAGING_PREFIX) and os.path.isdir(staging)) or _writer_alive(staging):
            continue
        manifest = os.path.join(staging, _MANIFEST)
        if os.path.isfile(manifest):
            try:
                with open(manifest, encoding="utf-8") as handle:
                    files = json.load(handle)["files"]
            except (OSError, ValueError, KeyError, TypeError):
                files = None  # a manifest is written atomically: unreadable means not ours
            if files is not None:
                logger.warning("%s: finishing a save that was interrupted after it was complete on disk", target)
                _commit(staging, target, [f for f in files if os.path.exists(os.path.join(staging, f))])
                continue
        logger.warning("%s: removing the staging folder of a save that was interrupted (%s)", target, name)
        shutil.rmtree(staging, ignore_errors=True)


def _commit(staging: str, target: str, files: list[str]) -> None:
    folders = {target}
    for relative in files:
        destination = os.path.join(target, relative)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        os.replace(os.path.join(staging, relative), destination)
        folders.add(os.path.dirname(destination))
    for folder in folders:
        _fsync_folder(folder)
    shutil.rmtree(staging, ignore_errors=True)  # the manifest and what was not committed (kept files)


def _files_under(folder: str) -> list[str]:
    from .config import CONFIG_NAME

    found = []
    for root, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(found, key=lambda f: (f == CONFIG_NAME, f))


def _writer_id() -> str:
    return f"{socket.gethostname().replace('-', '_')}-{os.getpid()}"


def _writer_alive(staging: str) -> bool:
    """Whether the process that made this staging folder may still be writing into it: on this
    host, whether that process runs; from another host (a shared file system), whether the
    folder changed in the last hour."""
    parts = os.path.basename(staging)[len(STAGING_PREFIX) :].split("-")
    if len(parts) < 3 or not parts[1].isdigit():
        return False
    if parts[0] != socket.gethostname().replace("-", "_"):
        with contextlib.suppress(OSError):
            return time.time() - os.stat(staging).st_mtime < _FOREIGN_STAGING_AGE
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False  # this process is not saving into it now: it is left from an earlier save
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
