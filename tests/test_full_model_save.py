"""A full model's own `save_pretrained` while wrapped (no PEFT): staged and committed whole, the
folder ends as transformers' own save would leave it, stale shards of an earlier save removed
and nothing else (issue 25, item 7)."""

import os
import shutil

import pytest
import torch
from conftest import add_lora, tiny_model
from transformers import AutoModelForCausalLM

from remat import CheckpointedModel

USER_FILES = {
    "notes.txt": b"mine",
    "pytorch_model-00001-of-00002.bin": b"a shard of another weights name: transformers keeps it",
    os.path.join("sub", "model-00001-of-00003.safetensors"): b"not at the top: transformers keeps it",
}


def _files(folder):
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()  # noqa: SIM115
    return out


def _with_user_files(folder):
    for relative, content in USER_FILES.items():
        os.makedirs(os.path.dirname(os.path.join(folder, relative)), exist_ok=True)
        with open(os.path.join(folder, relative), "wb") as handle:
            handle.write(content)


def _trained(model):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)
    return model


def _assert_loads(folder, model):
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize(
    ("first", "second", "loads_the_new_weights"),
    [
        ({"max_shard_size": "50KB"}, {"max_shard_size": "100KB"}, True),  # three shards, then two
        ({"max_shard_size": "100KB"}, {"max_shard_size": "50KB"}, True),  # two, then three
        ({"max_shard_size": "50KB"}, {}, True),  # shards, then one file
        # one file, then shards: transformers keeps the earlier model.safetensors, which loads first
        ({}, {"max_shard_size": "50KB"}, False),
    ],
)
def test_a_wrapped_resave_leaves_the_folder_as_transformers_own_save(tmp_path, first, second, loads_the_new_weights):
    model = tiny_model()
    model.save_pretrained(tmp_path / "before", **first)
    _with_user_files(tmp_path / "before")
    shutil.copytree(tmp_path / "before", tmp_path / "own")
    shutil.copytree(tmp_path / "before", tmp_path / "wrapped")
    _trained(model)

    model.save_pretrained(tmp_path / "own", **second)
    cm = CheckpointedModel(model)
    cm.model.save_pretrained(tmp_path / "wrapped", **second)

    own, wrapped = _files(tmp_path / "own"), _files(tmp_path / "wrapped")
    assert wrapped.pop("checkpoint_config.json")
    assert sorted(wrapped) == sorted(own)
    assert wrapped == own
    assert all(own[name] == content for name, content in USER_FILES.items())
    _assert_loads(
        tmp_path / "wrapped", model if loads_the_new_weights else AutoModelForCausalLM.from_pretrained(tmp_path / "own")
    )


def test_a_crash_before_the_commit_leaves_the_previous_save_loadable(tmp_path, monkeypatch):
    model = tiny_model()
    cm = CheckpointedModel(model)
    cm.model.save_pretrained(tmp_path / "save", max_shard_size="50KB")
    _with_user_files(tmp_path / "save")
    before = _files(tmp_path / "save")
    previous = {k: v.clone() for k, v in model.state_dict().items()}
    _trained(model)
    from remat.saving import folder

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(folder, "write_file_atomically", crash)  # after transformers wrote its files
    with pytest.raises(KeyboardInterrupt):
        cm.model.save_pretrained(tmp_path / "save", max_shard_size="100KB")
    monkeypatch.undo()
    assert _files(tmp_path / "save") == before
    assert sorted(os.listdir(tmp_path)) == ["save"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "save").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in previous.items())


def test_a_crash_between_the_commit_and_the_clean_up_leaves_the_new_save_whole(tmp_path, monkeypatch):
    model = tiny_model()
    cm = CheckpointedModel(model)
    cm.model.save_pretrained(tmp_path / "save", max_shard_size="50KB")
    _trained(model)
    from remat.saving import folder

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(folder, "_remove_replaced", crash)
    with pytest.raises(KeyboardInterrupt):
        cm.model.save_pretrained(tmp_path / "save", max_shard_size="100KB")
    monkeypatch.undo()
    assert "model-00003-of-00003.safetensors" in os.listdir(tmp_path / "save")  # left, beside a whole save
    _assert_loads(tmp_path / "save", model)

    cm.model.save_pretrained(tmp_path / "save", max_shard_size="100KB")  # the next save removes it
    shards = sorted(n for n in os.listdir(tmp_path / "save") if n.startswith("model-"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    _assert_loads(tmp_path / "save", model)


def test_an_adapter_save_leaves_shard_files_alone(tmp_path):
    (tmp_path / "save").mkdir()
    _with_user_files(tmp_path / "save")
    (tmp_path / "save" / "model-00001-of-00002.safetensors").write_bytes(b"the user's")
    cm = CheckpointedModel(add_lora(tiny_model()))
    cm.model.save_pretrained(tmp_path / "save")
    cm.save_pretrained(tmp_path / "save")
    files = _files(tmp_path / "save")
    assert files["model-00001-of-00002.safetensors"] == b"the user's"
    assert all(files[name] == content for name, content in USER_FILES.items())
    assert "adapter_model.safetensors" in files


def test_a_trainer_save_of_a_full_model_removes_the_shards_trainers_own_save_removes(tmp_path):
    """RematTrainer's save goes through the same staged save: an earlier sharded save in the
    output folder ends as a plain Trainer's save leaves it."""
    from transformers import Trainer, TrainingArguments

    from remat import RematTrainer

    model = tiny_model()
    model.save_pretrained(tmp_path / "own", max_shard_size="50KB")
    _with_user_files(tmp_path / "own")
    shutil.copytree(tmp_path / "own", tmp_path / "wrapped")
    _trained(model)

    def args(folder):
        return TrainingArguments(output_dir=str(folder), report_to=[], use_cpu=True)

    Trainer(model=model, args=args(tmp_path / "own")).save_model()
    RematTrainer(model=CheckpointedModel(model), args=args(tmp_path / "wrapped")).save_model()
    own, wrapped = _files(tmp_path / "own"), _files(tmp_path / "wrapped")
    assert wrapped.pop("checkpoint_config.json")
    assert sorted(wrapped) == sorted(own) and "model-00001-of-00003.safetensors" not in own
    assert all(wrapped[name] == content for name, content in USER_FILES.items())
    _assert_loads(tmp_path / "wrapped", model)
