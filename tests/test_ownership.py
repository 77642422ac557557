"""Ownership: one model, one wrapper at a time. A wrapper whose model another wrapper has taken
stays replaced, and disabling any set of wrappers in any order leaves the model exactly as it
was before the first wrap: no flag, shim, route, override, hook or marker of remat's."""

import contextlib
import copy
import gc

import pytest
import torch
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, step_grads, tiny_model

from remat import CheckpointConfig, CheckpointedModel
from remat.controller import owners_of
from remat.model import controller_of

_DICT_ATTRIBUTES = ("_parameters", "_buffers", "_modules")


def _plain(value):
    """How an attribute is compared: simple values by value, anything else by identity."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    if isinstance(value, dict):
        return ("dict", tuple((k, _plain(v)) for k, v in value.items()))
    return ("object", id(value))


def snapshot(model):
    """Every module's instance attributes (hook dicts and the parameter/module tables included),
    the model config's fields, and every tensor's value: what remat may touch."""
    modules = {name: {k: _plain(v) for k, v in vars(m).items()} for name, m in model.named_modules()}
    config = dict(vars(model.config)) if hasattr(model, "config") else {}
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return modules, config, tensors


def assert_as_before(model, before):
    modules, config, tensors = snapshot(model)
    assert modules.keys() == before[0].keys()
    for name, attributes in before[0].items():
        assert modules[name] == attributes, (
            f"{name or 'the model'}: {sorted(set(modules[name].items()) ^ set(attributes.items()))}"
        )
    assert config == before[1]
    assert tensors.keys() == before[2].keys()
    assert all(torch.equal(tensors[k], before[2][k]) for k in tensors)


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _recomputed(call, model):
    counter = RecomputeCounter(decoder_layers(model))
    step_grads(call, _trainable(model), batch())
    counter.remove()
    model.zero_grad(set_to_none=True)
    return counter.recomputed()


def test_a_replaced_wrapper_refuses_to_come_back_and_the_new_map_is_what_runs(tmp_path):
    model = add_lora(tiny_model())
    cm1 = CheckpointedModel(model)
    cm1.disable()
    cm2 = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    with pytest.raises(RuntimeError, match=r"enable\(\): another CheckpointedModel took this wrapper's model over"):
        cm1.enable()
    with pytest.raises(RuntimeError, match=r"for_training\(\): another CheckpointedModel took"):
        cm1.for_training()
    # a save would write cm1's config beside adapters that train under cm2's map: a load would bring it back
    with pytest.raises(RuntimeError, match=r"save_pretrained\(\): another CheckpointedModel took"):
        cm1.save_pretrained(tmp_path / "save")
    assert not (tmp_path / "save").exists()
    assert not cm1.is_enabled
    assert cm2.checkpoint_map.checkpointed == [0, 2]
    assert _recomputed(cm2, model) == [0, 2], "cm2's map, and only it, runs"


def test_a_replaced_wrapper_stays_replaced_after_the_new_one_is_disabled_too():
    model = add_lora(tiny_model())
    cm1 = CheckpointedModel(model)
    cm1.disable()
    CheckpointedModel(model, CheckpointConfig(every_n_layers=2)).disable()
    with pytest.raises(RuntimeError, match="another CheckpointedModel took"):
        cm1.enable()
    assert "replaced by another CheckpointedModel" in str(cm1.checkpoint_map)
    cm3 = CheckpointedModel(model, CheckpointConfig(every_n_layers=3))  # a new wrapper is welcome
    assert _recomputed(cm3, model) == [0, 3]


@pytest.mark.parametrize("order", ["new then old", "old then new"])
def test_disabling_every_wrapper_in_any_order_leaves_the_model_as_before_the_first_wrap(order):
    model = add_lora(tiny_model())
    before = snapshot(model)
    cm1 = CheckpointedModel(model, CheckpointConfig(every_n_layers=2, swap_layers=[1]))
    step_grads(cm1, _trainable(model), batch())
    model.gradient_checkpointing_disable()  # a route, as TRL calls it around generation
    model.gradient_checkpointing_enable()
    cm1.disable()
    cm2 = CheckpointedModel(model, CheckpointConfig(every_n_layers=2, checkpoint_policy="offload", offload_min_bytes=0))
    with contextlib.suppress(RuntimeError):  # refused (the test above); whatever it does, the end is clean
        cm1.enable()
    with cm2.for_inference():
        pass
    step_grads(cm2, _trainable(model), batch())
    model.zero_grad(set_to_none=True)
    for wrapper in (cm2, cm1) if order == "new then old" else (cm1, cm2):
        wrapper.disable()
    assert_as_before(model, before)
    assert _recomputed(model, model) == []


def test_a_takeover_from_a_dropped_wrapper_then_disable_leaves_the_model_as_before():
    model = add_lora(tiny_model())
    before = snapshot(model)
    CheckpointedModel(model, CheckpointConfig(every_n_layers=2, swap_layers=[3]))
    gc.collect()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=3))
    assert _recomputed(cm, model) == [0, 3]
    cm.disable()
    assert_as_before(model, before)


def test_a_wrapper_disabled_and_enabled_again_without_a_rival_is_its_own_owner():
    model = add_lora(tiny_model())
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    cm.disable()
    cm.enable()
    cm.for_training()
    assert _recomputed(cm, model) == [0, 2]


def test_exit_without_enter_says_how_to_use_the_context_manager():
    cm = CheckpointedModel(add_lora(tiny_model()))
    with pytest.raises(RuntimeError, match=r"__exit__\(\) without a matching cm.__enter__\(\).*with cm.for_inference"):
        cm.__exit__(None, None, None)
    with cm.for_inference():
        assert not cm.model.training
    assert cm.model.training


def test_a_shallow_copy_of_a_wrapper_is_refused_and_ownership_never_moves_to_a_copy():
    """copy.copy(cm) would share cm's model and controller; once such a copy was dropped, the live
    wrapper counted as gone and a second wrapper took the model over."""
    model = add_lora(tiny_model())
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    with pytest.raises(TypeError, match=r"copy\.copy\(cm\).*copy\.deepcopy\(cm\)"):
        copy.copy(cm)
    twin = copy.deepcopy(cm)  # the independent copy the refusal names
    assert twin.model is not model and _recomputed(twin, twin.model) == [0, 2]
    del twin
    gc.collect()
    with pytest.raises(ValueError, match="already wrapped by another CheckpointedModel"):
        CheckpointedModel(model)
    assert cm.is_enabled and _recomputed(cm, model) == [0, 2]


_REMAT_ATTRIBUTES = {
    "_remat_owner",
    "gradient_checkpointing",
    "_gradient_checkpointing_func",
    "gradient_checkpointing_enable",
    "gradient_checkpointing_disable",
    "forward",
    "save_pretrained",
    "load_adapter",
}


@pytest.mark.parametrize("outer_first", [False, True], ids=["base then PeftModel", "PeftModel then base"])
def test_a_second_wrapper_over_the_same_layers_through_a_model_inside_or_around_is_refused(outer_first):
    """A wrapper of the base model, then `get_peft_model(base)` wrapped (as the save's refusal says to): both
    would own the same layers, the first one's map no longer what runs, and disabling both left a shim behind.
    The second is refused (either nesting) until the first is disabled; then it takes the layers over."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model()
    remat_kind = lambda m: {k: _plain(v) for k, v in vars(m).items() if k in _REMAT_ATTRIBUTES}
    before = {id(m): remat_kind(m) for m in base.modules()}  # (LlamaModel sets gradient_checkpointing itself)
    lora = lambda: get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    peft_model = lora() if outer_first else None
    first = CheckpointedModel(peft_model if outer_first else base, CheckpointConfig(every_n_layers=2))
    peft_model = peft_model or lora()
    second_target = base if outer_first else peft_model
    with pytest.raises(ValueError, match=r"another CheckpointedModel .*layers.* disable\(\) first"):
        CheckpointedModel(second_target, checkpoint_policy="offload")
    assert first.is_enabled and _recomputed(first, base) == [0, 2], "the first map, and only it, runs"
    first.disable()
    second = CheckpointedModel(second_target, CheckpointConfig(every_n_layers=3))
    with pytest.raises(RuntimeError, match="another CheckpointedModel took"):
        first.enable()  # replaced through the layers the two share
    assert _recomputed(second, base) == [0, 3]
    second.disable()
    left = {name: remat_kind(m) for name, m in peft_model.named_modules() if remat_kind(m) != before.get(id(m), {})}
    assert not left, f"no flag, shim, route or marker of either wrapper is left: {left}"


def test_a_layer_copied_alone_carries_no_wrapper_and_a_freed_layer_does_not_stop_disable():
    """The layers' owner is kept outside them (a strong marker on each layer made `copy.deepcopy(layer)` copy the
    whole model through the controller, and a wrapper of a model holding the copy failed on the stale owner); a
    layer freed while wrapped no longer stops `disable()` taking every marker off."""
    model = add_lora(tiny_model())
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    layer = decoder_layers(model)[0]
    twin = copy.deepcopy(layer)
    assert sum(p.numel() for p in twin.parameters()) == sum(p.numel() for p in layer.parameters())
    assert "_remat_owner" not in vars(twin) and owners_of(torch.nn.ModuleList([twin])) == []
    assert owners_of(layer) == [controller_of(cm)], "the original layer is known as taken"

    del model.base_model.model.model.layers[3]
    gc.collect()
    cm.disable()
    assert "_remat_owner" not in vars(model) and not cm.is_enabled and owners_of(model) == []
    assert "layers" in repr(cm.checkpoint_map)
    CheckpointedModel(model).disable()  # the model can be wrapped again


def test_a_trainer_of_a_replaced_wrapper_refuses_to_save_its_stale_config(tmp_path):
    """RematTrainer(model=cm1) kept saving cm1's config after cm2 took the model over (review of the refusal)."""
    from transformers import TrainingArguments

    from remat import RematTrainer

    model = add_lora(tiny_model())
    cm1 = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no")
    trainer = RematTrainer(model=cm1, args=args)
    cm1.disable()
    CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    with pytest.raises(RuntimeError, match=r"RematTrainer's save: another CheckpointedModel took"):
        trainer.save_model(str(tmp_path / "saved"))
    assert not (tmp_path / "saved" / "checkpoint_config.json").exists()
