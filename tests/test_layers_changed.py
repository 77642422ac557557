"""Layers pruned, replaced or added after wrapping (helper-89's trial): the map named layers that no longer ran
(recomputing none of the new ones), `enable` logged changes it then refused, and a save wrote a map of four layers
that no load into the pruned model accepted. Each is refused before anything runs, changes or is written, and the
way out the error names (disable, wrap again) trains exactly."""

import copy
import logging

import pytest
import torch
from conftest import RecomputeCounter, assert_same_grads, batch, decoder_layers, step_grads, tiny_model

from remat import CheckpointedModel, StateError


def _pruned(model):
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2


def _replaced(model):
    model.model.layers[1] = copy.deepcopy(model.model.layers[1])  # another module in its place (the old one kept)


def _added(model):
    model.model.layers.append(copy.deepcopy(model.model.layers[2]))  # depth up-scaling
    model.model.layers[4].self_attn.layer_idx = 4  # its own place in a KV cache
    model.config.num_hidden_layers = 5


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_pruned, "model.layers.2 is no longer in the model"),
        (_replaced, "model.layers.1 is another module than the layer wrapped"),
        (_added, "model.layers holds 5 modules, 4 when wrapped"),
    ],
    ids=["pruned", "replaced", "added"],
)
def test_a_step_an_enable_or_a_save_after_the_layers_changed_is_refused_changing_nothing(
    tmp_path, caplog, change, said
):
    model = tiny_model(attention_dropout=0.0)
    cm = CheckpointedModel(model, every_n_layers=1)
    kept = model.model.layers  # the layers of before (the pruned ones must stay alive for the check to matter)
    change(model)
    before = repr(cm.checkpoint_map)
    with caplog.at_level(logging.INFO, logger="remat"):
        for action, call in [
            ("a training forward", lambda: cm(**batch())),
            ("enable()", lambda: cm.enable(every_n_layers=2)),
            ("save_pretrained()", lambda: cm.save_pretrained(tmp_path / "saved")),
        ]:
            with pytest.raises(StateError, match=rf"^{action.replace('(', '.').replace(')', '.')}: .*\({said}\).*"):
                call()
    assert repr(cm.checkpoint_map) == before and cm.checkpoint_config.every_n_layers == 1
    assert not (tmp_path / "saved").exists()
    assert [r.getMessage() for r in caplog.records if "changed the checkpoint" in r.getMessage()] == []
    assert kept is not None


@pytest.mark.parametrize("change", [_pruned, _replaced, _added], ids=["pruned", "replaced", "added"])
def test_disabled_and_wrapped_again_the_changed_model_trains_exactly_with_its_own_map(change):
    model = tiny_model(attention_dropout=0.0)
    cm = CheckpointedModel(model, every_n_layers=1)
    change(model)
    cm.disable()
    reference = copy.deepcopy(model)
    for layer in decoder_layers(reference):  # the reference checkpoints nothing (a copy may carry remat's flag)
        layer.gradient_checkpointing = False
    cm = CheckpointedModel(model, every_n_layers=1)
    assert len(cm.checkpoint_map) == len(model.model.layers)
    counter = RecomputeCounter(decoder_layers(model))
    named = [(n, p) for n, p in model.named_parameters()]
    loss, grads = step_grads(cm, named, batch())
    assert counter.counts == [2] * len(model.model.layers)
    expected_loss, expected = step_grads(reference, list(reference.named_parameters()), batch())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert_same_grads(expected, grads)
    cm.disable()  # a layer copied from a flagged one (appended, or put in a place) carries no remat flag after it
    assert [vars(layer).get("gradient_checkpointing", False) for layer in decoder_layers(model)] == [False] * len(
        model.model.layers
    )
    counter.reset()
    step_grads(model, named, batch())
    assert counter.counts == [1] * len(model.model.layers)


def test_a_layer_inside_a_wrapper_put_in_its_place_is_still_the_layer():
    """torch.compile's OptimizedModule (or FSDP's wrapper) around a layer, in its place: not a change."""
    model = tiny_model()
    cm = CheckpointedModel(model, every_n_layers=1)
    model.model.layers[1] = torch.compile(model.model.layers[1])
    cm.enable(every_n_layers=2)
    assert [row.policy for row in cm.checkpoint_map] == ["recompute", "none", "recompute", "none"]


def test_a_layer_peft_put_in_a_modules_to_save_wrapper_after_wrapping_is_a_change():
    """PEFT's ModulesToSaveWrapper holds the layer but runs its copy: the map's row of that layer said nothing true
    (`layer_policies={3: "none"}` left the copy recomputing, and past `disable()`; review helper-90)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model()
    cm = CheckpointedModel(model, every_n_layers=1)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["layers.3"]))
    with pytest.raises(StateError, match=r"model.layers.3 is another module than the layer wrapped"):
        cm.enable(layer_policies={3: "none"})


@pytest.mark.parametrize("call", ["profile", "memory_report"])
def test_measuring_a_changed_model_is_refused_naming_the_call(call):
    model = tiny_model()
    cm = CheckpointedModel(model, every_n_layers=1)
    _added(model)
    with pytest.raises(StateError, match=rf"^{call}\(\): .*holds 5 modules, 4 when wrapped"):
        getattr(cm, call)(batch())
