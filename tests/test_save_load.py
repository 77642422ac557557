"""Saving and loading the checkpoint config beside the adapters (Trainer: test_trainer_checkpoints.py)."""

import json
import os

import pytest
import torch
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, step_grads, tiny_model

from remat import CheckpointConfig, CheckpointedModel, ConfigError, RematError, SavedFileError
from remat.trainer import _apply_saved_config

EVERYTHING = CheckpointConfig(
    every_n_layers=3,
    checkpoint_policy="offload",
    offload_min_bytes=1024,
    swap_layers=1,
    swap_placement="tail",
    layer_policies={2: "recompute", 3: "none"},
    use_reentrant=True,
    preserve_rng_state=False,
)


def _trained_lora(seed=0):
    model = add_lora(tiny_model(seed=seed))
    cm = CheckpointedModel(model, EVERYTHING)
    step_grads(cm, [(n, p) for n, p in model.named_parameters() if p.requires_grad], batch())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.01)
    return cm


def _adapter_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_round_trip_with_lora_and_every_option(tmp_path):
    cm = _trained_lora()
    cm.save_pretrained(tmp_path / "save")
    files = sorted(os.listdir(tmp_path / "save"))
    assert {"adapter_config.json", "adapter_model.safetensors", "checkpoint_config.json"} <= set(files)
    saved = json.loads((tmp_path / "save" / "checkpoint_config.json").read_text())
    assert saved["layers"] == [p.name.removeprefix("base_model.model.") for p in cm.checkpoint_map]  # as the base's
    assert list(saved) == sorted(saved)
    assert saved["format_version"] == 3 and saved["remat_version"]

    loaded = CheckpointedModel.from_pretrained(tiny_model(seed=0), tmp_path / "save")
    assert loaded.checkpoint_config == EVERYTHING and loaded.checkpoint_map == cm.checkpoint_map
    assert loaded.model.training
    expected = _adapter_weights(cm.model)
    got = _adapter_weights(loaded.model)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    counter = RecomputeCounter(decoder_layers(loaded.model))
    step_grads(loaded, [(n, p) for n, p in loaded.model.named_parameters() if p.requires_grad], batch())
    assert counter.recomputed() == loaded.checkpoint_map.checkpointed == [0, 2, 3]  # 3: swapped, so checkpointed


def test_extra_adapters_get_their_subfolder_as_peft_writes_them(tmp_path):
    from peft import LoraConfig

    cm = _trained_lora()
    cm.model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"]))
    cm.save_pretrained(tmp_path / "save")
    assert (tmp_path / "save" / "second" / "adapter_config.json").exists()


def _adapters_trainable(model):
    return {a: {p.requires_grad for n, p in model.named_parameters() if a in n.split(".")} for a in model.peft_config}


def test_an_adapter_saved_frozen_loads_frozen_and_the_active_adapter_is_active_again(tmp_path):
    """DPO's reference adapter is frozen beside the trained one: a trainable load made it trainable too; and a save
    made with another adapter active loaded with "default" active (other logits, 0.78 apart in a user's trial)."""
    from peft import LoraConfig

    cm = _trained_lora()
    cm.model.add_adapter("ref", LoraConfig(r=2, target_modules=["k_proj"]))
    with torch.no_grad():
        for name, param in cm.model.named_parameters():
            if "lora_B.ref" in name:
                param.normal_()
    assert _adapters_trainable(cm.model) == {"default": {True}, "ref": {False}}
    cm.save_pretrained(tmp_path / "dpo")
    loaded = CheckpointedModel.from_pretrained(tiny_model(seed=0), tmp_path / "dpo")
    assert _adapters_trainable(loaded.model) == {"default": {True}, "ref": {False}}
    assert loaded.model.active_adapters == ["default"]
    frozen = CheckpointedModel.from_pretrained(tiny_model(seed=0), tmp_path / "dpo", is_trainable=False)
    assert _adapters_trainable(frozen.model) == {"default": {False}, "ref": {False}}

    cm.model.set_adapter("ref")  # PEFT: "ref" active and trainable, "default" frozen
    cm.save_pretrained(tmp_path / "ref")
    cm.model.eval()
    with torch.no_grad():
        expected = cm.model(**batch()).logits
    loaded = CheckpointedModel.from_pretrained(tiny_model(seed=0), tmp_path / "ref")
    assert loaded.model.active_adapters == ["ref"]
    assert _adapters_trainable(loaded.model) == {"default": {False}, "ref": {True}}
    loaded.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(**batch()).logits, expected, rtol=0, atol=0)


def test_a_load_into_a_peft_model_that_has_the_adapters_gives_them_as_saved_and_a_failed_one_changes_nothing(
    tmp_path, monkeypatch
):
    """Into a PeftModel whose "b" is frozen and "default" active: "b" (saved active and trainable) comes back active
    and trainable, so the next step trains it (it stayed frozen: backward raised). A load that fails after PEFT's
    leaves the active adapters and every flag as they were."""
    from peft import LoraConfig

    from remat.saving.folder import Snapshot

    def with_b(seed):
        model = add_lora(tiny_model(seed=seed))
        model.add_adapter("b", LoraConfig(r=2, target_modules=["k_proj"], init_lora_weights=False))
        return model

    source = with_b(0)
    source.set_adapter("b")
    CheckpointedModel(source).save_pretrained(tmp_path / "b")
    target = with_b(1)
    before = (list(target.active_adapters), _adapters_trainable(target))
    assert before == (["default"], {"default": {True}, "b": {False}})

    monkeypatch.setattr(Snapshot, "unchanged", lambda self: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        CheckpointedModel.from_pretrained(target, tmp_path / "b")
    assert (list(target.active_adapters), _adapters_trainable(target)) == before
    monkeypatch.undo()

    loaded = CheckpointedModel.from_pretrained(target, tmp_path / "b")
    assert loaded.model.active_adapters == ["b"]
    assert _adapters_trainable(loaded.model) == {"default": {False}, "b": {True}}
    loss, grads = step_grads(loaded, [(n, p) for n, p in loaded.model.named_parameters() if p.requires_grad], batch())
    assert grads and all(".b." in name for name in grads)


def test_a_save_of_several_adapters_that_does_not_say_which_was_active_loads_with_one_warning(tmp_path, caplog):
    """Saves before `active_adapters` was recorded loaded "default" active (another than when saved: other logits)
    with no word; a save that records it loads silently."""
    import json

    from peft import LoraConfig

    source = add_lora(tiny_model())
    source.add_adapter("b", LoraConfig(r=2, target_modules=["k_proj"], init_lora_weights=False))
    source.set_adapter("b")
    CheckpointedModel(source).save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="remat"):
        assert CheckpointedModel.from_pretrained(tiny_model(), tmp_path).model.active_adapters == ["b"]
    assert "older remat" not in caplog.text
    file = tmp_path / "checkpoint_config.json"
    saved = json.loads(file.read_text())
    del saved["active_adapters"]  # as an older remat wrote it
    file.write_text(json.dumps(saved))
    caplog.clear()
    with caplog.at_level("WARNING", logger="remat"):
        loaded = CheckpointedModel.from_pretrained(tiny_model(), tmp_path)
    (said,) = [r.getMessage() for r in caplog.records if "older remat" in r.getMessage()]
    assert "['default'] is active now" in said and "cm.model.set_adapter(name)" in said
    assert loaded.model.active_adapters == ["default"]


def test_an_adapter_named_as_a_base_module_is_recorded_by_its_own_weights(tmp_path):
    from peft import LoraConfig

    model = add_lora(tiny_model())
    model.add_adapter("layers", LoraConfig(r=2, target_modules=["k_proj"]))  # frozen: not the active one
    CheckpointedModel(model).save_pretrained(tmp_path / "save")
    adapters = json.loads((tmp_path / "save" / "checkpoint_config.json").read_text())["adapters"]
    assert (adapters["default"]["trainable"], adapters["layers"]["trainable"]) == (True, False)


def test_a_malformed_trainable_flag_is_refused_like_any_malformed_adapter_entry(tmp_path):
    _trained_lora().save_pretrained(tmp_path / "save")
    file = tmp_path / "save" / "checkpoint_config.json"
    data = json.loads(file.read_text())
    data["adapters"]["default"]["trainable"] = "yes"
    file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"adapter 'default' must name .*trainable: true or false"):
        CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "save")


def test_inference_load_and_plain_base_model(tmp_path):
    cm = _trained_lora()
    cm.save_pretrained(tmp_path / "lora")
    loaded = CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "lora", is_trainable=False)
    assert not loaded.model.training and not loaded.model.is_gradient_checkpointing
    assert not any(p.requires_grad for p in loaded.model.parameters())

    base = CheckpointedModel(tiny_model(), CheckpointConfig(every_n_layers=2))
    base.save_pretrained(tmp_path / "base")
    # the model's own save beside the config (it was the config alone, the weights nowhere)
    assert {"checkpoint_config.json", "config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "base"))
    again = CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "base")
    assert again.checkpoint_map.checkpointed == [0, 2]


@pytest.mark.parametrize("given", ["False", 0, None, "config"])
def test_is_trainable_other_than_true_or_false_is_refused_before_the_model_changes(tmp_path, given):
    """`is_trainable="False"` loaded trainable adapters, 0 failed inside torch after PEFT had started, and a
    config given by position (the constructor's order) landed in is_trainable: the saved config was used."""
    _trained_lora().save_pretrained(tmp_path / "lora")
    model = tiny_model()
    before = {name: module for name, module in model.named_modules()}
    with pytest.raises(TypeError, match="is_trainable must be True or False"):
        value = CheckpointConfig(every_n_layers=4) if given == "config" else given
        CheckpointedModel.from_pretrained(model, tmp_path / "lora", is_trainable=value)
    assert dict(model.named_modules()) == before, "no adapter layer was added"
    with pytest.raises(TypeError, match="positional argument"):
        CheckpointedModel.from_pretrained(model, tmp_path / "lora", CheckpointConfig(every_n_layers=4))


def test_an_adapter_saved_while_another_trains_loads_trainable_as_peft_loads_it(tmp_path):
    """`set_adapter("b")` freezes "default"; a save of "default" alone wrote it "trainable": false, so the load
    (is_trainable=True) kept it frozen and the first backward failed in torch. PEFT's own load trains it."""
    from peft import LoraConfig, PeftModel

    cm = _trained_lora()
    cm.model.add_adapter("b", LoraConfig(r=2, target_modules=["k_proj"]))
    cm.model.set_adapter("b")
    cm.save_pretrained(tmp_path / "save", selected_adapters=["default"])
    by_peft = PeftModel.from_pretrained(tiny_model(), tmp_path / "save", is_trainable=True)
    loaded = CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "save")
    trainable = lambda model: sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable(loaded.model) == trainable(by_peft) != []
    step_grads(loaded, [(n, p) for n, p in loaded.model.named_parameters() if p.requires_grad], batch())


def test_a_save_of_a_wrapper_loaded_for_inference_loads_trainable_when_asked(tmp_path):
    """Every adapter was saved frozen (the wrapper had been loaded with is_trainable=False), so a load with
    is_trainable=True kept it frozen, silently, and the first step failed in torch (no tensor requires grad)."""
    cm = _trained_lora()
    trained = {n for n, p in cm.model.named_parameters() if p.requires_grad}
    cm.save_pretrained(tmp_path / "trained")
    served = CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "trained", is_trainable=False)
    served.save_pretrained(tmp_path / "copy")
    again = CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "copy", is_trainable=True)
    assert {n for n, p in again.model.named_parameters() if p.requires_grad} == trained
    again(**batch()).loss.backward()
    frozen = CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "copy", is_trainable=False)
    assert not any(p.requires_grad for p in frozen.model.parameters())
    nothing_trains = add_lora(tiny_model()).requires_grad_(False)  # as PEFT's from_pretrained loads it by default
    CheckpointedModel(nothing_trains).save_pretrained(tmp_path / "frozen")
    again = CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "frozen", is_trainable=True)
    assert {n for n, p in again.model.named_parameters() if p.requires_grad} == trained


@pytest.mark.parametrize(
    "keywords, said",
    [
        ({"every_n_layers": 3}, r"every_n_layers= would be ignored; .*cm.enable\(every_n_layers=...\)"),
        ({"config": CheckpointConfig(every_n_layers=3)}, r"config= would be ignored; .*cm.enable\(config\)"),
        ({"is_trainble": False}, "did you mean 'is_trainable'"),
        ({"offload_host_budgt": "1GiB"}, "did you mean 'offload_host_budget'"),
        ({"adapter_name": "mine"}, r"cm.model.load_adapter\(folder, adapter_name=...\)"),
    ],
)
def test_keywords_peft_would_ignore_or_misread_are_refused_before_anything_loads(tmp_path, keywords, said):
    """PEFT took them: a config field or a misspelt keyword was ignored without a word, adapter_name= failed inside
    PEFT ("got multiple values for keyword argument")."""
    _trained_lora().save_pretrained(tmp_path)
    base = tiny_model()
    with pytest.raises(TypeError, match=said) as refused:
        CheckpointedModel.from_pretrained(base, tmp_path, **keywords)
    assert isinstance(refused.value, RematError) and not hasattr(base, "peft_config")
    assert CheckpointedModel.from_pretrained(base, tmp_path).model.peft_config  # then it loads


@pytest.mark.parametrize(
    "keywords, said",
    [
        ({"safe_serilization": False}, "did you mean 'safe_serialization'"),
        ({"selected_adapter": ["default"]}, "did you mean 'selected_adapters'"),
        ({"state_dic": {}}, "did you mean 'state_dict'"),
    ],
)
def test_a_misspelt_save_keyword_is_refused_before_anything_is_written(tmp_path, keywords, said):
    """PEFT's save takes any keyword and ignores those it does not read: `safe_serilization=False` wrote
    safetensors without a word."""
    cm = _trained_lora()
    with pytest.raises(TypeError, match=said) as refused:
        cm.save_pretrained(tmp_path / "save", **keywords)
    assert isinstance(refused.value, RematError) and not (tmp_path / "save").exists()
    cm.save_pretrained(tmp_path / "save", safe_serialization=False)  # spelt right, it is PEFT's
    assert (tmp_path / "save" / "adapter_model.bin").is_file()


def test_a_model_of_another_depth_is_refused_before_anything_changes(tmp_path):
    _trained_lora().save_pretrained(tmp_path / "save")
    other = tiny_model(num_hidden_layers=6)
    names = [n for n, _ in other.named_modules()]
    with pytest.raises(ValueError, match=r"planned for 4 layers.*this model has 6"):
        CheckpointedModel.from_pretrained(other, tmp_path / "save")
    assert [n for n, _ in other.named_modules()] == names, "no adapter was injected"


def test_saved_adapter_tensors_that_find_no_place_in_the_model_are_refused_not_dropped(tmp_path):
    """A module named otherwise in the model loaded into (another transformers release fuses or renames some: a
    Qwen2-MoE's expert LoRA saved on 5.24, loaded on 4.57) gets no adapter from PEFT, which drops its saved tensors
    with a warning at most: the load went through, the training lost. Refused, naming them; the model as it was."""
    _trained_lora().save_pretrained(tmp_path / "save")
    other = tiny_model(num_hidden_layers=4)
    attention = other.model.layers[0].self_attn
    attention.query = attention.q_proj  # layer 0's q_proj under another name
    del attention.q_proj
    names, weights = [n for n, _ in other.named_modules()], {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(SavedFileError, match=r"'default' does not fit this model: 2 of its saved tensors find no"):
        CheckpointedModel.from_pretrained(other, tmp_path / "save")
    assert [n for n, _ in other.named_modules()] == names, "no adapter was left injected"
    assert all(torch.equal(v, weights[k]) for k, v in other.state_dict().items()) and len(weights) == len(
        other.state_dict()
    )


def test_as_many_layers_named_otherwise_are_refused_naming_another_release_and_the_way_to_load(tmp_path):
    """transformers renames modules between releases (a Llava saved on 4.57 has its vision layers elsewhere on 5.x):
    the refusal said "load it into the model it was saved from", which it was. It says what may have changed and
    the load that may work (PEFT's, which converts renamed keys, checked for keys it could not place; then the saved
    settings); the refused load changed nothing."""
    _trained_lora().save_pretrained(tmp_path / "save")
    other = tiny_model()
    other.model.blocks = other.model.layers  # the same layers under another name, as another release names them
    del other.model.layers
    names = [n for n, _ in other.named_modules()]
    with pytest.raises(SavedFileError, match=r"another transformers release.*Nothing was loaded") as refused:
        CheckpointedModel.from_pretrained(other, tmp_path / "save")
    assert "check that it warns of no missing or unexpected keys" in str(refused.value)
    assert "CheckpointConfig.from_pretrained(folder)" in str(refused.value)
    assert [n for n, _ in other.named_modules()] == names


def test_a_frozen_adapter_saved_with_layers_named_otherwise_loads_beside_and_drops_no_tensor(tmp_path):
    """A frozen adapter loaded beside the one training (a reference) does not take the map saved with it, yet was
    refused for that map's layer names (a save from another transformers release). It loads now, the map as it
    was; loaded trainable, the map would be taken: still refused. Saved tensors PEFT finds no place for (a module
    named otherwise) refuse the load, undone, where PEFT dropped them."""
    saved = CheckpointedModel(add_lora(tiny_model()), EVERYTHING, layer_class="LlamaMLP")  # layers named otherwise
    saved.save_pretrained(tmp_path / "mlp")
    cm = CheckpointedModel(add_lora(tiny_model(seed=1)), CheckpointConfig(every_n_layers=2))
    before = cm.checkpoint_config
    cm.model.load_adapter(tmp_path / "mlp", adapter_name="ref", is_trainable=False)
    assert "ref" in cm.model.peft_config and cm.checkpoint_config == before
    reference = {n: p for n, p in cm.model.named_parameters() if ".ref." in n}
    assert reference and not any(p.requires_grad for p in reference.values())
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    loaded, saved_weights = (
        get_peft_model_state_dict(cm.model, adapter_name="ref"),
        load_file(tmp_path / "mlp" / "adapter_model.safetensors"),
    )
    assert loaded.keys() == saved_weights.keys() and all(torch.equal(loaded[k], saved_weights[k]) for k in loaded)
    with pytest.raises(SavedFileError, match=r"planned for 4 layers"):
        cm.model.load_adapter(tmp_path / "mlp", adapter_name="again", is_trainable=True)
    attention = cm.model.base_model.model.model.layers[0].self_attn
    attention.query = attention.q_proj  # layer 0's q_proj (and its LoRA) under another name
    del attention.q_proj
    with pytest.raises(SavedFileError, match=r"'other' does not fit this model: 2 of its saved tensors find no place"):
        cm.model.load_adapter(tmp_path / "mlp", adapter_name="other", is_trainable=False)
    assert "other" not in cm.model.peft_config and cm.checkpoint_config == before
    CheckpointedModel(add_lora(tiny_model(num_hidden_layers=2))).save_pretrained(tmp_path / "shallow")
    with pytest.raises(SavedFileError, match=r"'shallow' does not fit this model: 12 of the adapter's tensors"):
        cm.model.load_adapter(tmp_path / "shallow", adapter_name="shallow", is_trainable=False)  # 2 of 4 layers
    assert "shallow" not in cm.model.peft_config and cm.checkpoint_config == before


def test_embedding_layers_saved_whole_beside_the_adapter_load_back(tmp_path, monkeypatch):
    """`save_embedding_layers=True` saves the (resized) embedding and head whole beside the adapter; PEFT loads them.
    The check for saved tensors a load would drop counted them as such (PEFT's "auto" leaves them out: and asks the
    Hub)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def resized(seed):
        model = tiny_model(seed=seed)
        model.resize_token_embeddings(model.config.vocab_size + 8)
        return model

    cm = CheckpointedModel(add_lora(resized(0)), CheckpointConfig(every_n_layers=2))
    with torch.no_grad():
        cm.model.base_model.model.model.embed_tokens.weight[-8:].fill_(0.5)
    cm.save_pretrained(tmp_path / "save", save_embedding_layers=True)
    loaded = CheckpointedModel.from_pretrained(resized(1), tmp_path / "save")
    assert torch.all(loaded.model.base_model.model.model.embed_tokens.weight[-8:] == 0.5)
    other = CheckpointedModel(add_lora(resized(2)))
    other.model.load_adapter(tmp_path / "save", adapter_name="ref", is_trainable=False)
    assert "ref" in other.model.peft_config


@pytest.mark.parametrize(
    "content", ["", '{"every_n_layers": 2', "[]", '{"every_n_layers": "2"}', '{"layers": 3}', '{"active_adapters": 3}']
)
def test_corrupt_truncated_and_empty_files_are_clear_errors(tmp_path, content):
    (tmp_path / "checkpoint_config.json").write_text(content)
    with pytest.raises(ValueError, match=r"checkpoint_config\.json"):
        CheckpointedModel.from_pretrained(tiny_model(), tmp_path)


def test_a_save_interrupted_mid_write_leaves_the_previous_save_intact(tmp_path, monkeypatch):
    cm = _trained_lora()
    cm.save_pretrained(tmp_path / "save")
    before = {f: (tmp_path / "save" / f).read_bytes() for f in os.listdir(tmp_path / "save")}
    with torch.no_grad():
        next(p for n, p in cm.model.named_parameters() if "lora_B" in n).add_(1.0)
    from remat.saving import folder

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(folder, "write_file_atomically", crash)  # after the adapters were written
    with pytest.raises(KeyboardInterrupt):
        cm.save_pretrained(tmp_path / "save")
    monkeypatch.undo()
    after = {f: (tmp_path / "save" / f).read_bytes() for f in os.listdir(tmp_path / "save")}
    assert after == before
    assert sorted(os.listdir(tmp_path)) == ["save"], "no staging folder left behind"


def test_wrapping_and_saving_leave_use_cache_and_parameter_names_alone(tmp_path):
    model = add_lora(tiny_model())
    names = [n for n, _ in model.named_parameters()]
    cm = CheckpointedModel(model)
    step_grads(cm, [(n, p) for n, p in model.named_parameters() if p.requires_grad], batch())
    cm.save_pretrained(tmp_path / "save")
    assert model.config.use_cache is True and [n for n, _ in model.named_parameters()] == names
    model.get_base_model().save_pretrained(tmp_path / "base")
    assert json.loads((tmp_path / "base" / "config.json").read_text())["use_cache"] is True


def test_a_save_made_by_peft_alone_is_refused_naming_how_to_load_and_wrap_it(tmp_path):
    from peft import PeftModel

    from remat import NotSavedError

    add_lora(tiny_model()).save_pretrained(tmp_path / "peft")
    model = tiny_model()
    with pytest.raises(NotSavedError, match=r"PEFT adapter saved without remat.*PeftModel\.from_pretrained"):
        CheckpointedModel.from_pretrained(model, tmp_path / "peft")
    assert not hasattr(model, "peft_config")
    cm = CheckpointedModel(PeftModel.from_pretrained(model, tmp_path / "peft", is_trainable=True))  # as it says
    assert cm.checkpoint_map.checkpointed == [0, 1, 2, 3]


def test_accelerates_save_pattern_with_the_wrappers_state_dict_writes_the_adapters(tmp_path):
    """`accelerator.unwrap_model(cm).save_pretrained(out, state_dict=accelerator.get_state_dict(cm), ...)`, the
    pattern accelerate documents: the wrapper's names sit under `model.`, where PEFT found no adapter and wrote an
    empty file that loaded with untrained weights."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(_trained_lora())
    state_dict = accelerator.get_state_dict(prepared)
    assert all(key.startswith("model.") for key in state_dict)
    unwrapped = accelerator.unwrap_model(prepared)
    unwrapped.save_pretrained(tmp_path, save_function=accelerator.save, state_dict=state_dict)
    loaded = CheckpointedModel.from_pretrained(tiny_model(), tmp_path)
    expected = _adapter_weights(unwrapped.model)
    assert expected and _adapter_weights(loaded.model).keys() == expected.keys()
    for name, weight in _adapter_weights(loaded.model).items():
        assert torch.equal(weight, expected[name]), name
    assert loaded.checkpoint_config == EVERYTHING


def test_a_state_dict_that_would_save_nothing_it_holds_is_refused_and_nothing_is_written(tmp_path):
    """A state dict without the adapters' weights (PEFT wrote an empty adapter), or given for a model without PEFT
    (remat saves its config alone: the weights were dropped without a word). A refused save leaves no folder it
    made (an empty one stayed behind)."""
    cm = _trained_lora()
    with pytest.raises(ConfigError, match="none of adapter 'default'"):
        cm.save_pretrained(tmp_path / "a", state_dict={"other." + k: v for k, v in cm.state_dict().items()})
    two = _trained_lora()  # another adapter beside it: a selected one's weights are found; PEFT names a wrong name
    two.model.add_adapter("b", two.model.peft_config["default"])
    two.save_pretrained(tmp_path / "two", selected_adapters=["b"], state_dict=two.state_dict())
    assert os.listdir(tmp_path / "two" / "b")
    with pytest.raises(ValueError, match="invalid `selected_adapters`"):
        two.save_pretrained(tmp_path / "c" / "in", selected_adapters=["zzz"], state_dict=two.state_dict())
    merged = CheckpointedModel(add_lora(tiny_model()))
    merged.model.merge_and_unload()  # PEFT's own: the adapters hold no weight any more, which the save names
    with pytest.raises(RematError, match="holds no adapter weight any more"):
        merged.save_pretrained(tmp_path / "d", state_dict=merged.model.state_dict())
    assert os.listdir(tmp_path) == ["two"]


def test_a_full_model_saves_its_weights_beside_the_config_as_its_own_save_does(tmp_path):
    """A model without PEFT saved checkpoint_config.json alone: accelerate's no-Trainer save,
    `accelerator.unwrap_model(model).save_pretrained(...)` with `prepare(cm)`, left a folder with no weights, without a
    word. It writes what `cm.model.save_pretrained` writes; a `state_dict=` under the wrapper's names too."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    model = tiny_model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)  # not what a fresh model of the config holds
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(CheckpointedModel(model, every_n_layers=2))
    for folder, state_dict in (("plain", None), ("named", accelerator.get_state_dict(prepared))):
        accelerator.unwrap_model(prepared).save_pretrained(
            tmp_path / folder,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=state_dict,
        )
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        for name, value in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), (folder, name)
        assert CheckpointedModel.from_pretrained(loaded, tmp_path / folder).checkpoint_config.every_n_layers == 2
    # transformers' keywords are checked as PEFT's were (a typo was ignored by the save it reached)
    cm = accelerator.unwrap_model(prepared)
    with pytest.raises(TypeError, match="did you mean 'max_shard_size'"):
        cm.save_pretrained(tmp_path / "typo", max_shard_sise="50KB")
    # a module of your own with a save of its own (no transformers model) saves the config alone, as before
    container = torch.nn.Module()
    container.inner, container.save_pretrained = tiny_model(), lambda folder: None
    CheckpointedModel(container, layer_class="LlamaDecoderLayer").save_pretrained(tmp_path / "own", save_function=print)
    assert os.listdir(tmp_path / "own") == ["checkpoint_config.json"]


def test_push_to_hub_from_a_save_while_wrapped_is_refused_before_anything_is_written(tmp_path):
    """A save is staged in a folder of its own: pushed from there, transformers named the repository after the
    staging folder, or uploaded the save without checkpoint_config.json."""
    for cm in (CheckpointedModel(tiny_model()), CheckpointedModel(add_lora(tiny_model()))):
        for save in (cm.save_pretrained, cm.model.save_pretrained):
            with pytest.raises(TypeError, match=r"push_to_hub=True.*upload_folder"):
                save(tmp_path / "hub", push_to_hub=True, repo_id="me/model")
    assert not os.listdir(tmp_path)


def test_a_frozen_adapter_loaded_beside_the_trained_one_leaves_the_map_and_a_trainable_load_applies_its_map(
    tmp_path, caplog
):
    """TRL's DPO reference adapter: `load_adapter(sft_folder, adapter_name="reference")` is another run's adapter,
    loaded frozen; it replaced the running wrapper's config (a budget too) with the map saved beside it."""
    sft = CheckpointedModel(add_lora(tiny_model(num_hidden_layers=4)), CheckpointConfig(checkpoint_policy="offload"))
    sft.save_pretrained(tmp_path / "sft")
    config = CheckpointConfig(budget="64MiB", budget_scope="activations")
    cm = CheckpointedModel(add_lora(tiny_model(num_hidden_layers=4)), config)
    with caplog.at_level("INFO", logger="remat"):
        cm.model.load_adapter(str(tmp_path / "sft"), adapter_name="reference", is_trainable=False)
    assert cm.checkpoint_config == config
    assert "'reference' loaded frozen beside those training" in caplog.text
    assert "reference" in cm.model.peft_config and cm.model.active_adapters == ["default"]
    resumed = CheckpointedModel(add_lora(tiny_model(num_hidden_layers=4)), config)  # the folder's map not taken yet:
    resumed.model.load_adapter(str(tmp_path / "sft"), adapter_name="reference", is_trainable=False)
    _apply_saved_config(resumed, str(tmp_path / "sft"), "resuming")  # a resume from it applies it (DeepSpeed's path)
    assert resumed.checkpoint_config.checkpoint_policy == "offload"
    cm.model.load_adapter(str(tmp_path / "sft"), adapter_name="trained", is_trainable=True)
    assert cm.checkpoint_config.checkpoint_policy == "offload" and cm.checkpoint_config.budget is None
