"""Saving and loading lose nothing: foreign files kept, crashes (SIGKILL at every step and at
random moments) leave a loadable pair, mismatched pairs and stray adapters are clear errors,
and every refused load leaves the model as it was."""

import json
import os
import random
import shutil
import signal
import time

import pytest
import torch
from conftest import add_lora, assert_same_grads, batch, step_grads, tiny_model

from remat import CheckpointConfig, CheckpointedModel
from remat.saving import STAGING_PREFIX

ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors", "checkpoint_config.json"}


def _lora_cm(seed=0, **lora):
    return CheckpointedModel(add_lora(tiny_model(seed=seed), **lora), CheckpointConfig(every_n_layers=2))


def _set_lora(model, value):
    """Every LoRA weight set to `value`: a save's adapters are recognisable by one number."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.fill_(value)


def _lora_values(model):
    return {round(float(p.detach().mean()), 4) for n, p in model.named_parameters() if "lora_" in n}


def _lora(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _snapshot(folder):
    """Every file under `folder` with its bytes and modification time."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                out[os.path.relpath(path, folder)] = (handle.read(), os.stat(path).st_mtime_ns)
    return out


def _model_state(model):
    """What a load could change: the module tree, requires_grad, the adapters registered."""
    return (
        [(n, type(m).__name__) for n, m in model.named_modules()],
        [(n, p.requires_grad) for n, p in model.named_parameters()],
        sorted(getattr(model, "peft_config", {})),
        sorted(k for k in model.__dict__ if not k.startswith("_")),
    )


def _no_staging_left(folder):
    return not any(name.startswith(STAGING_PREFIX) for name in os.listdir(folder))


# -- a save writes its own files and nothing else ------------------------------------------------


def test_a_save_keeps_every_other_file_in_the_folder(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-500").mkdir(parents=True)
    (out / "checkpoint-500" / "optimizer.pt").write_bytes(b"\x00" * 1000)
    (out / "train.log").write_text("step 1 loss 5.5\n")
    (out / "README.md").write_text("my notes")
    before = _snapshot(out)
    cm = _lora_cm()
    for value in (0.1, 0.2):  # the second save replaces the first one's files, and only those
        _set_lora(cm.model, value)
        cm.save_pretrained(out)
        after = _snapshot(out)
        assert {f: after[f] for f in before} == before, "a file the save did not write changed"
        assert set(after) - set(before) == ADAPTER_FILES
        assert _no_staging_left(out)
    loaded = CheckpointedModel.from_pretrained(tiny_model(), out)
    assert _lora_values(loaded.model) == {0.2}


def test_an_empty_path_is_refused_and_dot_saves_into_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    cm = _lora_cm()
    with pytest.raises(ValueError, match="empty path"):
        cm.save_pretrained("")
    assert os.listdir(tmp_path) == ["keep.txt"]
    cm.save_pretrained(".")
    assert set(os.listdir(tmp_path)) == ADAPTER_FILES | {"keep.txt", "README.md"}
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_a_process_that_is_not_the_main_one_writes_nothing(tmp_path):
    cm = _lora_cm()
    cm.save_pretrained(tmp_path / "out")
    before = _snapshot(tmp_path / "out")
    _set_lora(cm.model, 0.5)
    cm.save_pretrained(tmp_path / "out", is_main_process=False)
    assert _snapshot(tmp_path / "out") == before
    cm.save_pretrained(tmp_path / "fresh", is_main_process=False)
    assert not (tmp_path / "fresh").exists()


# -- crashes ---------------------------------------------------------------------------------


def _save_forever_in_a_child(cm, folder, die_at_rename=None):
    """Fork a child that saves again and again, save i with every LoRA weight = i and
    every_n_layers = 1 + i % 2 (so a mixed pair is visible), until it is killed, or kills
    itself at its `die_at_rename`-th rename. Returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: never returns into pytest
        from remat.saving import folder as transaction

        renames = [0]
        real_replace = os.replace

        def replace(src, dst):
            if renames[0] == die_at_rename:
                os.kill(os.getpid(), signal.SIGKILL)
            renames[0] += 1
            real_replace(src, dst)

        os.replace = replace if die_at_rename is not None else real_replace
        assert transaction._rename.__globals__["os"] is os  # the commit's renames are counted
        i = 1
        while True:
            _set_lora(cm.model, float(i))
            cm.enable(cm.checkpoint_config.replace(every_n_layers=1 + i % 2))
            cm.save_pretrained(folder)
            i += 1
    finally:
        os._exit(0)


def _check_consistent(folder, live_staging=False):
    """The folder loads, as one save: the adapters and the config were written together."""
    loaded = CheckpointedModel.from_pretrained(tiny_model(), folder)
    values = _lora_values(loaded.model)
    assert len(values) == 1, f"adapter weights from several saves: {values}"
    (value,) = values
    assert value == int(value) >= 0
    assert loaded.checkpoint_config.every_n_layers == 1 + int(value) % 2, (
        "adapters and config come from different saves"
    )
    assert live_staging or _no_staging_left(folder), "the load finished or removed what the crash left"
    return int(value)


def _first_save(folder):
    cm = _lora_cm()
    _set_lora(cm.model, 0.0)
    cm.enable(cm.checkpoint_config.replace(every_n_layers=1))
    cm.save_pretrained(folder)
    return cm


@pytest.mark.parametrize("die_at_rename", range(10))
def test_a_save_killed_at_each_rename_leaves_the_old_or_the_new_pair(tmp_path, die_at_rename):
    cm = _first_save(tmp_path / "out")
    pid = _save_forever_in_a_child(cm, tmp_path / "out", die_at_rename=die_at_rename)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    _check_consistent(tmp_path / "out")
    cm.save_pretrained(tmp_path / "out")  # and the next save works
    assert _check_consistent(tmp_path / "out") == 0


def test_saves_killed_at_random_moments_always_leave_a_loadable_pair(tmp_path):
    rng = random.Random(0)
    cm = _first_save(tmp_path / "out")
    seen = set()
    # 25 kills at random moments; then, on a machine too busy for a save in 0.3 s, longer lives
    # until some child has committed a save (so the kills are known to have hit saves in flight)
    waits = [rng.uniform(0.0, 0.3) for _ in range(25)] + [1.0 + k for k in range(8)]
    for k, wait in enumerate(waits):
        if k >= 25 and len(seen) > 1:
            break
        pid = _save_forever_in_a_child(cm, tmp_path / "out")
        time.sleep(wait)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        seen.add(_check_consistent(tmp_path / "out"))
    assert len(seen) > 1, "the children saved something before they were killed"


def test_a_crashed_commit_is_not_finished_over_a_newer_save(tmp_path):
    out = tmp_path / "out"
    cm = _first_save(out)
    pid = _save_forever_in_a_child(cm, out, die_at_rename=2)  # after the manifest, at the first move
    os.waitpid(pid, 0)
    assert not _no_staging_left(out), "the child left a complete, uncommitted save"
    _set_lora(cm.model, 9.0)
    cm.enable(cm.checkpoint_config.replace(every_n_layers=2))
    cm.model.save_pretrained(str(out))  # a newer save, written in place (as Trainer saves)
    assert _check_consistent(out) == 9


def test_a_staging_folder_whose_writer_is_alive_is_left_alone(tmp_path):
    import filelock

    out = tmp_path / "out"
    cm = _first_save(out)
    busy = out / f"{STAGING_PREFIX}busy"
    busy.mkdir()
    (busy / "adapter_model.safetensors").write_bytes(b"being written")
    with open(busy / "LOCK", "a+b") as lock:
        filelock.lock_descriptor(lock.fileno())  # what a writer holds while it saves
        assert _check_consistent(out, live_staging=True) == 0
        cm.save_pretrained(out)
        assert busy.is_dir() and (busy / "adapter_model.safetensors").read_bytes() == b"being written"
    assert _check_consistent(out) == 0 and _no_staging_left(out), "once its writer is gone, it is removed"


def test_a_recovery_arriving_as_a_staging_folder_is_made_finds_it_locked_and_says_nothing(
    tmp_path, monkeypatch, caplog
):
    """Another process's recovery (a load, a save) that arrives just as a save makes its staging
    folder, before the folder's LOCK exists, waits: staging folders are made and locked under the
    folder's lock. So it finds a locked staging folder, a live save, and leaves it alone without
    a word (issue 25: it used to remove it, warning of a save that did not finish)."""
    import logging
    import threading

    from remat.saving import folder as transaction

    out = tmp_path / "out"
    cm = _first_save(out)
    original, recoveries = transaction._take_lock, []

    class SeenFromAnotherProcess(set):
        def __contains__(self, item):  # the recovery's thread plays another process: not its saves
            return threading.current_thread() not in recoveries and super().__contains__(item)

    def recovery_arrives(path, *, wait, remove, shared=False):
        staging = os.path.dirname(path)
        if wait and os.path.basename(staging).startswith(STAGING_PREFIX) and not recoveries:
            recovery = threading.Thread(target=transaction.recover, args=(os.path.dirname(staging),))
            recoveries.append(recovery)
            recovery.start()
            time.sleep(0.3)  # the staging folder exists, its LOCK not yet: the recovery waits
            recoveries.append(os.path.isdir(staging))
        return original(path, wait=wait, remove=remove, shared=shared)

    monkeypatch.setattr(transaction, "_live", SeenFromAnotherProcess())
    monkeypatch.setattr(transaction, "_take_lock", recovery_arrives)
    _set_lora(cm.model, 4.0)
    with caplog.at_level(logging.WARNING, logger="remat"):
        cm.save_pretrained(out)
        recoveries[0].join(timeout=30)
    assert recoveries[1:] == [True], "the new staging folder was removed"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert _check_consistent(out) == 4 and _no_staging_left(out)


def test_a_staging_folder_removed_while_its_writer_waits_for_the_lock_is_made_again(tmp_path, monkeypatch):
    """Another recovery holds a new staging folder's lock, so the writer waits; the recovery
    removes the folder and lets go: the lock the writer then gets is on a removed file, so it
    makes a new folder (PEFT would recreate the missing one, unlocked, open to a third recovery)."""
    import threading

    import filelock

    from remat.saving import folder as transaction

    out = tmp_path / "out"
    cm = _first_save(out)
    original, removed = transaction._take_lock, []

    def recovery_holds_the_lock(path, *, wait, remove, shared=False):
        staging = os.path.dirname(path)
        if wait and os.path.basename(staging).startswith(STAGING_PREFIX) and not removed:
            removed.append(staging)
            held = os.open(path, os.O_RDWR | os.O_CREAT)
            filelock.lock_descriptor(held)

            def remove_then_release():
                time.sleep(0.3)  # the writer is waiting for the lock by now
                shutil.rmtree(staging)
                filelock.unlock_descriptor(held)
                os.close(held)

            threading.Thread(target=remove_then_release).start()
        return original(path, wait=wait, remove=remove, shared=shared)

    commit = transaction._commit

    def recovery_during_commit(staging, target, files):
        transaction._recover(target)  # another process's recovery now: the writer's lock keeps it out
        commit(staging, target, files)

    monkeypatch.setattr(transaction, "_take_lock", recovery_holds_the_lock)
    monkeypatch.setattr(transaction, "_commit", recovery_during_commit)
    _set_lora(cm.model, 6.0)
    cm.save_pretrained(out)
    assert removed and not os.path.exists(removed[0])
    assert _check_consistent(out) == 6 and _no_staging_left(out)


def test_a_manifest_naming_paths_outside_the_folder_is_ignored(tmp_path):
    """A downloaded folder could carry a crafted staging folder: recovery moves nothing out of it."""
    out = tmp_path / "downloaded"
    _first_save(out)
    (tmp_path / "precious.txt").write_text("mine")
    (out / "precious.txt").write_text("theirs")
    evil = out / f"{STAGING_PREFIX}evil"
    evil.mkdir()
    (evil / "COMMIT").write_text(json.dumps({"files": [{"path": "../precious.txt", "replaces": None}]}))
    assert _check_consistent(out) == 0
    assert (tmp_path / "precious.txt").read_text() == "mine" and (out / "precious.txt").read_text() == "theirs"
    assert not evil.exists()


def test_a_mismatched_pair_is_a_clear_error_and_changes_nothing(tmp_path):
    cm = _lora_cm()
    for name, value in (("a", 1.0), ("b", 2.0)):
        _set_lora(cm.model, value)
        cm.save_pretrained(tmp_path / name)
    shutil.copy(tmp_path / "b" / "adapter_model.safetensors", tmp_path / "a" / "adapter_model.safetensors")
    model = tiny_model()
    before = _model_state(model)
    with pytest.raises(
        ValueError, match=r"adapter_model\.safetensors is not the adapter file .* written by another save"
    ):
        CheckpointedModel.from_pretrained(model, tmp_path / "a")
    assert _model_state(model) == before


def test_a_bin_save_beside_an_older_safetensors_one_is_refused_not_loaded_stale(tmp_path, caplog):
    cm = _lora_cm()
    _set_lora(cm.model, 1.0)
    cm.save_pretrained(tmp_path / "out")
    _set_lora(cm.model, 2.0)
    with caplog.at_level("WARNING", logger="remat"):  # said when saving, too: plain PEFT would load it
        cm.save_pretrained(tmp_path / "out", safe_serialization=False)  # PEFT would load the older .safetensors
    warned = [r.getMessage() for r in caplog.records if "earlier save's" in r.getMessage()]
    assert len(warned) == 1 and "adapter_model.safetensors" in warned[0], warned
    assert (tmp_path / "out" / "adapter_model.safetensors").exists(), "a save never touches files it did not write"
    model = tiny_model()
    before = _model_state(model)
    with pytest.raises(
        ValueError, match=r"adapter_model\.bin, but .*adapter_model\.safetensors .* loads that one first.*safe_serial"
    ):
        CheckpointedModel.from_pretrained(model, tmp_path / "out")
    assert _model_state(model) == before
    os.remove(tmp_path / "out" / "adapter_model.safetensors")
    assert _lora_values(CheckpointedModel.from_pretrained(model, tmp_path / "out").model) == {2.0}


# -- adapters are never lost silently -------------------------------------------------------------


def test_peft_applied_after_wrapping_is_refused_at_save(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = tiny_model()
    cm = CheckpointedModel(base)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"not a PeftModel.*Wrap the PeftModel"):
        cm.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_loading_into_a_peft_model_loads_the_saved_adapters(tmp_path):
    cm = _lora_cm()
    _set_lora(cm.model, 0.25)
    cm.save_pretrained(tmp_path / "out")
    target = add_lora(tiny_model())  # the same structure, fresh adapter values
    loaded = CheckpointedModel.from_pretrained(target, tmp_path / "out")
    assert loaded.model is target and _lora_values(target) == {0.25}
    named = [(n, p) for n, p in target.named_parameters() if p.requires_grad]
    reference = add_lora(tiny_model())
    _set_lora(reference, 0.25)
    _, expected = step_grads(reference, [(n, p) for n, p in reference.named_parameters() if p.requires_grad], batch())
    _, got = step_grads(loaded, named, batch())
    assert_same_grads(expected, got)


def test_loading_an_adapter_of_another_structure_into_a_peft_model_changes_nothing(tmp_path):
    cm = _lora_cm()
    cm.save_pretrained(tmp_path / "out")
    from peft import LoraConfig, get_peft_model

    target = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"]))
    before, values = _model_state(target), _lora(target)
    with pytest.raises(ValueError, match=r"adapter 'default' differs from the saved one.*\br: 2 here, 4 saved"):
        CheckpointedModel.from_pretrained(target, tmp_path / "out")
    assert _model_state(target) == before and all(torch.equal(v, _lora(target)[k]) for k, v in values.items())
    CheckpointedModel(target)  # not left wrapped


def test_adapter_weights_without_their_config_are_an_error_naming_the_file(tmp_path):
    _lora_cm().save_pretrained(tmp_path / "out")
    os.remove(tmp_path / "out" / "adapter_config.json")
    model = tiny_model()
    before = _model_state(model)
    with pytest.raises((ValueError, FileNotFoundError), match=r"adapter_model\.safetensors.*adapter_config\.json"):
        CheckpointedModel.from_pretrained(model, tmp_path / "out")
    assert _model_state(model) == before


def test_every_saved_adapter_is_loaded_including_one_not_named_default(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj"]), adapter_name="mine")
    model.add_adapter("second", LoraConfig(r=2, target_modules=["v_proj"]))
    _set_lora(model, 0.5)
    CheckpointedModel(model).save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / "adapter_config.json").exists(), "PEFT keeps non-default adapters in subfolders"
    loaded = CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "out")
    assert sorted(loaded.model.peft_config) == ["mine", "second"]
    assert _lora(loaded.model).keys() == _lora(model).keys() and _lora_values(loaded.model) == {0.5}


def test_a_failure_inside_peft_loading_is_undone(tmp_path):
    """Weights of the wrong shape (with a matching fingerprint): PEFT injects its layers, then
    fails to load them; the model comes out as it went in and trains exactly."""
    from safetensors.torch import load_file, save_file

    from remat.saving import sha256_file

    _lora_cm().save_pretrained(tmp_path / "out")
    weights = tmp_path / "out" / "adapter_model.safetensors"
    save_file({k: torch.zeros(3, 3) for k in load_file(weights)}, weights)
    config = json.loads((tmp_path / "out" / "checkpoint_config.json").read_text())
    config["adapters"]["default"]["sha256"] = sha256_file(str(weights))
    (tmp_path / "out" / "checkpoint_config.json").write_text(json.dumps(config))
    model = tiny_model()
    before = _model_state(model)
    with pytest.raises(RuntimeError, match="size mismatch"):
        CheckpointedModel.from_pretrained(model, tmp_path / "out")
    assert _model_state(model) == before
    reference = tiny_model()
    _, expected = step_grads(reference, list(reference.named_parameters()), batch())
    _, got = step_grads(CheckpointedModel(model), list(model.named_parameters()), batch())
    assert_same_grads(expected, got)


def test_loading_into_a_model_that_is_already_wrapped_is_refused_before_peft_touches_it(tmp_path):
    _lora_cm().save_pretrained(tmp_path / "out")
    model = tiny_model()
    cm = CheckpointedModel(model)
    before = _model_state(model)
    with pytest.raises(ValueError, match="already wrapped"):
        CheckpointedModel.from_pretrained(model, tmp_path / "out")
    assert _model_state(model) == before and cm.is_enabled


def test_a_refused_load_adapter_changes_neither_the_model_nor_the_map(tmp_path):
    CheckpointedModel(add_lora(tiny_model(num_hidden_layers=6))).save_pretrained(tmp_path / "deeper")
    cm = _lora_cm()
    before, checkpoint_map = _model_state(cm.model), cm.checkpoint_map
    with pytest.raises(ValueError, match=r"planned for 6 layers"):  # trainable: its map would be taken
        cm.model.load_adapter(str(tmp_path / "deeper"), adapter_name="other", is_trainable=True)
    assert _model_state(cm.model) == before and cm.checkpoint_map == checkpoint_map
    with pytest.raises(ValueError, match=r"12 of its saved tensors find no place in this model"):  # frozen: PEFT's
        cm.model.load_adapter(str(tmp_path / "deeper"), adapter_name="other")  # load is undone, not left dropping
    assert _model_state(cm.model) == before and cm.checkpoint_map == checkpoint_map


def test_a_config_from_a_newer_remat_is_a_clear_error(tmp_path):
    _lora_cm().save_pretrained(tmp_path / "out")
    file = tmp_path / "out" / "checkpoint_config.json"
    file.write_text(file.read_text().replace('"format_version": 3', '"format_version": 99'))
    model = tiny_model()
    before = _model_state(model)
    with pytest.raises(ValueError, match=r"checkpoint_config\.json has format_version 99.*reads format_version 3"):
        CheckpointedModel.from_pretrained(model, tmp_path / "out")
    assert _model_state(model) == before


@pytest.mark.parametrize("adapter", ["default", "second"])
def test_a_load_adapter_that_fails_inside_peft_is_undone(tmp_path, adapter, monkeypatch):
    """Weights of which some fit and some do not: PEFT copies the ones that fit, then fails;
    into an existing adapter or a new one, the model comes out as it went in. (Into an existing adapter remat
    refuses such weights before PEFT runs; that check is switched off here to reach PEFT's failure.)"""
    from safetensors.torch import load_file, save_file

    import remat.persistence
    from remat.saving import sha256_file

    _lora_cm().save_pretrained(tmp_path / "out")
    weights = tmp_path / "out" / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: v + 1 if i % 2 else torch.zeros(3, 3) for i, (k, v) in enumerate(tensors.items())}, weights)
    config = json.loads((tmp_path / "out" / "checkpoint_config.json").read_text())
    config["adapters"]["default"]["sha256"] = sha256_file(str(weights))
    (tmp_path / "out" / "checkpoint_config.json").write_text(json.dumps(config))
    cm = _lora_cm()
    before, values = _model_state(cm.model), _lora(cm.model)
    if adapter == "default":
        with pytest.raises(ValueError, match="do not fit the model's adapter"):
            cm.model.load_adapter(str(tmp_path / "out"), adapter_name=adapter)
        monkeypatch.setattr(remat.persistence, "check_peft_load", lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="size mismatch"):
        cm.model.load_adapter(str(tmp_path / "out"), adapter_name=adapter)
    assert _model_state(cm.model) == before
    assert _lora(cm.model).keys() == values.keys() and all(
        torch.equal(_lora(cm.model)[k], v) for k, v in values.items()
    )
