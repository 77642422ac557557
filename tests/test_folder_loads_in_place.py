"""Loads read the folder in place (issue 25): nothing is copied, so a load works whatever the
temporary folder is and leaves nothing behind when it is killed; loads share the folder's lock
(they run side by side), and a commit waits for the loads reading, then commits whole."""

import os
import signal
import tempfile
import threading
import time

from conftest import lora_value, marked_lora_cm, tiny_model

from remat import CheckpointConfig, CheckpointedModel


def _tree(root):
    """Every path under `root` with its size (files) or None (folders)."""
    out = {}
    for base, dirs, names in os.walk(root):
        for name in dirs:
            out[os.path.join(base, name)] = None
        for name in names:
            out[os.path.join(base, name)] = os.lstat(os.path.join(base, name)).st_size
    return out


def test_a_load_works_whatever_the_temporary_folder_is(tmp_path, monkeypatch):
    """A temporary folder that does not exist (or is full, or read-only): a load does not use it."""
    folder = tmp_path / "out"
    marked_lora_cm(3.0).save_pretrained(folder)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 3.0
    assert CheckpointConfig.from_pretrained(folder).every_n_layers == 2
    resumed = marked_lora_cm(0.0)
    resumed.model.load_adapter(str(folder), "default", is_trainable=True)  # Trainer resume's path
    assert lora_value(resumed) == 3.0
    assert not (tmp_path / "no-such-folder").exists()


def test_a_load_killed_at_random_moments_leaves_nothing_anywhere(tmp_path):
    """A process loading in a loop, SIGKILLed (the OOM killer, a preemption) again and again: its
    temporary folder stays empty and the folder holds what it held (a lock file the killed load
    held is all that may stay, until the next load removes it)."""
    folder = tmp_path / "out"
    marked_lora_cm(5.0).save_pretrained(folder)
    before = _tree(folder)
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    for delay in (0.0, 0.02, 0.05, 0.1, 0.2):
        ready, signal_ready = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: loads until it is killed, never returns into pytest
            try:
                os.environ["TMPDIR"], tempfile.tempdir = str(private_tmp), str(private_tmp)
                CheckpointedModel.from_pretrained(tiny_model(), folder)
                os.write(signal_ready, b"x")
                while True:
                    CheckpointedModel.from_pretrained(tiny_model(), folder)
            finally:
                os._exit(0)
        os.close(signal_ready)
        assert os.read(ready, 1) == b"x"  # one load done: the next are under way
        os.close(ready)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert os.listdir(private_tmp) == [], "a killed load left files in the temporary folder"
        after = _tree(folder)
        after.pop(str(folder / ".remat-lock"), None)
        assert after == before
    assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 5.0
    assert _tree(folder) == before  # the next load removed a lock file left by a killed one


def test_a_commit_waits_for_a_load_reading_while_other_loads_read_alongside(tmp_path, monkeypatch):
    """Load A is held inside PEFT's read; a save arriving then waits (the folder's files stay A's
    until A is done), while load B, arriving after the save, still reads (shared). Then the save
    commits whole."""
    from peft import PeftModel

    folder = tmp_path / "out"
    marked_lora_cm(1.0).save_pretrained(folder)
    real_load, inside, release = PeftModel.load_adapter, threading.Event(), threading.Event()
    held = []

    def load_adapter(self, *args, **kwargs):
        if threading.current_thread() in held:
            inside.set()
            assert release.wait(60)
        return real_load(self, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "load_adapter", load_adapter)
    results = {}

    def load_a():
        results["a"] = lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder))

    def save():
        marked_lora_cm(2.0).save_pretrained(folder)
        results["saved"] = time.monotonic()

    a = threading.Thread(target=load_a)
    held.append(a)
    a.start()
    assert inside.wait(60)
    saver = threading.Thread(target=save)
    saver.start()
    time.sleep(0.3)
    results["b"] = lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder))  # alongside A
    time.sleep(0.3)
    assert "saved" not in results, "a save committed while a load was reading"
    released = time.monotonic()
    release.set()
    a.join(60)
    saver.join(60)
    assert results["a"] == 1.0 and results["b"] == 1.0
    assert results["saved"] >= released
    assert lora_value(CheckpointedModel.from_pretrained(tiny_model(), folder)) == 2.0
