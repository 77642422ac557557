"""Trainer(model=cm) checkpoints: adapters (not the full weights) plus checkpoint_config.json in
every folder, resume restores the map and continues exactly; what a plain Trainer does instead."""

import json
import logging

import pytest
import safetensors.torch
import torch
from conftest import RecomputeCounter, add_lora, decoder_layers, tiny_model
from test_trainer import _dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from remat import CheckpointConfig, CheckpointedModel, RematTrainer, remat_trainer_class
from remat.testing import trainer_checkpointing_args

SAVED = CheckpointConfig(every_n_layers=2, layer_policies={3: "recompute"})


def _args(output_dir, steps, checkpointing=True, **extra):
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=7,
        data_seed=7,
        **trainer_checkpointing_args(checkpointing, None),
        **extra,
    )


def _train(trainer_cls, model, output_dir, steps, resume=None, checkpointing=None, **extra):
    """Trainer asks for checkpointing whenever remat is there to take it (by default: a wrapper
    that is enabled): without remat, transformers 4.57 checkpoints reentrantly and a
    frozen-embedding PeftModel then has no grad."""
    rows = _dataset()
    if checkpointing is None:
        checkpointing = isinstance(model, CheckpointedModel) and model.is_enabled
    args = _args(output_dir, steps, checkpointing, **extra)
    trainer = trainer_cls(model=model, args=args, train_dataset=rows, eval_dataset=rows)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_checkpoints_hold_adapters_and_the_config_not_the_full_weights(tmp_path):
    cm = CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED)
    _train(RematTrainer, cm, tmp_path, steps=2)
    folder = tmp_path / "checkpoint-2"
    files = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "checkpoint_config.json"} <= files
    assert not files & {"model.safetensors", "pytorch_model.bin"}
    saved = json.loads((folder / "checkpoint_config.json").read_text())
    assert saved["every_n_layers"] == 2 and len(saved["layers"]) == 4
    adapters = safetensors.torch.load_file(folder / "adapter_model.safetensors")
    assert adapters and all("lora_" in name for name in adapters)
    trained = {n.replace(".default", ""): p for n, p in _trainable(cm.model).items()}
    for name, tensor in adapters.items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0, msg=name)


def test_trainer_given_the_wrapped_model_checkpoints_the_config_and_resumes_the_map(tmp_path):
    cm = CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED)
    _train(Trainer, cm.model, tmp_path, steps=2, checkpointing=True)
    folder = tmp_path / "checkpoint-2"
    assert (folder / "checkpoint_config.json").exists() and (folder / "adapter_model.safetensors").exists()
    assert json.loads((folder / "checkpoint_config.json").read_text())["every_n_layers"] == 2

    resumed = CheckpointedModel(add_lora(tiny_model(seed=3)))  # a different map before resuming
    counter = RecomputeCounter(decoder_layers(resumed.model))
    _train(Trainer, resumed.model, tmp_path, steps=3, resume=str(folder), checkpointing=True)
    assert resumed.checkpoint_config == SAVED
    assert counter.counts == [2, 1, 2, 2]  # the one step after resuming ran the saved map


def test_resuming_restores_the_map_and_continues_like_the_bare_model(tmp_path):
    """Trainer's own resume is not bit-equal to an uninterrupted run (data order, RNG), so the
    reference is the bare PeftModel saved and resumed by transformers' Trainer alone."""
    bare = add_lora(tiny_model(seed=3))
    _train(Trainer, bare, tmp_path / "bare", steps=2)
    bare = add_lora(tiny_model(seed=3))
    _train(Trainer, bare, tmp_path / "bare", steps=3, resume=str(tmp_path / "bare" / "checkpoint-2"))

    _train(RematTrainer, CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED), tmp_path / "cm", steps=2)
    resumed = CheckpointedModel(add_lora(tiny_model(seed=3)))  # another map before resuming
    counter = RecomputeCounter(decoder_layers(resumed.model))
    _train(RematTrainer, resumed, tmp_path / "cm", steps=3, resume=str(tmp_path / "cm" / "checkpoint-2"))

    assert resumed.checkpoint_config == SAVED
    assert counter.counts == [2, 1, 2, 2]  # the one step after resuming ran the saved map
    expected = _trainable(bare)
    for name, value in _trainable(resumed.model).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=0, msg=name)


def test_the_training_arguments_options_apply_over_a_resumed_map_on_every_release(tmp_path, caplog):
    """transformers 5 turns checkpointing on before loading a resumed checkpoint and 4.57 after, so the arguments'
    `every_n_layers` lost to the saved map on one release and won on the other (and a WARNING named the loser)."""
    _train(RematTrainer, CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED), tmp_path, steps=2)
    resumed = CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED)
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, save_strategy="no",
        report_to=[], use_cpu=True, seed=7, data_seed=7, **trainer_checkpointing_args(True, {"every_n_layers": 3}),
    )  # fmt: skip
    counter = RecomputeCounter(decoder_layers(resumed.model))
    with caplog.at_level(logging.WARNING, logger="remat"):
        trainer = RematTrainer(model=resumed, args=args, train_dataset=_dataset())
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.checkpoint_config == SAVED.replace(every_n_layers=3)
    assert counter.counts == [2, 1, 1, 2], "the one step after resuming ran the arguments' map over the saved one"
    said = [r.getMessage() for r in caplog.records if "apply over the resumed checkpoint's map" in r.getMessage()]
    assert (
        len(said) == 1
        and "every_n_layers 2 -> 3" in said[0]
        and said[0].endswith("recompute [0, 3], offload [], none [1, 2], swapped [], head plain)")
    )


def test_a_budgets_resume_says_nothing_of_arguments_that_change_nothing_it_runs(tmp_path, caplog):
    """Under a budget every layer's policy is planned: `every_n_layers` in the arguments changes nothing that runs,
    which the trainer's construction stays quiet about, but the resume warned of a map change that did not happen."""
    _train(RematTrainer, CheckpointedModel(add_lora(tiny_model(seed=3)), budget="1GiB"), tmp_path, steps=2)
    cm = CheckpointedModel(add_lora(tiny_model(seed=3)), budget="1GiB")
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, **trainer_checkpointing_args(True, {"every_n_layers": 3}),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="remat"):
        RematTrainer(model=cm, args=args, train_dataset=_dataset()).train(str(tmp_path / "checkpoint-2"))
    assert not [r for r in caplog.records if "apply over the resumed" in r.getMessage()]
    assert cm.checkpoint_config.every_n_layers == 3 and cm.budget_receipts, "applied, and the budget planned"


def test_a_plain_base_model_saves_its_weights_and_resume_restores_the_map(tmp_path):
    cm = CheckpointedModel(tiny_model(seed=3), SAVED)
    _train(RematTrainer, cm, tmp_path, steps=2)
    folder = tmp_path / "checkpoint-2"
    assert (folder / "config.json").exists() and (folder / "checkpoint_config.json").exists()
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and set(weights) <= set(cm.model.state_dict())
    assert not any(name.startswith("model.model.") for name in weights)  # the wrapper's prefix is gone

    resumed = CheckpointedModel(tiny_model(seed=4))  # other weights, other map
    _train(RematTrainer, resumed, tmp_path, steps=2, resume=str(folder))  # loads, trains no further step
    assert resumed.checkpoint_config == SAVED
    for name, value in resumed.model.state_dict().items():
        if name in weights:
            torch.testing.assert_close(value, weights[name], rtol=0, atol=0, msg=name)


def test_resuming_into_a_model_of_another_depth_is_refused(tmp_path):
    _train(RematTrainer, CheckpointedModel(tiny_model(seed=3), SAVED), tmp_path, steps=2)
    deeper = CheckpointedModel(tiny_model(seed=3, num_hidden_layers=6))
    with pytest.raises(ValueError, match="planned for 4 layers"):
        _train(RematTrainer, deeper, tmp_path, steps=3, resume=str(tmp_path / "checkpoint-2"))


def test_resuming_into_an_adapter_of_another_structure_is_refused_and_changes_nothing(tmp_path):
    """PEFT loads no tensor into an adapter of other target modules and says so only in the keys it returns: Trainer's
    resume then took the saved map and trained the untrained adapter on (and its optimizer state crashed)."""
    from peft import LoraConfig, get_peft_model

    from remat import SavedFileError

    _train(RematTrainer, CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED), tmp_path, steps=2)
    other = get_peft_model(tiny_model(seed=3), LoraConfig(r=4, target_modules=["k_proj"], init_lora_weights=False))
    cm = CheckpointedModel(other)
    before, map_before = {n: p.detach().clone() for n, p in other.named_parameters()}, cm.checkpoint_map
    trainer = RematTrainer(model=cm, args=_args(tmp_path, steps=3))
    with pytest.raises(SavedFileError, match=r"do not fit the model's adapter .*k_proj"):
        trainer._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    assert cm.checkpoint_map == map_before and cm.checkpoint_config == CheckpointConfig()


def _with_b(target, dropout=0.1):
    from peft import LoraConfig

    model = add_lora(tiny_model(seed=3), dropout=dropout)
    model.add_adapter("b", LoraConfig(r=2, target_modules=[target]))
    return model


def test_a_refused_resume_under_a_budget_puts_the_planned_map_back_and_says_so(tmp_path, remat_logs):
    """The first adapter's load applied the saved budget config (its plans cleared); undone, the map is the one
    planned for the current bucket again (it came back "pending": every layer recomputed), with a log line."""
    from conftest import batch, step_grads

    from remat import SavedFileError

    _train(RematTrainer, CheckpointedModel(_with_b("k_proj"), CheckpointConfig(budget="2GiB")), tmp_path, steps=2)
    other = _with_b("o_proj")
    cm = CheckpointedModel(other, own := CheckpointConfig(budget="1GiB"))
    step_grads(cm, [(n, p) for n, p in other.named_parameters() if p.requires_grad], batch())
    map_before = cm.checkpoint_map
    assert "planned for" in map_before[0].reason
    trainer = RematTrainer(model=cm, args=_args(tmp_path, steps=3))
    with pytest.raises(SavedFileError, match=r"adapter 'b'"):
        trainer._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    assert cm.checkpoint_config == own and cm.checkpoint_map == map_before
    assert [p.reason for p in cm.checkpoint_map] == [p.reason for p in map_before]
    # (transformers 5.17 and older refuse "b" before loading the main adapter: nothing to undo, nothing said)
    applied = "the saved checkpoint config replaced" in remat_logs.text
    assert applied == ("the resume was refused: the saved config is not applied" in remat_logs.text)


def test_resuming_a_second_adapter_checks_it_and_other_settings_of_the_same_structure_still_resume(tmp_path):
    """Trainer resumes each extra adapter from its folder inside the checkpoint (`load_adapter(ckpt/"b", "b")`),
    which holds no checkpoint_config.json: it is checked as the save's adapter. Another dropout (the same weights)
    resumes, as with PEFT alone."""
    from remat import SavedFileError

    with_b = _with_b
    _train(RematTrainer, CheckpointedModel(with_b("k_proj"), SAVED), tmp_path, steps=2)
    assert (tmp_path / "checkpoint-2" / "b" / "adapter_model.safetensors").exists()
    other = with_b("o_proj")
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in other.named_parameters()}
    refused = CheckpointedModel(other)
    map_before = refused.checkpoint_map
    trainer = RematTrainer(model=refused, args=_args(tmp_path, steps=3))
    with pytest.raises(SavedFileError, match=r"adapter 'b' .*do not fit the model's adapter"):
        trainer._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    # the default adapter, loaded before "b" was refused, is put back too, and the saved map is not applied
    for name, param in other.named_parameters():
        assert torch.equal(param, before[name][0]) and param.requires_grad == before[name][1], name
    assert refused.checkpoint_config == CheckpointConfig() and refused.checkpoint_map == map_before
    assert list(other.active_adapters) == ["default"]

    cm = CheckpointedModel(with_b("k_proj", dropout=0.0))
    RematTrainer(model=cm, args=_args(tmp_path, steps=3))._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    assert cm.checkpoint_config == SAVED
    # both adapters resumed (transformers 5.17 and older load only "b" from its subfolder; remat loads "default")
    params = dict(cm.model.named_parameters())
    for sub, adapter in (("", "default"), ("b", "b")):
        saved = safetensors.torch.load_file(tmp_path / "checkpoint-2" / sub / "adapter_model.safetensors")
        named = {k.replace(".weight", f".{adapter}.weight"): v for k, v in saved.items()}
        assert named and all(torch.equal(params[k], v) for k, v in named.items()), adapter
    assert list(cm.model.active_adapters) == ["default"]
    assert all(p.requires_grad == (".default." in n) for n, p in params.items() if ".lora_" in n)
    # a second resume of the same wrapper from the same folder (a notebook re-run) resumes "default" again
    with torch.no_grad():
        for name, param in params.items():
            if ".lora_" in name:
                param.zero_()
    RematTrainer(model=cm, args=_args(tmp_path, steps=3))._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    saved = safetensors.torch.load_file(tmp_path / "checkpoint-2" / "adapter_model.safetensors")
    assert all(torch.equal(params[k.replace(".weight", ".default.weight")], v) for k, v in saved.items())


def test_a_plain_trainers_multi_adapter_checkpoint_resumes_each_adapter_once(tmp_path, monkeypatch):
    """A checkpoint Trainer wrote without remat: each adapter is loaded once on every release (remat loads the
    main one only where Trainer did not; it loaded it a second time where Trainer had, on its own folders)."""
    from peft import PeftModel

    _train(Trainer, _with_b("k_proj"), tmp_path, steps=2, checkpointing=False)
    assert not (tmp_path / "checkpoint-2" / "checkpoint_config.json").exists()
    loads = []
    original = PeftModel.load_adapter
    monkeypatch.setattr(PeftModel, "load_adapter", lambda self, *a, **k: loads.append(a[1]) or original(self, *a, **k))
    cm = CheckpointedModel(_with_b("k_proj"))
    RematTrainer(model=cm, args=_args(tmp_path, steps=3))._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    assert sorted(loads) == ["b", "default"]
    saved = safetensors.torch.load_file(tmp_path / "checkpoint-2" / "adapter_model.safetensors")
    params = dict(cm.model.named_parameters())
    assert all(torch.equal(params[k.replace(".weight", ".default.weight")], v) for k, v in saved.items())


def test_load_best_model_at_end_loads_the_best_adapters_and_the_config(tmp_path):
    cm = CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED)
    extra = {
        "eval_strategy": "steps",
        "eval_steps": 2,
        "load_best_model_at_end": True,
        "metric_for_best_model": "loss",
        "greater_is_better": True,  # the loss falls, so the best one is the earlier checkpoint
    }
    trainer = _train(RematTrainer, cm, tmp_path, steps=4, **extra)
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    best = safetensors.torch.load_file(tmp_path / "checkpoint-2" / "adapter_model.safetensors")
    last = safetensors.torch.load_file(tmp_path / "checkpoint-4" / "adapter_model.safetensors")
    assert any(not torch.equal(best[name], last[name]) for name in best)
    loaded = {n.replace(".default", ""): p for n, p in _trainable(cm.model).items()}
    for name, tensor in best.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    assert cm.checkpoint_config == SAVED and trainer.model is cm.model and trainer.checkpointed_model is cm


def test_load_best_model_at_end_loads_a_named_adapter_from_its_subfolder_with_its_map(tmp_path):
    """An adapter with a name of its own is saved in a subfolder, which Trainer's best-model load does not read: it
    kept the last step's adapters (saying it could not locate the best model), and remat applied the best
    checkpoint's map to them: a mix that `save_model()` then wrote."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(seed=3), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), adapter_name="sft")
    cm = CheckpointedModel(model, SAVED)

    class ChangeTheMap(TrainerCallback):  # after the best checkpoint: the map at the end is another
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                cm.enable(CheckpointConfig(every_n_layers=1))

    extra = {"eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True}
    extra |= {"metric_for_best_model": "loss", "greater_is_better": True}  # the loss falls: the best is the first
    rows, args = _dataset(), _args(tmp_path, 4, True, **extra)
    trainer = RematTrainer(model=cm, args=args, train_dataset=rows, eval_dataset=rows, callbacks=[ChangeTheMap()])
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    best = safetensors.torch.load_file(tmp_path / "checkpoint-2" / "sft" / "adapter_model.safetensors")
    last = safetensors.torch.load_file(tmp_path / "checkpoint-4" / "sft" / "adapter_model.safetensors")
    assert any(not torch.equal(best[name], last[name]) for name in best)
    loaded = {n.replace(".sft", ""): p for n, p in _trainable(cm.model).items()}
    for name, tensor in best.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    assert cm.checkpoint_config == SAVED and cm.model.active_adapters == ["sft"]


def test_load_best_model_at_end_loads_the_active_named_adapter_beside_default_from_its_subfolder(tmp_path):
    """ "default" at the top of the folder and "b", active, in `b/`: Trainer's best-model load put the top file
    (default's weights) into "b", silently; every adapter is loaded from where PEFT saved it."""
    from peft import LoraConfig

    model = add_lora(tiny_model(seed=3), dropout=0.0, target_modules=("q_proj", "v_proj"))
    model.add_adapter("b", LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model.set_adapter("b")
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    extra = {"eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True}
    extra |= {"metric_for_best_model": "loss", "greater_is_better": True}  # the loss falls: the best is the first
    trainer = _train(RematTrainer, cm, tmp_path, steps=4, **extra)
    best = trainer.state.best_model_checkpoint
    assert best == str(tmp_path / "checkpoint-2")
    saved_b = safetensors.torch.load_file(tmp_path / "checkpoint-2" / "b" / "adapter_model.safetensors")
    last_b = safetensors.torch.load_file(tmp_path / "checkpoint-4" / "b" / "adapter_model.safetensors")
    assert any(not torch.equal(saved_b[name], last_b[name]) for name in saved_b)
    now = {n.replace(".b.", "."): p for n, p in cm.model.named_parameters() if ".b." in n}
    for name, tensor in saved_b.items():
        torch.testing.assert_close(now[name], tensor, rtol=0, atol=0, msg=name)
    assert cm.model.active_adapters == ["b"]


def test_any_trainer_subclass_gets_the_same_saving(tmp_path):
    class MyTrainer(Trainer):
        pass

    cls = remat_trainer_class(MyTrainer)
    assert issubclass(cls, MyTrainer) and remat_trainer_class(MyTrainer) is cls and remat_trainer_class(cls) is cls
    _train(cls, CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED), tmp_path, steps=2)
    files = {p.name for p in (tmp_path / "checkpoint-2").iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    with pytest.raises(TypeError, match="Trainer subclass"):
        remat_trainer_class(torch.nn.Module)


def test_other_models_go_through_the_base_trainer_untouched(tmp_path):
    model = add_lora(tiny_model(seed=3))  # not wrapped
    _train(RematTrainer, model, tmp_path, steps=2)
    files = {p.name for p in (tmp_path / "checkpoint-2").iterdir()}
    assert "adapter_model.safetensors" in files and "checkpoint_config.json" not in files


def test_the_config_is_written_even_while_remat_is_disabled(tmp_path, caplog):
    cm = CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED)
    cm.disable()
    _train(RematTrainer, cm, tmp_path, steps=2)
    assert json.loads((tmp_path / "checkpoint-2" / "checkpoint_config.json").read_text())["every_n_layers"] == 2

    other = CheckpointedModel(add_lora(tiny_model(seed=3)))
    other.disable()
    with caplog.at_level(logging.WARNING, logger="remat"):
        _train(RematTrainer, other, tmp_path, steps=2, resume=str(tmp_path / "checkpoint-2"))
    assert other.checkpoint_config == SAVED and not other.is_enabled  # off, with the saved config for enable()
    assert "checkpointing is disabled and stays off" in caplog.text
    assert not any(getattr(m, "gradient_checkpointing", False) for m in other.model.modules())
    other.enable()
    counter = RecomputeCounter(decoder_layers(other.model))
    _train(RematTrainer, other, tmp_path / "again", steps=1)
    assert counter.recomputed() == other.checkpoint_map.checkpointed == [0, 2, 3]


@pytest.mark.parametrize("weights_file", ["model.safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize("route", ["resume", "best_model"])
def test_a_folder_written_by_a_plain_trainer_loads_into_the_wrapper(tmp_path, caplog, weights_file, route):
    """A plain Trainer given `cm` (refused now, see test_trainer.py) wrote the whole wrapper under
    its own names (`model.`-prefixed) and no config: such folders still load into the wrapper."""
    cm = CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED)
    _train(RematTrainer, cm, tmp_path, steps=1)
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    saved = {name: value.detach().clone().contiguous() for name, value in cm.state_dict().items()}
    if weights_file == "pytorch_model.bin":  # as transformers 4.57 writes it with save_safetensors=False
        torch.save(saved, folder / weights_file)
    else:
        safetensors.torch.save_file(saved, folder / weights_file, metadata={"format": "pt"})
    resumed = CheckpointedModel(add_lora(tiny_model(seed=4)), SAVED)
    trainer = RematTrainer(model=resumed, args=_args(tmp_path, steps=2))
    with caplog.at_level(logging.INFO, logger="remat"):
        if route == "resume":
            trainer._load_from_checkpoint(str(folder))
            assert "holds the whole wrapper" in caplog.text
        else:
            trainer.state.best_model_checkpoint = str(folder)
            trainer._load_best_model()
    assert "the current checkpoint map stays" in caplog.text
    for name, value in resumed.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)


def test_resuming_keeps_checkpointing_off_when_a_route_turned_it_off(tmp_path):
    _train(RematTrainer, CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED), tmp_path, steps=2)
    cm = CheckpointedModel(add_lora(tiny_model(seed=3)))
    cm.model.gradient_checkpointing_disable()  # e.g. a generation toggle
    RematTrainer(model=cm, args=_args(tmp_path, steps=2))._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    assert cm.checkpoint_config == SAVED and cm.checkpoint_map.checkpointed == []
    cm.model.gradient_checkpointing_enable()
    assert cm.checkpoint_map.checkpointed == [0, 2, 3]


def test_a_model_init_that_returns_a_wrapper_is_unwrapped_like_a_model_argument(tmp_path):
    made = []

    def model_init():
        made.append(CheckpointedModel(add_lora(tiny_model(seed=3)), SAVED))
        return made[-1]

    trainer = RematTrainer(model_init=model_init, args=_args(tmp_path, steps=2), train_dataset=_dataset())
    trainer.train()
    cm = made[-1]
    assert trainer.checkpointed_model is cm and trainer.model is cm.model
    files = {p.name for p in (tmp_path / "checkpoint-2").iterdir()}
    assert {"adapter_model.safetensors", "checkpoint_config.json"} <= files and "model.safetensors" not in files
    assert [line["remat/layers"] for line in trainer.state.log_history if "remat/layers" in line] == [4]


def test_a_model_init_wrapper_whose_map_the_arguments_replace_is_warned_once(tmp_path, caplog):
    """As for model=cm: a WARNING that the arguments' options replace the wrapper's (Trainer calls model_init in
    __init__ and again in train(): said once), and options the route refuses refused when the trainer is built."""

    def arguments(**checkpointing):
        return TrainingArguments(
            output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True,
            gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing,
        )  # fmt: skip

    made = []

    def model_init():
        made.append(CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2)))
        return made[-1]

    with caplog.at_level("WARNING", logger="remat"):
        RematTrainer(model_init=model_init, args=arguments(every_n_layers=3), train_dataset=_dataset()).train()
    said = [r.getMessage() for r in caplog.records if "replace the CheckpointedModel's own config" in r.getMessage()]
    assert len(said) == 1 and "every_n_layers 2 -> 3" in said[0] and "head" in said[0].split("becomes")[1]
    assert made[-1].checkpoint_map.checkpointed == [0, 3]
    with pytest.raises(ValueError, match="determinism_check"):
        RematTrainer(model_init=model_init, args=arguments(determinism_check="none"), train_dataset=_dataset())


_KILLED_IN_THE_SECOND_SAVE = """
import sys, time
sys.path.insert(0, {tests!r})
import peft.peft_model
from conftest import add_lora, tiny_model
from test_trainer import _dataset
from test_trainer_checkpoints import SAVED, _args
from remat import CheckpointedModel, RematTrainer

calls, save = [0], peft.peft_model.safe_save_file
def slow_second(*args, **kwargs):
    save(*args, **kwargs)
    calls[0] += 1
    if calls[0] == 2:  # checkpoint-4's adapters are written into its staging folder: die here
        print("in the second save", flush=True)
        time.sleep(120)
peft.peft_model.safe_save_file = slow_second
cm = CheckpointedModel(add_lora(tiny_model()), SAVED)
RematTrainer(model=cm, args=_args({out!r}, 4), train_dataset=_dataset()).train()  # saves at steps 2 and 4
"""


def test_resume_true_after_a_save_killed_midway_resumes_from_the_last_whole_checkpoint(tmp_path, caplog):
    """SIGKILL while checkpoint-4 is being saved: Trainer's own choice (the highest number) is checkpoint-4, which
    holds only remat's unfinished staging folder; PEFT then took that folder for an adapter and raised. Resuming
    with True now starts from checkpoint-2, saying why, and trains on."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests, out = str(Path(__file__).parent), str(tmp_path / "out")
    script = _KILLED_IN_THE_SECOND_SAVE.format(tests=tests, out=out)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:  # other libraries print too (DeepSpeed's accelerator line): read up to the mark or the end
        assert "in the second save\n" in iter(child.stdout.readline, "")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not (tmp_path / "out" / "checkpoint-4" / "trainer_state.json").exists()
    assert (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").exists()

    cm = CheckpointedModel(add_lora(tiny_model()))
    trainer = RematTrainer(model=cm, args=_args(out, 3), train_dataset=_dataset())
    with caplog.at_level(logging.WARNING, logger="remat"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "interrupted" in r.getMessage()]
    assert len(warned) == 1 and "checkpoint-4" in warned[0] and warned[0].endswith("checkpoint-2"), warned
    assert cm.checkpoint_config == SAVED, "the map of checkpoint-2"
    assert not [n for n in os.listdir(tmp_path / "out" / "checkpoint-4") if n.startswith(".remat-staging")]

    (tmp_path / "out" / "checkpoint-9").write_text("a file, not a checkpoint")  # as Trainer, folders only
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat"):
        RematTrainer(model=cm, args=_args(out, 3), train_dataset=_dataset()).train(resume_from_checkpoint=True)
    assert not any("checkpoint-9" in r.getMessage() for r in caplog.records)
