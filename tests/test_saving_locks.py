"""The folder lock where file systems and accounts make it awkward: a lock file made by another
account (opened read-only, locked all the same), and file systems without native locks (every
errno flock uses for that: the save and the load go ahead, with one warning)."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from remat import CheckpointConfig
from remat.saving import files


def _refuse_write_opens_of(path, monkeypatch):
    """Play a lock file that another account made (0644): as root every open succeeds, so the
    EACCES a second account gets for O_RDWR is injected; read-only opens go through."""
    real_open = os.open

    def fake_open(name, flags, *args):
        if os.fspath(name) == path and flags & os.O_RDWR:
            raise PermissionError(errno.EACCES, "Permission denied", name)
        return real_open(name, flags, *args)

    monkeypatch.setattr(files.os, "open", fake_open)


def test_a_lock_file_another_account_made_is_locked_read_only_and_still_excludes(tmp_path, monkeypatch):
    path = str(tmp_path / ".remat-lock")
    open(path, "w").close()
    _refuse_write_opens_of(path, monkeypatch)
    first = files.take_lock(path, wait=True, remove=False)
    assert first is not None and first.held
    assert files.take_lock(path, wait=False, remove=False) is None  # the second waits its turn
    first.release()
    again = files.take_lock(path, wait=False, remove=False)
    assert again is not None and again.held
    again.release()


@pytest.mark.parametrize("code", ["ENOSYS", "ENOLCK", "EOPNOTSUPP", "EINVAL"])
def test_without_native_locks_a_save_and_a_load_go_ahead_with_one_warning(tmp_path, monkeypatch, caplog, code):
    def no_locks(*args, **kwargs):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(files.filelock, "lock_descriptor", no_locks)
    monkeypatch.setattr(files, "_warned_no_locks", False)
    with caplog.at_level(logging.WARNING, logger="remat"):
        CheckpointConfig(every_n_layers=3).save_pretrained(tmp_path)
        assert CheckpointConfig.from_pretrained(tmp_path).every_n_layers == 3
        CheckpointConfig(every_n_layers=2).save_pretrained(tmp_path)
        assert CheckpointConfig.from_pretrained(tmp_path).every_n_layers == 2
    said = [r.getMessage() for r in caplog.records if "no file locks" in r.getMessage()]
    assert len(said) == 1, said


def test_any_other_lock_error_is_raised(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(files.filelock, "lock_descriptor", broken)
    with pytest.raises(OSError, match="I/O error"):
        CheckpointConfig(every_n_layers=3).save_pretrained(tmp_path)
