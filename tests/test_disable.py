"""disable() leaves the model exactly as it was before wrapping."""

import pytest
import torch
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, hook_snapshot, step_grads, tiny_model

from remat import CheckpointConfig, CheckpointedModel


def _instance_attrs(model):
    return {name: dict(vars(m)) for name, m in model.named_modules()}


def _public_attrs(model):
    keep = (
        "gradient_checkpointing",
        "_gradient_checkpointing_func",
        "gradient_checkpointing_enable",
        "gradient_checkpointing_disable",
        "activation_checkpointing_enable",
        "activation_checkpointing_disable",
        "_remat_owner",
        "forward",
    )
    return {name: {k: v for k, v in vars(m).items() if k in keep} for name, m in model.named_modules()}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_disable_restores_parameters_state_dict_hooks_attributes_and_outputs(lora):
    model = tiny_model()
    if lora:
        model = add_lora(model)
    model.eval()
    data = batch()
    with torch.no_grad():
        expected = model(**data).logits
    params = {n: p for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks, attrs = hook_snapshot(model), _public_attrs(model)
    model.train()

    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    step_grads(cm, named, data)
    model.gradient_checkpointing_enable(every_n_layers=3)
    cm.for_inference()
    cm.for_training()
    for _, p in named:
        p.grad = None
    cm.disable()

    assert not cm.is_enabled
    assert {n: p for n, p in model.named_parameters()} == params  # same objects, by identity
    assert all(a is b for a, b in zip(model.parameters(), params.values(), strict=True))
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], state[k]) for k in state)
    assert hook_snapshot(model) == hooks
    assert _public_attrs(model) == attrs
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**data).logits, expected)
    model.train()
    counter = RecomputeCounter(decoder_layers(model))
    step_grads(model, named, data)
    assert counter.recomputed() == []


def test_disable_restores_checkpointing_enabled_natively_before_wrapping():
    model = tiny_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    before = {
        name: (vars(m).get("gradient_checkpointing"), vars(m).get("_gradient_checkpointing_func"))
        for name, m in model.named_modules()
    }
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    counter = RecomputeCounter(decoder_layers(model))
    step_grads(cm, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 2], "the map, not the native every-layer setting, runs"
    cm.disable()
    after = {
        name: (vars(m).get("gradient_checkpointing"), vars(m).get("_gradient_checkpointing_func"))
        for name, m in model.named_modules()
    }
    assert after == before
    counter.reset()
    step_grads(model, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 1, 2, 3]


def test_routes_are_native_again_after_disable_and_enable_reinstalls():
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    cm.disable()
    assert "gradient_checkpointing_enable" not in vars(model)
    cm.enable()
    model.gradient_checkpointing_enable(every_n_layers=3)
    counter = RecomputeCounter(decoder_layers(model))
    step_grads(cm, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 3]
    cm.disable()
    cm.disable()  # twice is harmless
    CheckpointedModel(model)  # the model can be wrapped again once released


def test_a_deep_copy_of_a_wrapper_disables_its_own_model_and_leaves_the_original_wrapped():
    """`copy.deepcopy(cm)` then `copy.disable()`: the copy's model gets back exactly the attributes
    it had before wrapping (no route, no save_pretrained override left on the instance), and the
    original keeps its own routes until it is disabled in turn. (The patches were remembered by
    the ids of the original's values, which a copy does not have: the copy's undo skipped them.)"""
    import copy

    model = tiny_model()
    before = set(model.__dict__)
    cm = CheckpointedModel(model)
    twin = copy.deepcopy(cm)
    twin.disable()
    assert set(twin.model.__dict__) == before
    assert type(twin.model).gradient_checkpointing_enable is twin.model.gradient_checkpointing_enable.__func__
    assert "gradient_checkpointing_enable" in cm.model.__dict__  # the original is still wrapped
    cm.disable()
    assert set(cm.model.__dict__) == before
