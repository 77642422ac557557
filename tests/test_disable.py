"""disable() leaves the model exactly as it was before wrapping."""

import gc
import io
import pickle
import weakref

import pytest
import torch
from conftest import (
    RecomputeCounter,
    add_lora,
    assert_same_grads,
    batch,
    decoder_layers,
    hook_snapshot,
    step_grads,
    tiny_model,
)

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


class _Around:
    """A picklable wrapper other code puts around a route (as TRL wraps `gradient_checkpointing_enable`)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _round_trip(model, how):
    """The wrapper `torch.save(cm)` / `torch.load` gives back, or `cm.model` pickled and wrapped again."""
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    if how == "pickle(cm.model)":
        copied = pickle.loads(pickle.dumps(cm.model))
        return copied.__dict__["_remat_owner"], CheckpointedModel(copied, CheckpointConfig(every_n_layers=2))
    buffer = io.BytesIO()
    torch.save(cm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    return loaded._controller, loaded


@pytest.mark.parametrize("how", ["torch.save(cm)", "pickle(cm.model)"])
def test_a_pickled_wrapper_or_model_disables_as_a_never_wrapped_twin_is(how, tmp_path):
    """After a pickle round trip, `disable()` put back none of the routes nor the `save_pretrained` /
    `load_adapter` overrides: the patches were remembered by the ids of the pickled values, which the
    loaded ones do not have, so each looked replaced by other code. The loaded model's instances now end
    as a never-wrapped twin's, its `save_pretrained` writes no `checkpoint_config.json`, and the
    controller that set the patches is freed with the wrapper, not kept alive by the model."""
    model = add_lora(tiny_model(), dropout=0.0)
    twin = pickle.loads(pickle.dumps(model))  # never wrapped
    data = batch()
    expected = step_grads(twin, _trainable(twin), data)[1]

    controller, cm = _round_trip(model, how)
    controller = weakref.ref(controller)
    loaded = cm.model
    counter = RecomputeCounter(decoder_layers(loaded))
    assert_same_grads(expected, step_grads(cm, _trainable(loaded), data)[1])
    assert counter.recomputed() == [0, 2]
    counter.remove()
    cm.disable()

    assert {n: set(vars(m)) for n, m in loaded.named_modules()} == {n: set(vars(m)) for n, m in twin.named_modules()}
    assert _public_attrs(loaded) == _public_attrs(twin)
    assert hook_snapshot(loaded) == hook_snapshot(twin)
    loaded.save_pretrained(tmp_path / "loaded")
    twin.save_pretrained(tmp_path / "twin")
    assert sorted(p.name for p in (tmp_path / "loaded").iterdir()) == sorted(
        p.name for p in (tmp_path / "twin").iterdir()
    )
    assert not (tmp_path / "loaded" / "checkpoint_config.json").exists()
    counter = RecomputeCounter(decoder_layers(loaded))
    assert_same_grads(expected, step_grads(loaded, _trainable(loaded), data)[1])
    assert counter.recomputed() == []
    del cm
    gc.collect()
    assert controller() is None, "the model no longer keeps remat's controller alive"


def test_a_route_other_code_replaced_before_a_pickle_stays_after_disable():
    """The round trip keeps the rule: a route other code wrapped is that code's, and stays."""
    model = add_lora(tiny_model())
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    inner = model.base_model.model
    inner.gradient_checkpointing_enable = _Around(inner.gradient_checkpointing_enable)
    buffer = io.BytesIO()
    torch.save(cm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.disable()
    kept = loaded.model.base_model.model.__dict__.get("gradient_checkpointing_enable")
    assert isinstance(kept, _Around)
    assert "gradient_checkpointing_disable" not in vars(loaded.model.base_model.model)
    assert "save_pretrained" not in vars(loaded.model)
    kept()
    assert loaded.model.base_model.model.is_gradient_checkpointing, "the wrapper reached transformers' method"


def test_disable_from_inference_mode_leaves_no_guard_on_the_layers():
    """The guards that refuse a layer's forward with gradients in inference mode stayed after `disable()` from it: the
    model, trained again on its own, refused its layers' forwards, one hook left on each."""
    model = tiny_model()
    hooks = hook_snapshot(model)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    cm.for_inference()
    cm.disable()
    assert hook_snapshot(model) == hooks
    model.train()
    layer = decoder_layers(model)[0]
    hidden = torch.randn(1, 4, model.config.hidden_size, requires_grad=True)
    position = model.model.rotary_emb(hidden, torch.arange(4)[None])
    layer(hidden, position_embeddings=position).sum().backward()  # trains as a never-wrapped model's layer does
    assert hidden.grad is not None
