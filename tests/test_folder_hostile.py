"""Nothing in a folder can make a save or a load wait, fail forever or cry wolf (issue 25):
FIFOs and other non-files where remat's files go, JSON nested 200,000 deep, and a save and a
load running side by side, which is not a crashed save and is not reported as one."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import lora_value, marked_lora_cm, tiny_model

from remat import CheckpointConfig, CheckpointedModel
from remat.saving import STAGING_PREFIX, files

TESTS = os.path.dirname(__file__)


def _staging_folders(folder):
    return [n for n in os.listdir(folder) if n.startswith(STAGING_PREFIX)]


def _subprocess(script, **env):
    """Start `script` in a fresh interpreter (the tests folder on its path)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, *sys.path]), **env},
    )


def _finished(process, timeout):
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"still waiting after {timeout} s (blocked in the folder): {err[-2000:]}")
    assert process.returncode == 0 and out.strip().endswith("ok"), err[-3000:]
    return out


# -- 1. nothing in a folder makes a load or a save wait ----------------------------------------------


def _plant_fifo(folder, where):
    """A staging folder as a crafted (shared, downloaded) folder could carry, with a FIFO where
    remat's manifest, lock or a file the manifest names goes."""
    staging = folder / f"{STAGING_PREFIX}crafted"
    staging.mkdir()
    (staging / "adapter_config.json").write_text("{}")
    if where == "COMMIT":
        os.mkfifo(staging / "COMMIT")
    elif where == "LOCK":
        os.mkfifo(staging / "LOCK")
        (staging / "COMMIT").write_text(json.dumps({"files": [{"path": "adapter_config.json", "replaces": None}]}))
    else:  # a manifest entry
        (staging / "COMMIT").write_text(json.dumps({"files": [{"path": "checkpoint_config.json", "replaces": None}]}))
        os.mkfifo(staging / "checkpoint_config.json")
    return staging


def _in_threads(*jobs, timeout=60):
    """Run `jobs` in daemon threads at once; the exceptions they raised. Fails if any is still
    running after `timeout` s (blocked: a daemon thread does not keep the test process alive)."""
    errors = []

    def run(job):
        try:
            job()
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(job,), daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not [t for t in threads if t.is_alive()], f"still waiting after {timeout} s (blocked in the folder)"
    return errors


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")
@pytest.mark.parametrize("where", ["COMMIT", "LOCK", "manifest entry"])
def test_a_fifo_in_a_staging_folder_is_dropped_with_one_warning_and_blocks_nothing(tmp_path, caplog, where):
    folder = tmp_path / "shared"
    marked_lora_cm(1.0).save_pretrained(folder)
    staging = _plant_fifo(folder, where)
    loaded = []
    with caplog.at_level(logging.WARNING, logger="remat"):
        errors = _in_threads(
            lambda: loaded.append(lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder))),
            lambda: marked_lora_cm(2.0).save_pretrained(folder),
        )
    assert not errors, errors
    assert loaded and loaded[0] in (1.0, 2.0)
    said = [r.getMessage() for r in caplog.records if "crafted" in r.getMessage()]
    assert len(said) == 1 and "dropping" in said[0], said
    assert not staging.exists() and not _staging_folders(folder)
    assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 2.0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")
def test_a_fifo_as_a_staging_manifest_blocks_neither_a_load_nor_a_save_in_other_processes(tmp_path):
    """The same across processes: a load (one process) and a save (another, started at the same
    time) both return; the folder holds the new save."""
    folder = tmp_path / "shared"
    marked_lora_cm(1.0).save_pretrained(folder)
    staging = _plant_fifo(folder, "COMMIT")
    save = _subprocess(
        f"""
        import torch
        from conftest import add_lora, tiny_model
        from remat import CheckpointConfig, CheckpointedModel
        cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
        with torch.no_grad():
            for name, param in cm.model.named_parameters():
                if "lora_" in name:
                    param.fill_(2.0)
        cm.save_pretrained({str(folder)!r})
        print("ok")
        """
    )
    loaded = []
    errors = _in_threads(lambda: loaded.append(lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder))))
    assert not errors and loaded[0] in (1.0, 2.0), errors
    _finished(save, 120)
    assert not staging.exists() and not _staging_folders(folder)
    assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 2.0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")
@pytest.mark.parametrize("blocker", ["a FIFO where a folder goes", "a folder where a file goes"])
def test_a_manifest_whose_files_cannot_land_is_dropped_not_retried_forever(tmp_path, caplog, blocker):
    """A crafted staging folder whose complete manifest names `sub/extra.txt` where the folder has
    a FIFO `sub` (or `extra.txt` where it has a folder): finishing it would fail at every save and
    load; it is dropped with one warning, and the folder keeps working."""
    folder = tmp_path / "out"
    marked_lora_cm(1.0).save_pretrained(folder)
    name = "sub/extra.txt" if blocker.startswith("a FIFO") else "extra.txt"
    if blocker.startswith("a FIFO"):
        os.mkfifo(folder / "sub")
    else:
        (folder / "extra.txt").mkdir()
    staging = folder / f"{STAGING_PREFIX}crafted"
    (staging / os.path.dirname(name)).mkdir(parents=True, exist_ok=True)
    (staging / name).write_text("x")
    (staging / "COMMIT").write_text(json.dumps({"files": [{"path": name, "replaces": None}]}))
    with caplog.at_level(logging.WARNING, logger="remat"):
        assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 1.0
        marked_lora_cm(2.0).save_pretrained(folder)
    said = [r.getMessage() for r in caplog.records if "crafted" in r.getMessage()]
    assert len(said) == 1, said
    assert not staging.exists()
    assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 2.0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")
@pytest.mark.parametrize("name", ["checkpoint_config.json", "adapter_model.safetensors", "adapter_config.json"])
def test_a_fifo_where_a_saved_file_goes_is_an_error_naming_it_not_a_hang(tmp_path, name):
    folder = tmp_path / "out"
    marked_lora_cm(1.0).save_pretrained(folder)
    os.unlink(folder / name)
    os.mkfifo(folder / name)
    outcome = {}

    def load():
        try:
            CheckpointedModel.from_pretrained(tiny_model(), folder)
        except Exception as err:
            outcome["error"] = err

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), f"the load waits on the FIFO {name}"
    error = outcome.get("error")
    assert isinstance(error, ValueError) and str(folder / name) in str(error) and "FIFO" in str(error), error


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")
@pytest.mark.parametrize("kind", ["FIFO", "empty folder"])
def test_a_folder_lock_that_is_not_a_file_is_removed_with_one_warning(tmp_path, caplog, kind):
    folder = tmp_path / "out"
    marked_lora_cm(1.0).save_pretrained(folder)
    if kind == "FIFO":
        os.mkfifo(folder / ".remat-lock")
    else:
        (folder / ".remat-lock").mkdir()
    loaded = []
    with caplog.at_level(logging.WARNING, logger="remat"):
        errors = _in_threads(
            lambda: (
                loaded.append(lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder))),
                marked_lora_cm(2.0).save_pretrained(folder),
            )
        )
    assert not errors and loaded == [1.0], errors
    said = [r.getMessage() for r in caplog.records if ".remat-lock" in r.getMessage()]
    assert len(said) == 1 and "not a regular file" in said[0], said
    assert not os.path.lexists(folder / ".remat-lock")
    assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 2.0


def test_a_folder_this_process_cannot_create_the_lock_file_in_is_read_unlocked_not_forever(tmp_path, monkeypatch):
    """Another account's folder with no lock file in it: the lock file cannot be made, nor
    opened read-only (there is none), so the load reads without it; it used to try forever."""
    folder = tmp_path / "theirs"
    CheckpointConfig(every_n_layers=3).save_pretrained(folder)
    lock_path = str(folder / ".remat-lock")
    real_open = os.open

    def fake_open(name, flags, *args):
        if os.fspath(name) == lock_path and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", name)  # what a non-writable folder says
        return real_open(name, flags, *args)

    monkeypatch.setattr(files.os, "open", fake_open)
    outcome = {}

    def load():
        outcome["config"] = CheckpointConfig.from_pretrained(folder)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the load keeps trying to open a lock file it cannot make"
    assert outcome["config"].every_n_layers == 3


# -- 6. no nesting bricks a folder --------------------------------------------------------------------

DEEP = "[" * 200_000 + "]" * 200_000


def test_a_manifest_nested_200000_deep_is_dropped_with_one_warning_and_the_folder_works(tmp_path, caplog):
    folder = tmp_path / "out"
    marked_lora_cm(1.0).save_pretrained(folder)
    staging = folder / f"{STAGING_PREFIX}deep"
    staging.mkdir()
    (staging / "adapter_config.json").write_text("{}")
    (staging / "COMMIT").write_text(DEEP)
    with caplog.at_level(logging.WARNING, logger="remat"):
        assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 1.0
        marked_lora_cm(3.0).save_pretrained(folder)
    said = [r.getMessage() for r in caplog.records if "deep" in r.getMessage()]
    assert len(said) == 1 and "did not finish" in said[0], said
    assert not staging.exists()
    assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 3.0


CONFIGS = {
    "nested 200,000 deep": DEEP,
    "a field nested 200,000 deep": '{"format_version": 3, "layers": ' + DEEP + "}",
    "a field nested 100 deep": '{"format_version": 3, "layers": ' + "[" * 100 + "]" * 100 + "}",
    "not UTF-8": b'{"format_version": 3, "layers": ["\xff\xfe"]}',
    "an adapters entry of the wrong type": '{"format_version": 3, "adapters": {"default": [1]}}',
}


@pytest.mark.parametrize("content", list(CONFIGS))
def test_a_malformed_checkpoint_config_is_a_value_error_naming_the_file_and_a_save_mends_it(tmp_path, content):
    folder = tmp_path / "out"
    marked_lora_cm(1.0).save_pretrained(folder)
    file = folder / "checkpoint_config.json"
    data = CONFIGS[content]
    file.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(ValueError, match=str(file)):
        CheckpointedModel.from_pretrained(tiny_model(), folder)
    if "adapters" not in content:  # the config alone does not read the adapters
        with pytest.raises(ValueError, match=str(file)):
            CheckpointConfig.from_pretrained(folder)
        with pytest.raises(ValueError, match=str(file)):
            CheckpointConfig.from_pretrained(file)
    marked_lora_cm(4.0).save_pretrained(folder)  # the folder is not bricked: a save replaces the file
    assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 4.0


# -- 9. a save and a load side by side are not a crashed save -----------------------------------------


def test_a_save_and_a_load_side_by_side_log_no_warning(tmp_path, caplog, monkeypatch):
    """One thread saves, another loads, for a few seconds: every save and load is right, and
    nothing is reported. (A slow file system is played by a pause after each staging folder is
    made: a load's recovery arriving before its writer locks it must not take it for a crash.)"""
    from remat.saving import folder as transaction

    real_mkdtemp = transaction.tempfile.mkdtemp

    def slow_mkdtemp(*args, **kwargs):
        made = real_mkdtemp(*args, **kwargs)
        time.sleep(0.02)
        return made

    monkeypatch.setattr(transaction.tempfile, "mkdtemp", slow_mkdtemp)
    folder = tmp_path / "out"
    saver_cm = marked_lora_cm(1.0)
    saver_cm.save_pretrained(folder)
    stop, errors, counts = threading.Event(), [], {"saves": 0, "loads": 0}

    def save():
        try:
            while not stop.is_set():
                saver_cm.save_pretrained(folder)
                counts["saves"] += 1
        except Exception as err:
            errors.append(err)

    def load():
        try:
            while not stop.is_set():
                assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 1.0
                assert CheckpointConfig.from_pretrained(folder).every_n_layers == 2
                counts["loads"] += 1
        except Exception as err:
            errors.append(err)

    with caplog.at_level(logging.WARNING, logger="remat"):
        threads = [threading.Thread(target=save), threading.Thread(target=load)]
        for thread in threads:
            thread.start()
        time.sleep(4.0)
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert counts["saves"] >= 3 and counts["loads"] >= 3, counts
    warnings = [r.getMessage() for r in caplog.records if r.name == "remat" and r.levelno >= logging.WARNING]
    assert not warnings, f"{len(warnings)} warnings while nothing went wrong: {warnings[:3]}"
    assert not _staging_folders(folder)
