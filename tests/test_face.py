"""The public face says each thing one way: `cm.config` is the model's config and
`cm.checkpoint_config` remat's; offload is the "offload" policy; planning is `cm.profile(...).plan(...)`;
the Trainer support is `RematTrainer` / `remat_trainer_class`. Names a user may still write are
refused with the way that replaced them."""

import inspect
import json

import pytest
from conftest import add_lora, tiny_model
from transformers import Trainer

import remat
from remat import CheckpointConfig, CheckpointedModel, RematTrainer, remat_trainer_class


def test_cm_config_is_the_models_config_and_checkpoint_config_is_remats_after_enable_replace_and_load(tmp_path):
    peft_model = add_lora(tiny_model())
    base_config = peft_model.get_base_model().config
    cm = CheckpointedModel(peft_model, every_n_layers=2)
    assert cm.config is base_config and cm.config is peft_model.config
    cm.config.use_cache = False  # what Trainer and TRL write
    assert base_config.use_cache is False and cm.config.to_dict() == base_config.to_dict()
    with pytest.raises(AttributeError):
        cm.config.every_n_layers  # noqa: B018 (remat's fields are not the model's)
    assert type(cm.checkpoint_config) is CheckpointConfig and cm.checkpoint_config.every_n_layers == 2

    cm.enable(every_n_layers=3)
    assert cm.checkpoint_config.every_n_layers == 3 and cm.config is base_config

    cm.disable()
    replacing = CheckpointedModel(peft_model, every_n_layers=4)  # takes the model over
    assert replacing.config is base_config and replacing.checkpoint_config.every_n_layers == 4
    assert cm.checkpoint_config.every_n_layers == 3, "the replaced wrapper keeps its own config"

    replacing.save_pretrained(tmp_path)
    loaded = CheckpointedModel.from_pretrained(tiny_model(), tmp_path)
    assert loaded.config is loaded.model.get_base_model().config and loaded.config is not base_config
    assert loaded.checkpoint_config == replacing.checkpoint_config


def test_remat_trainer_class_of_trainer_is_remat_trainer():
    assert remat_trainer_class(Trainer) is RematTrainer
    with pytest.raises(remat.ConfigTypeError, match=r"needs a transformers.Trainer subclass, got \[1\]"):
        remat_trainer_class([1])  # was a bare "unhashable type" from the cache


def test_dir_and_help_list_the_names_loaded_on_first_use_and_the_configs_fields():
    assert set(remat.__all__) <= set(dir(remat)), set(remat.__all__) - set(dir(remat))
    assert CheckpointConfig(swap_layers=range(2)).swap_layers == (0, 1)
    with pytest.raises(remat.ConfigTypeError):  # bytes are a sequence of ints too
        CheckpointConfig(swap_layers=b"\x00\x02")
    from remat.planner import PlannedConfig

    with pytest.raises(TypeError, match="predicted_bytes"):  # a misspelt prediction was set as a stray attribute
        PlannedConfig.of(CheckpointConfig(), predicted_bytes=None)
    import dataclasses

    replaced = dataclasses.replace(PlannedConfig.of(CheckpointConfig(), outside_bytes=0, choices=()), every_n_layers=2)
    with pytest.raises(AttributeError, match=r"planned\.replace"):  # was AttributeError: 'outside_bytes'
        print(replaced.predicted_device_bytes)
    fields = list(inspect.signature(CheckpointConfig).parameters)
    assert fields[:3] == ["every_n_layers", "offload_min_bytes", "swap_layers"], fields
    assert not [name for name in inspect.signature(CheckpointedModel).parameters if name.startswith("_")]


def test_offload_is_asked_for_as_a_policy_and_the_old_flag_is_refused_naming_it():
    offload = r'checkpoint_policy="offload"'
    with pytest.raises(TypeError, match=offload):
        CheckpointConfig(offload=True)
    with pytest.raises(TypeError, match=offload):
        CheckpointConfig().replace(offload=True)
    with pytest.raises(TypeError, match=offload):
        CheckpointedModel(tiny_model(), offload=True)
    cm = CheckpointedModel(tiny_model(), every_n_layers=2)
    with pytest.raises(TypeError, match=offload):
        cm.enable(offload=True)
    assert cm.checkpoint_config == CheckpointConfig(every_n_layers=2)
    cm.enable(checkpoint_policy="offload")
    assert [p.policy for p in cm.checkpoint_map] == ["offload", "none", "offload", "none"]
    assert [p.offloaded for p in cm.checkpoint_map] == [True, False, True, False]


def test_a_route_asking_for_selective_and_offload_at_once_is_refused_and_changes_nothing():
    model = tiny_model()
    cm = CheckpointedModel(model, every_n_layers=2)
    with pytest.raises(ValueError, match="two policies"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"selective": True, "offload": True})
    assert cm.checkpoint_config == CheckpointConfig(every_n_layers=2)


def _saved(tmp_path, **fields):
    data = {"format_version": 3, **fields}
    (tmp_path / "checkpoint_config.json").write_text(json.dumps(data))
    return tmp_path


def test_a_config_saved_with_the_old_offload_flag_loads_as_the_offload_policy(tmp_path):
    loaded = CheckpointConfig.from_pretrained(
        _saved(tmp_path, every_n_layers=2, offload=True, layer_policies={"1": "none"})
    )
    assert loaded == CheckpointConfig(every_n_layers=2, checkpoint_policy="offload", layer_policies={1: "none"})
    assert CheckpointConfig.from_pretrained(_saved(tmp_path, offload=False)) == CheckpointConfig()


def test_a_config_saved_with_the_old_flag_over_selective_layers_is_refused_naming_the_fix(tmp_path):
    folder = _saved(tmp_path, offload=True, layer_policies={"2": "selective"})
    with pytest.raises(ValueError, match=r'"selective" layers .* Remove "offload"'):
        CheckpointConfig.from_pretrained(folder)


def test_plan_for_budget_is_refused_naming_profile_then_plan():
    cm = CheckpointedModel(tiny_model())
    with pytest.raises(AttributeError, match=r"cm\.profile\(batch, \.\.\.\)\.plan\(budget"):
        cm.plan_for_budget({}, "1GiB")


def test_the_trainer_mixin_is_refused_naming_the_two_trainer_names():
    with pytest.raises(AttributeError, match=r"remat\.RematTrainer .*remat_trainer_class\(YourTrainer\)"):
        remat.RematTrainerMixin  # noqa: B018


def test_code_still_reading_cm_config_as_remats_is_pointed_to_checkpoint_config(tmp_path):
    """`cm.config` was remat's config: `cm.config.save_pretrained(folder)` now writes the model's config.json, and
    the load that follows, or `cm.enable(cm.config)`, names `cm.checkpoint_config`."""
    cm = CheckpointedModel(add_lora(tiny_model()), every_n_layers=2)
    cm.config.save_pretrained(tmp_path)  # the old line: the model's config.json, no checkpoint_config.json
    for load in (
        CheckpointConfig.from_pretrained,
        lambda folder: CheckpointedModel.from_pretrained(tiny_model(), folder),
    ):
        with pytest.raises(
            remat.NotSavedError, match=r"config.json is a model's: .*cm.checkpoint_config.save_pretrained"
        ):
            load(tmp_path)
    with pytest.raises(
        remat.ConfigTypeError, match=r"cm.config is the model's config; remat's is cm.checkpoint_config"
    ):
        cm.enable(cm.config)
    assert cm.checkpoint_config.every_n_layers == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(remat.NotSavedError) as plain:  # an empty folder: no word of model configs
        CheckpointConfig.from_pretrained(tmp_path / "empty")
    assert "config.json" not in str(plain.value).replace("checkpoint_config.json", "")
