"""A folder is a transaction (issue 20): processes saving into one folder and loading from it
see whole saves only; every save path stages and commits the same way; recovery never leaves
the folder; files get the umask's permissions; the fingerprint covers adapter_config.json;
a save refuses to load into another architecture; `import remat` needs no `fcntl`."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import add_lora, tiny_model

import remat
from remat import CheckpointConfig, CheckpointedModel, RematTrainer
from remat.saving import STAGING_PREFIX
from remat.saving import folder as transaction

# -- helpers: a save is recognisable by one number --------------------------------------------------


def _lora_cm(alpha=8, seed=0):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=alpha, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return CheckpointedModel(get_peft_model(tiny_model(seed=seed), config))


def _mark(cm, value):
    """Save number `value`: every LoRA weight and the config's offload_min_bytes say `value`."""
    with torch.no_grad():
        for name, param in cm.model.named_parameters():
            if "lora_" in name:
                param.fill_(float(value))
    cm.enable(cm.checkpoint_config.replace(offload_min_bytes=int(value)))


def _whole(cm):
    """The save a loaded wrapper holds, checked to be one save: (number, lora_alpha)."""
    values = {round(float(p.detach().mean()), 3) for n, p in cm.model.named_parameters() if "lora_" in n}
    assert len(values) == 1, f"adapter weights from several saves: {values}"
    (value,) = values
    assert value == cm.checkpoint_config.offload_min_bytes, (
        f"adapters of save {value}, config of save {cm.checkpoint_config.offload_min_bytes}"
    )
    return int(value), cm.model.peft_config["default"].lora_alpha


def _load(folder):
    return _whole(CheckpointedModel.from_pretrained(tiny_model(), folder))


def _tree(root):
    """Every path under `root` (links not followed) with its kind and, for files, bytes."""
    out = {}
    for base, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(base, name)
            if os.path.islink(path):
                out[path] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                with open(path, "rb") as handle:
                    out[path] = ("file", handle.read())
            else:
                out[path] = ("dir", None)
    return out


def _outside(tree, folder):
    return {k: v for k, v in tree.items() if not (k == str(folder) or k.startswith(str(folder) + os.sep))}


# -- two processes, one folder ---------------------------------------------------------------------


def test_two_savers_and_a_loader_in_real_processes_see_only_whole_saves(tmp_path):
    """Two processes save different models (lora_alpha 8 / 32; save numbers even / odd) into one
    folder as fast as they can while a third loads in a loop, for a few seconds."""
    folder = tmp_path / "shared"
    first = _lora_cm(alpha=8)
    _mark(first, 0)
    first.save_pretrained(folder)
    seconds, results = 4.0, tmp_path / "loads.json"
    savers = []
    for parity, alpha in ((0, 8), (1, 32)):
        cm = _lora_cm(alpha=alpha, seed=parity)
        pid = os.fork()
        if pid == 0:
            try:
                number = parity + 2
                while True:
                    _mark(cm, number)
                    cm.save_pretrained(folder)
                    number += 2
            finally:
                os._exit(0)
        savers.append(pid)
    loader = os.fork()
    if loader == 0:
        rounds, bad, seen = 0, [], set()
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                rounds += 1
                try:
                    number, alpha = _load(folder)
                    if alpha != (8 if number % 2 == 0 else 32):
                        bad.append(f"save {number} with lora_alpha {alpha}")
                    seen.add(number)
                except Exception as err:  # a mixed or failed load: recorded, the loop goes on
                    bad.append(f"{type(err).__name__}: {err}"[:300])
            results.write_text(json.dumps({"rounds": rounds, "bad": bad, "seen": sorted(seen)}))
        finally:
            os._exit(0)
    os.waitpid(loader, 0)
    for pid in savers:
        os.kill(pid, signal.SIGKILL)  # killed mid-save, as often as not: the folder still loads
        os.waitpid(pid, 0)
    found = json.loads(results.read_text())
    rounds, bad, seen = found["rounds"], found["bad"], found["seen"]
    assert not bad, f"{len(bad)} of {rounds} loads were mixed or failed: {bad[:3]}"
    parities = {n % 2 for n in seen}
    assert rounds >= 5 and len(seen) >= 3 and parities == {0, 1}, (
        f"{rounds} load rounds saw saves {seen}: both savers should have been seen committing"
    )
    number, alpha = _load(folder)
    assert alpha == (8 if number % 2 == 0 else 32)
    assert not [n for n in os.listdir(folder) if n.startswith(STAGING_PREFIX)]


# -- forced interleavings at each rename, for every save path -----------------------------------------


def _trainer_save(cm, folder, value):
    _mark(cm, value)
    trainer = getattr(_trainer_save, "trainer", None)
    if trainer is None or trainer.checkpointed_model is not cm:  # one trainer per wrapper, built once
        from transformers import TrainingArguments

        args = TrainingArguments(output_dir=str(folder), report_to=[], use_cpu=True, max_steps=1)
        trainer = _trainer_save.trainer = RematTrainer(model=cm, args=args)
    trainer.save_model(str(folder))


SAVE_PATHS = {
    "cm.save_pretrained": lambda cm, folder, value: (_mark(cm, value), cm.save_pretrained(folder)),
    "model.save_pretrained (Trainer(model=cm.model))": lambda cm, folder, value: (
        _mark(cm, value),
        cm.model.save_pretrained(str(folder)),
    ),
    "RematTrainer checkpoint": _trainer_save,
}


@pytest.mark.parametrize("path", list(SAVE_PATHS))
def test_a_save_and_a_load_arriving_at_each_rename_wait_for_the_commit(tmp_path, monkeypatch, path):
    """Save A (number 1, lora_alpha 8) is held at its k-th rename while save B (number 2,
    lora_alpha 32) and a load start: B commits after A, whole; the load returns A or B whole.
    Without the folder's lock, B would commit in the middle of A."""
    folder = tmp_path / "out"
    save = SAVE_PATHS[path]
    a, b = _lora_cm(alpha=8), _lora_cm(alpha=32, seed=1)
    save(a, folder, 0)
    real_rename, hold_at, count = transaction._rename, [0], [0]
    main = threading.get_ident()
    loads, order = [], []

    def save_b():
        _mark(b, 2)
        b.save_pretrained(folder)
        order.append("B committed")

    def load():
        loads.append(_load(folder))

    def rename(source, destination):
        if threading.get_ident() == main:
            if count[0] == hold_at[0]:
                others = [threading.Thread(target=save_b), threading.Thread(target=load)]
                for thread in others:
                    thread.start()
                time.sleep(0.5)  # both are far faster than this: without a lock they would be done
                order.append("A still committing")
                rename.others = others
            count[0] += 1
        real_rename(source, destination)

    monkeypatch.setattr(transaction, "_rename", rename)
    k = 0
    while True:
        hold_at[0], count[0], rename.others = k, 0, []
        del order[:], loads[:]
        save(a, folder, 1)
        for thread in rename.others:
            thread.join()
        if not rename.others:
            break  # save A has fewer renames than k: every one was tried
        assert order == ["A still committing", "B committed"], (path, k, order)
        assert loads and loads[0] in ((1, 8), (2, 32)), (path, k, loads)
        assert _load(folder) == (2, 32), (path, k)
        k += 1
    assert k >= 3, f"{path}: save A made only {k} renames"


def test_config_save_pretrained_commits_under_the_same_lock(tmp_path, monkeypatch):
    """`CheckpointConfig.save_pretrained` is the same transaction: a pair save arriving while it
    commits waits, then wins whole."""
    folder = tmp_path / "out"
    b = _lora_cm(alpha=32)
    real_rename, order, main = transaction._rename, [], threading.get_ident()

    def save_b():
        _mark(b, 2)
        b.save_pretrained(folder)
        order.append("B committed")

    def rename(source, destination):
        if threading.get_ident() == main and not order:
            thread = threading.Thread(target=save_b)
            thread.start()
            time.sleep(0.5)
            order.append("config committing")
            rename.thread = thread
        real_rename(source, destination)

    monkeypatch.setattr(transaction, "_rename", rename)
    CheckpointConfig(every_n_layers=2).save_pretrained(folder)
    rename.thread.join()
    assert order == ["config committing", "B committed"]
    assert _load(folder) == (2, 32)


def test_a_load_hands_peft_the_bytes_it_verified(tmp_path, monkeypatch):
    """A save that arrives after the check and before PEFT reads (the check-then-read race)
    waits until the load is done (the load holds the folder's lock, shared, while PEFT reads the
    checked files in place), then commits whole. Both load paths: from_pretrained and Trainer
    resume's load_adapter."""
    from peft import PeftModel

    folder = tmp_path / "out"
    a, b = _lora_cm(alpha=8), _lora_cm(alpha=32, seed=1)
    _mark(a, 1)
    a.save_pretrained(folder)
    real_load, raced, numbers = PeftModel.load_adapter, [], iter([2, 4])

    def load_adapter(self, model_id, *args, **kwargs):
        if not raced:
            number = next(numbers)
            saver = threading.Thread(target=lambda: (_mark(b, number), b.save_pretrained(folder)))
            raced.append(saver)
            saver.start()  # arrives between remat's check and PEFT's read
            time.sleep(0.5)  # a save is far faster than this: without the lock it would have committed
            assert saver.is_alive(), "a save committed while PEFT was reading the checked files"
        return real_load(self, model_id, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "load_adapter", load_adapter)
    assert _load(folder) == (1, 8) and raced
    raced[0].join(timeout=60)
    assert not raced[0].is_alive()
    assert _load(folder) == (2, 32)

    del raced[:]
    _mark(a, 3)
    a.save_pretrained(folder)
    resumed = _lora_cm(alpha=8)
    resumed.model.load_adapter(str(folder), "default", is_trainable=True)  # what Trainer's resume calls
    assert _whole(resumed) == (3, 8) and raced
    raced[0].join(timeout=60)
    assert _load(folder) == (4, 32)  # the save that waited, committed once the load was done


def _unlocked_reads(monkeypatch, state):
    """Loads (while `state["reading"]`) get no folder lock, as in a folder this process cannot write."""
    real_take = transaction._take_lock

    def take_lock(path, *, wait, remove, shared=False):
        if state["reading"] and os.path.basename(path) == transaction.FOLDER_LOCK:
            state["unlocked"] += 1
            return transaction.Lock(None, path, remove)  # what a read-only folder gives
        return real_take(path, wait=wait, remove=remove, shared=shared)

    monkeypatch.setattr(transaction, "_take_lock", take_lock)


def test_a_load_that_cannot_lock_the_folder_reads_again_when_a_commit_came_in_between(tmp_path, monkeypatch):
    """A folder this process cannot write (another account's) is read without its lock: a save
    committing between the config and the adapters makes the files fail their check, and the
    load reads again, getting the newer save whole instead of an error or a mix."""
    folder = tmp_path / "out"
    a, b = _lora_cm(alpha=8), _lora_cm(alpha=32, seed=1)
    _mark(a, 1)
    a.save_pretrained(folder)
    state = {"reading": False, "raced": 0, "unlocked": 0}
    _unlocked_reads(monkeypatch, state)
    real_open = transaction.Snapshot.open

    def open_(snapshot, relative):
        done = real_open(snapshot, relative)
        if relative == "checkpoint_config.json" and not state["raced"]:
            state["raced"], state["reading"] = 1, False
            _mark(b, 2)
            b.save_pretrained(folder)  # another process's save, between the config and the adapters
            state["reading"] = True
        return done

    monkeypatch.setattr(transaction.Snapshot, "open", open_)
    state["reading"] = True
    loaded = CheckpointedModel.from_pretrained(tiny_model(), folder)
    state["reading"] = False
    assert _whole(loaded) == (2, 32) and state["raced"] == 1 and state["unlocked"] == 2


def test_a_load_that_cannot_lock_the_folder_reads_again_when_a_commit_came_in_while_peft_read(tmp_path, monkeypatch):
    """Without the lock nothing stops a commit while PEFT reads: the files PEFT read are then not
    the ones checked, so what PEFT did is undone and the load reads again (the newer save, whole)."""
    from peft import PeftModel

    folder = tmp_path / "out"
    a, b = _lora_cm(alpha=8), _lora_cm(alpha=32, seed=1)
    _mark(a, 1)
    a.save_pretrained(folder)
    state = {"reading": False, "raced": 0, "unlocked": 0}
    _unlocked_reads(monkeypatch, state)
    real_load = PeftModel.load_adapter

    def load_adapter(self, model_id, *args, **kwargs):
        if not state["raced"]:
            state["raced"], state["reading"] = 1, False
            _mark(b, 2)
            b.save_pretrained(folder)  # another process's save, after the check, before PEFT reads
            state["reading"] = True
        return real_load(self, model_id, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "load_adapter", load_adapter)
    model = tiny_model()
    state["reading"] = True
    loaded = CheckpointedModel.from_pretrained(model, folder)
    state["reading"] = False
    assert _whole(loaded) == (2, 32) and state["raced"] == 1 and state["unlocked"] == 2


def test_load_adapter_without_the_folder_lock_undoes_peft_when_a_commit_came_in_while_peft_read(tmp_path, monkeypatch):
    """Trainer's resume calls the wrapped PeftModel's `load_adapter`. In a folder this process
    cannot lock, a commit landing while PEFT reads is found after PEFT's read: the load is
    refused with FolderChangedError and what PEFT did to the model is undone, not left half new."""
    from peft import PeftModel

    from remat import FolderChangedError

    folder = tmp_path / "out"
    a, b = _lora_cm(alpha=8), _lora_cm(alpha=8, seed=1)
    _mark(a, 1)
    a.save_pretrained(folder)
    state = {"reading": False, "raced": 0, "unlocked": 0}
    _unlocked_reads(monkeypatch, state)
    real_load = PeftModel.load_adapter

    def load_adapter(self, model_id, *args, **kwargs):
        result = real_load(self, model_id, *args, **kwargs)
        if not state["raced"]:
            state["raced"], state["reading"] = 1, False
            _mark(b, 2)
            b.save_pretrained(folder)  # another process's save, while PEFT was reading
            state["reading"] = True
        return result

    monkeypatch.setattr(PeftModel, "load_adapter", load_adapter)
    resumed = _lora_cm(alpha=8)
    _mark(resumed, 5)
    state["reading"] = True
    with pytest.raises(FolderChangedError, match="load again"):
        resumed.model.load_adapter(str(folder), "default", is_trainable=True)
    state["reading"] = False
    assert state["raced"] == 1
    assert _whole(resumed) == (5, 8)  # the adapters PEFT had loaded from save 1 are undone


# -- crashes of a Trainer checkpoint -------------------------------------------------------------------


@pytest.mark.parametrize("die_at", [0, 2, 3])  # of 4: the README.md of the first save is kept
def test_a_trainer_checkpoint_killed_at_a_rename_leaves_the_previous_one_loadable(tmp_path, die_at):
    folder = tmp_path / "checkpoint"
    cm = _lora_cm()
    _trainer_save(cm, folder, 0)
    pid = os.fork()
    if pid == 0:
        try:
            renames, real = [0], transaction._rename

            def rename(source, destination):
                if renames[0] == die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                renames[0] += 1
                real(source, destination)

            transaction._rename = rename
            _trainer_save(cm, folder, 1)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), "the child died at its rename"
    number, _ = _load(folder)
    assert number in (0, 1)
    resumed = _lora_cm()
    resumed.model.load_adapter(str(folder), "default", is_trainable=True)
    assert _whole(resumed)[0] == number
    assert {"training_args.bin", "adapter_model.safetensors", "checkpoint_config.json"} <= set(os.listdir(folder))


def test_resume_finishes_a_first_save_that_crashed_before_its_config_was_in_place(tmp_path):
    """The first save into a folder, killed after PEFT's files were renamed into place and before
    checkpoint_config.json: Trainer's resume (load_adapter) finishes it first and loads it whole."""
    folder = tmp_path / "checkpoint"
    cm = _lora_cm()
    _mark(cm, 5)
    pid = os.fork()
    if pid == 0:
        try:
            real = transaction._rename

            def rename(source, destination):
                if os.path.basename(destination) == "checkpoint_config.json":
                    os.kill(os.getpid(), signal.SIGKILL)
                real(source, destination)

            transaction._rename = rename
            cm.save_pretrained(folder)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and (folder / "adapter_model.safetensors").exists()
    assert not (folder / "checkpoint_config.json").exists()
    resumed = _lora_cm()
    resumed.model.load_adapter(str(folder), "default", is_trainable=True)
    assert _whole(resumed) == (5, 8)


# -- recovery never leaves the folder ---------------------------------------------------------------


def _attack(tmp_path, plant):
    """A saved folder with something planted by `plant(folder, outside)`; then every load and a
    save: nothing outside the folder changes, and the folder still loads and saves."""
    parent = tmp_path
    folder, outside = parent / "downloaded", parent / "elsewhere"
    outside.mkdir()
    (outside / "precious.txt").write_text("mine")
    cm = _lora_cm()
    _mark(cm, 0)
    cm.save_pretrained(folder)
    plant(folder, outside)
    before = _outside(_tree(parent), folder)
    assert CheckpointConfig.from_pretrained(folder).offload_min_bytes == 0
    assert _load(folder) == (0, 8)
    _mark(cm, 1)
    cm.save_pretrained(folder)
    assert _load(folder) == (1, 8)
    assert _outside(_tree(parent), folder) == before, "a file outside the folder changed"
    return folder


def _staging(folder, name="crafted", manifest=None):
    staging = folder / f"{STAGING_PREFIX}{name}"
    staging.mkdir()
    if manifest is not None:
        (staging / "COMMIT").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return staging


def test_a_staging_lock_that_is_a_symlink_is_never_followed(tmp_path):
    def plant(folder, outside):
        os.symlink(outside / "created-by-recovery", _staging(folder) / "LOCK")

    folder = _attack(tmp_path, plant)
    assert not (tmp_path / "elsewhere" / "created-by-recovery").exists()
    assert not [n for n in os.listdir(folder) if n.startswith(STAGING_PREFIX)]


def test_a_staging_folder_that_is_a_symlink_is_left_alone(tmp_path):
    def plant(folder, outside):
        (outside / "COMMIT").write_text(json.dumps({"files": [{"path": "precious.txt", "replaces": None}]}))
        os.symlink(outside, folder / f"{STAGING_PREFIX}link")

    folder = _attack(tmp_path, plant)
    assert not (folder / "precious.txt").exists()


@pytest.mark.parametrize("where", ["file", "folder"])
def test_manifest_entries_through_symlinks_move_nothing_from_outside(tmp_path, where):
    def plant(folder, outside):
        staging = _staging(folder, manifest={"files": [{"path": "sub/precious.txt", "replaces": None}]})
        if where == "file":
            (staging / "sub").mkdir()
            os.symlink(outside / "precious.txt", staging / "sub" / "precious.txt")
        else:
            os.symlink(outside, staging / "sub")

    folder = _attack(tmp_path, plant)
    assert not (folder / "sub" / "precious.txt").exists()


def test_a_manifest_that_is_a_symlink_and_a_folder_lock_that_is_one_are_not_followed(tmp_path):
    def plant(folder, outside):
        (outside / "COMMIT").write_text(json.dumps({"files": [{"path": "adapter_config.json", "replaces": None}]}))
        os.symlink(outside / "COMMIT", _staging(folder) / "COMMIT")
        os.symlink(outside / "lock-target", folder / ".remat-lock")

    _attack(tmp_path, plant)
    assert not (tmp_path / "elsewhere" / "lock-target").exists()


MALFORMED = {
    "no replaces": {"files": [{"path": "adapter_config.json"}]},
    "replaces mistyped": {"files": [{"path": "adapter_config.json", "replaces": "yesterday"}]},
    "replaces of bools": {"files": [{"path": "adapter_config.json", "replaces": [True, False]}]},
    "path not a string": {"files": [{"path": 7, "replaces": None}]},
    "an extra field": {"files": [{"path": "adapter_config.json", "replaces": None, "mode": 511}]},
    "files not a list": {"files": {"path": "adapter_config.json"}},
    "no files": {},
    "not an object": [1, 2],
    "not JSON": "{files: ",
}


@pytest.mark.parametrize("manifest", list(MALFORMED))
def test_a_malformed_manifest_is_an_unfinished_save_dropped_with_one_warning(tmp_path, caplog, manifest):
    def plant(folder, outside):
        staging = _staging(folder, manifest=MALFORMED[manifest])
        (staging / "adapter_config.json").write_text("{}")

    with caplog.at_level(logging.WARNING, logger="remat"):
        folder = _attack(tmp_path, plant)
    warnings = [r for r in caplog.records if "crafted" in r.getMessage()]
    assert len(warnings) == 1 and "did not finish" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert json.loads((folder / "adapter_config.json").read_text())["lora_alpha"] == 8


# -- permissions, locks, the fingerprint, the layout ----------------------------------------------------


def _run(script, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(__file__),
        # the remat under test (this checkout's, whatever is installed), then the tests' helpers
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([os.path.dirname(remat.__path__[0]), os.path.dirname(__file__)]),
        },
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    return done.stdout


def test_files_get_the_umask_permissions_peft_files_get(tmp_path):
    """Under umask 022 every file of every save path has the mode PEFT's own save gives the same
    file, and checkpoint_config.json the mode of PEFT's adapter_config.json (0644): whoever can
    read the adapters can read the config."""
    out = tmp_path / "out"
    _run(
        f"""
        import os, stat
        os.umask(0o022)
        from conftest import add_lora, tiny_model
        from remat import CheckpointConfig, CheckpointedModel
        def modes(folder):
            return {{f: stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode) for f in os.listdir(folder)}}
        cm = CheckpointedModel(add_lora(tiny_model()))
        type(cm.model).save_pretrained(cm.model, os.path.join({str(out)!r}, "peft"))  # PEFT alone
        peft = modes(os.path.join({str(out)!r}, "peft"))
        assert peft["adapter_config.json"] == 0o644, peft
        for name, save in (("cm", cm.save_pretrained), ("model", cm.model.save_pretrained)):
            got = modes(os.path.join({str(out)!r}, name)) if save(os.path.join({str(out)!r}, name)) or True else None
            config = got.pop("checkpoint_config.json")
            assert got == peft and config == 0o644, (name, got, oct(config))
        CheckpointConfig().save_pretrained(os.path.join({str(out)!r}, "config"))
        assert modes(os.path.join({str(out)!r}, "config")) == {{"checkpoint_config.json": 0o644}}
        print("ok")
        """,
        tmp_path,
    )


def test_a_pair_saves_and_loads_without_fcntl(tmp_path):
    """`import remat`, a save of a LoRA pair and its load, with `fcntl` unimportable (Windows)."""
    _run(
        f"""
        import sys
        sys.modules["fcntl"] = None
        import warnings
        warnings.simplefilter("ignore")
        from conftest import add_lora, tiny_model
        from remat import CheckpointedModel
        cm = CheckpointedModel(add_lora(tiny_model()))
        cm.save_pretrained({str(tmp_path / "out")!r})
        loaded = CheckpointedModel.from_pretrained(tiny_model(), {str(tmp_path / "out")!r})
        assert sorted(loaded.model.peft_config) == ["default"]
        assert sys.modules["fcntl"] is None
        print("ok")
        """,
        tmp_path,
    )


def test_another_adapter_config_beside_the_weights_is_refused(tmp_path):
    """Same rank and targets, lora_alpha 32 instead of 8: 4x the scaling, refused by its sha256."""
    _lora_cm(alpha=8).save_pretrained(tmp_path / "a")
    _lora_cm(alpha=32).save_pretrained(tmp_path / "b")
    (tmp_path / "a" / "adapter_config.json").write_bytes((tmp_path / "b" / "adapter_config.json").read_bytes())
    with pytest.raises(ValueError, match=r"adapter_config\.json is not the adapter file .* written by another save"):
        CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "a")
    target = _lora_cm(alpha=8)
    with pytest.raises(ValueError, match=r"adapter_config\.json is not the adapter file"):
        target.model.load_adapter(str(tmp_path / "a"), "default", is_trainable=True)


def test_the_adapter_layout_is_the_one_peft_writes(tmp_path):
    from peft import LoraConfig, get_peft_model

    from remat.persistence.pair_format import ADAPTER_CONFIG, adapter_folder

    model = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    model.add_adapter("second", LoraConfig(r=2, target_modules=["v_proj"]))
    model.save_pretrained(tmp_path)  # PEFT's own save, no remat
    for name in ("default", "second"):
        assert (tmp_path / adapter_folder(name) / ADAPTER_CONFIG).is_file(), name
    saved = json.loads(_saved_config(model, tmp_path / "remat"))
    assert {n: e["folder"] for n, e in saved["adapters"].items()} == {"default": "", "second": "second"}


def _saved_config(model, folder):
    CheckpointedModel(model).save_pretrained(folder)
    return (folder / "checkpoint_config.json").read_text()


# -- architecture and saved values --------------------------------------------------------------------


def test_a_save_from_another_architecture_is_refused_naming_both(tmp_path):
    CheckpointedModel(add_lora(tiny_model("qwen3"))).save_pretrained(tmp_path / "qwen3")
    saved = json.loads((tmp_path / "qwen3" / "checkpoint_config.json").read_text())
    assert saved["architecture"] == {"model_type": "qwen3", "num_layers": 4, "hidden_size": 32}
    llama = tiny_model("llama")
    names = [n for n, _ in llama.named_modules()]
    with pytest.raises(ValueError, match=r"saved from a qwen3 model .* but this model is a llama model"):
        CheckpointedModel.from_pretrained(llama, tmp_path / "qwen3")
    assert [n for n, _ in llama.named_modules()] == names, "nothing was injected"
    target = CheckpointedModel(add_lora(tiny_model("llama")))
    with pytest.raises(ValueError, match=r"saved from a qwen3 model"):
        target.model.load_adapter(str(tmp_path / "qwen3"), "default")


def test_a_save_of_another_width_is_refused_before_peft_size_mismatch(tmp_path):
    CheckpointedModel(add_lora(tiny_model(hidden_size=48))).save_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError) as info:
        CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "wide")
    message = str(info.value)
    assert "hidden size 48" in message and "hidden size 32" in message and "size mismatch" not in message
    assert len(message) < 600


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("layer_policies", {"9": "none"}, r"layer_policies names layer\(s\) \[9\].* 4 layers.*remove them"),
        ("swap_layers", [7], r"swap_layers names layer\(s\) \[7\].*remove them"),
        ("layer_policies", {"-1": "none"}, r"layer_policies: layer index -1 is out of range \(negative\).*use 0"),
        ("swap_layers", ["-1"], r"swap_layers: layer index -1 is out of range \(negative\)"),
        ("layer_policies", {"x": "none"}, r"layer_policies: layer indices must be ints.*got 'x'"),
    ],
)
def test_a_bad_saved_layer_index_names_the_file_the_field_and_the_fix(tmp_path, field, value, words):
    CheckpointedModel(tiny_model()).save_pretrained(tmp_path)
    file = tmp_path / "checkpoint_config.json"
    data = json.loads(file.read_text())
    data[field] = value
    file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=words) as info:
        CheckpointedModel.from_pretrained(tiny_model(), tmp_path)
    message = str(info.value)
    assert str(file) in message and field in message
    assert "save" in message or "remove" in message or "use 0" in message, "the fix"


def test_an_adapter_config_edited_by_hand_is_refused_naming_how_to_accept_the_edit(tmp_path):
    """base_model_name_or_path pointed at a local copy (a usual step before loading offline) was refused as "the folder
    mixes two saves", with nothing the user could do; the message names the entry that accepts the edit, and with it
    gone the edited folder loads."""
    _lora_cm(alpha=8).save_pretrained(tmp_path / "a")
    config_file = tmp_path / "a" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "base_model_name_or_path": "/models/x"}))
    with pytest.raises(ValueError, match=r"edited it yourself.*remove adapters\.default\.config_sha256"):
        CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "a")
    pair_file = tmp_path / "a" / "checkpoint_config.json"
    pair = json.loads(pair_file.read_text())
    del pair["adapters"]["default"]["config_sha256"]
    pair_file.write_text(json.dumps(pair))
    loaded = CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "a")
    assert loaded.model.peft_config["default"].base_model_name_or_path == "/models/x"


def test_a_refused_save_removes_the_folders_it_made_and_a_save_beside_it_into_that_folder_still_lands(
    tmp_path, monkeypatch
):
    """A refused save removes the empty folders it made (parents too). A second save into the same new folder, which
    found it made and had not yet made its staging there, failed with FileNotFoundError when the first removed it:
    it makes the folder again."""
    target = tmp_path / "new" / "run"
    first_writing, first_done = threading.Event(), threading.Event()
    new_staging = transaction._new_staging

    def second_waits(folder, *args):  # the second save, between its makedirs and its staging
        if threading.current_thread().name == "second":
            first_done.wait(10)
        return new_staging(folder, *args)

    def refused(staging):
        first_writing.set()
        time.sleep(0.2)  # the second save has found the folder by now
        raise RuntimeError("refused")

    monkeypatch.setattr(transaction, "_new_staging", second_waits)
    outcome = {}

    def first():
        with pytest.raises(RuntimeError, match="refused"):
            transaction.save_pair(target, lambda staging: "{}", refused)
        first_done.set()

    def second():
        first_writing.wait(10)
        outcome["files"] = transaction.save_pair(target, lambda staging: '{"every_n_layers": 2}')

    threads = [threading.Thread(target=first, name="first"), threading.Thread(target=second, name="second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcome["files"] == ["checkpoint_config.json"]
    assert json.loads((target / "checkpoint_config.json").read_text()) == {"every_n_layers": 2}
    with pytest.raises(RuntimeError, match="refused"):  # alone: nothing of its own left behind
        transaction.save_pair(tmp_path / "other" / "run", lambda staging: "{}", refused)
    assert sorted(os.listdir(tmp_path)) == ["new"]
