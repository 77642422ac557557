"""A folder remat cannot use, or an argument that is not one, is refused naming the user's folder and what to do:
before, the OS's raw error named remat's hidden staging folder or lock file, or os.fspath's TypeError came out."""

import errno
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import lora_value, marked_lora_cm, tiny_model

from remat import (
    CheckpointConfig,
    CheckpointedModel,
    ConfigError,
    ConfigTypeError,
    FolderAccessError,
    LockFileError,
    NotSavedError,
    RematError,
)
from remat.saving import STAGING_PREFIX, files, folder
from remat.saving.folder import FOLDER_LOCK

SAVES = {
    "the wrapper": lambda target: CheckpointedModel(tiny_model()).save_pretrained(target),
    "the config": lambda target: CheckpointConfig(every_n_layers=3).save_pretrained(target),
}


def _contents(root):
    """Every path under `root` with its bytes (None for a folder): what a refused call must leave as it was."""
    found = {}
    for where, dirs, names in os.walk(root):
        found |= {os.path.join(where, d): None for d in dirs}
        found |= {os.path.join(where, n): pathlib.Path(where, n).read_bytes() for n in names}
    return found


@pytest.mark.parametrize("save", SAVES.values(), ids=SAVES.keys())
@pytest.mark.parametrize("into", ["an earlier save", "a new folder"])
def test_a_save_the_os_refuses_names_the_users_folder_and_writes_nothing(tmp_path, monkeypatch, save, into):
    """Injected where a folder you cannot write refuses it (tests run as root, where modes do not restrict)."""
    target = tmp_path / "out" if into == "an earlier save" else tmp_path / "new" / "sub"
    if into == "an earlier save":
        CheckpointConfig().save_pretrained(target)
    before = _contents(tmp_path)

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(kwargs["dir"], f"{STAGING_PREFIX}x"))

    monkeypatch.setattr(folder.tempfile, "mkdtemp", refused)
    with pytest.raises(FolderAccessError) as info:
        save(target)
    assert (
        isinstance(info.value, PermissionError)
        and isinstance(info.value, RematError)
        and info.value.errno == errno.EACCES
    )
    said = str(info.value)
    assert f"cannot save into {target}: Permission denied" in said and STAGING_PREFIX not in said, said
    assert "save to a folder you can write to; nothing was written" in said
    assert _contents(tmp_path) == before


@pytest.mark.parametrize(
    "load", [CheckpointConfig.from_pretrained, lambda d: CheckpointedModel.from_pretrained(tiny_model(), d)]
)
def test_a_load_the_os_refuses_names_the_users_folder_not_the_lock_file(tmp_path, monkeypatch, load):
    """A folder you cannot read (mode 000) refused the lock file remat makes there, which the user never made."""
    CheckpointConfig().save_pretrained(tmp_path)
    lock, real_lstat = str(tmp_path / FOLDER_LOCK), os.lstat

    def refused(path, *args, **kwargs):
        if os.fspath(path) == lock:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(files.os, "lstat", refused)
    with pytest.raises(FolderAccessError, match="load from a folder you can read") as info:
        load(tmp_path)
    assert f"cannot load from {tmp_path}: Permission denied" in str(info.value) and FOLDER_LOCK not in str(info.value)


def test_without_the_power_to_ignore_modes_a_read_only_save_and_an_unreadable_load_are_refused_so(tmp_path):
    """The real thing, where the injections above play it: root's power over file modes dropped (setpriv)."""
    prefix = []
    if os.geteuid() == 0:  # root ignores file modes: setpriv (util-linux, on every machine this suite runs) drops that
        assert shutil.which("setpriv"), "this test needs setpriv as root (Debian's util-linux)"
        caps = "-dac_override,-dac_read_search"
        prefix = ["setpriv", "--bounding-set", caps, "--inh-caps", caps]
    (tmp_path / "ro").mkdir(mode=0o555)
    CheckpointConfig().save_pretrained(tmp_path / "locked")
    (tmp_path / "locked").chmod(0o000)
    script = """
        import sys
        from remat import CheckpointConfig, FolderAccessError
        for call, arg in [(CheckpointConfig().save_pretrained, "ro"), (CheckpointConfig.from_pretrained, "locked")]:
            try:
                call(arg)
            except FolderAccessError as err:
                print(err)
    """
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, *sys.path])}
    run = [*prefix, sys.executable, "-c", textwrap.dedent(script)]
    done = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    (tmp_path / "locked").chmod(0o755)
    said = done.stdout.splitlines()
    assert len(said) == 2 and "save to a folder you can write to" in said[0] and "load from a folder" in said[1], done
    assert f"{tmp_path / 'ro'}: Permission denied" in said[0] and STAGING_PREFIX not in said[0], said
    assert os.listdir(tmp_path / "ro") == [] and os.listdir(tmp_path / "locked") == ["checkpoint_config.json"]


def test_a_folder_with_files_where_the_lock_file_goes_is_named_and_left_alone(tmp_path):
    """It was removed if empty; with files in it, the load and the save failed on os.rmdir's bare OSError."""
    CheckpointConfig(every_n_layers=3).save_pretrained(tmp_path)
    (tmp_path / FOLDER_LOCK).mkdir()
    (tmp_path / FOLDER_LOCK / "notes.txt").write_text("mine")
    before = _contents(tmp_path)
    for call in (CheckpointConfig.from_pretrained, CheckpointConfig(every_n_layers=2).save_pretrained):
        with pytest.raises(LockFileError, match=r"remat cannot remove it.*remove it yourself") as info:
            call(tmp_path)
        assert str(tmp_path / FOLDER_LOCK) in str(info.value)
        assert _contents(tmp_path) == before
    shutil.rmtree(tmp_path / FOLDER_LOCK)
    assert CheckpointConfig.from_pretrained(tmp_path).every_n_layers == 3


@pytest.mark.parametrize("save", SAVES.values(), ids=SAVES.keys())
@pytest.mark.parametrize("under", ["afile", "afile/sub"])
def test_a_file_where_the_folder_goes_is_refused_by_every_save_alike(tmp_path, save, under):
    """The wrapper refused a file, the config's save raised FileExistsError, and both NotADirectoryError inside one."""
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(
        ConfigError, match=rf"needs a folder, but {re.escape(str(tmp_path / 'afile'))} is a file.*: pass a folder"
    ):
        save(tmp_path / under)
    assert _contents(tmp_path) == {str(tmp_path / "afile"): b"mine"}


def test_a_missing_folder_that_reads_as_a_hub_id_says_to_download_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotSavedError, match="reads a local folder") as info:
        CheckpointedModel.from_pretrained(tiny_model(), "someone/some-adapter")
    assert "huggingface_hub.snapshot_download('someone/some-adapter')" in str(info.value)
    (tmp_path / "out").mkdir()  # a typo under a local folder ("out/checkpoint-5000") is no Hub id
    for local in ("./missing", "../missing", str(tmp_path / "missing"), "out/checkpoint-5000"):
        with pytest.raises(NotSavedError, match=r"pass the folder cm\.save_pretrained") as info:
            CheckpointedModel.from_pretrained(tiny_model(), local)
        assert "snapshot_download" not in str(info.value)


def test_the_config_file_instead_of_its_folder_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    CheckpointConfig().save_pretrained("out")
    with pytest.raises(NotSavedError, match="is a file: pass the folder holding it, 'out'"):
        CheckpointedModel.from_pretrained(tiny_model(), os.path.join("out", "checkpoint_config.json"))


def test_a_folder_that_is_not_a_path_or_arguments_swapped_are_named(tmp_path):
    model = tiny_model()
    with pytest.raises(ConfigTypeError, match=r"folder must be a str or os.PathLike, got NoneType$"):
        CheckpointedModel.from_pretrained(model, None)
    swapped = r"got LlamaForCausalLM \(the arguments are swapped: from_pretrained\(model, 'out'\)\)"
    with pytest.raises(ConfigTypeError, match=swapped):
        CheckpointedModel.from_pretrained("out", model)


def test_loading_into_a_wrapper_names_the_calls_that_do_and_they_work(tmp_path):
    marked_lora_cm(2.0).save_pretrained(tmp_path)
    peft_cm, plain_cm = marked_lora_cm(1.0), CheckpointedModel(tiny_model())
    for cm, peft in ((peft_cm, True), (plain_cm, False)):
        with pytest.raises(ConfigTypeError, match="already a CheckpointedModel") as info:
            CheckpointedModel.from_pretrained(cm, tmp_path)
        assert ("cm.model.load_adapter(folder, adapter_name=...)" in str(info.value)) == peft
        assert "cm.disable(), then CheckpointedModel.from_pretrained(cm.model, folder)" in str(info.value)
    peft_cm.model.load_adapter(tmp_path, adapter_name="other")
    assert set(peft_cm.model.peft_config) == {"default", "other"}
    for cm in (peft_cm, plain_cm):
        cm.disable()
        assert lora_value(CheckpointedModel.from_pretrained(cm.model, tmp_path)) == 2.0


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_read_only_mount_is_a_folder_access_error_and_a_full_disk_stays_the_oss_own(tmp_path, monkeypatch, code):
    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code), kwargs["dir"])

    monkeypatch.setattr(folder.tempfile, "mkdtemp", refused)
    with pytest.raises(OSError) as info:
        CheckpointConfig().save_pretrained(tmp_path / "out")
    assert isinstance(info.value, FolderAccessError) == (code == errno.EROFS) and info.value.errno == code
    assert not (tmp_path / "out").exists()
