"""Ctrl-C anywhere (a KeyboardInterrupt: a BaseException, not an Exception), then the same process goes on.

torch runs a forward hook registered with `always_call=True` on an Exception only, and code that puts state back
under `except Exception` does nothing on a KeyboardInterrupt; a copy of gigabytes of swapped weights home is where a
Ctrl-C (or an out-of-memory error) lands. Each test injects the interrupt where it was found to leave something behind
(a trial of every stage, helper-84), then checks the next step against a model never wrapped."""

import copy

import pytest
import torch
from conftest import add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model

from remat import CheckpointConfig, CheckpointedModel
from remat.controller import Controller


def _model():
    return add_lora(tiny_model(attention_dropout=0.0), dropout=0.0)


def _interrupt(module):
    """A forward pre-hook on `module` that presses Ctrl-C; returns its handle."""

    def ctrl_c(mod, args):
        raise KeyboardInterrupt

    return module.register_forward_pre_hook(ctrl_c)


def _interrupt_apply_map_once(monkeypatch):
    """Ctrl-C the first time a map is applied (after a replan's swap, before the flags follow)."""
    apply, calls = Controller.apply_map, [0]

    def interrupted_once(self):
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        apply(self)

    monkeypatch.setattr(Controller, "apply_map", interrupted_once)


def _exact(cm, plain, data=None):
    data = data or batch(seed=3)
    _, grads = step_grads(cm, list(cm.model.named_parameters()), data)
    _, expected = step_grads(plain, list(plain.named_parameters()), data)
    assert_same_grads(expected, grads)


def test_an_interrupted_copy_home_of_swapped_weights_keeps_them_swapped_and_a_retry_brings_them_home(monkeypatch):
    """On an accelerator, bringing swapped layers home copies each weight from host memory: the second copy
    interrupted left a layer forgotten by the swapper with its weights at the placeholders' zeros, its host copy gone
    (a retry swapped the zeros out and trained on them). The copies are made before anything changes; the host copy
    is what a device copy is made from, so the test makes CPU host copies look pinned (as they are on CUDA)."""
    model, plain = _model(), None
    plain = copy.deepcopy(model)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[1, 2]))
    copies, to = [0], torch.Tensor.to

    def copying(self, *args, **kwargs):
        if kwargs.get("copy"):
            copies[0] += 1
            if copies[0] == 2:
                raise KeyboardInterrupt
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(torch.Tensor, "to", copying)
    with pytest.raises(KeyboardInterrupt):
        cm.disable()
    monkeypatch.undo()
    assert copies[0] == 2, "the copies home ran (and the second was interrupted)"
    cm.disable()  # the user tries again
    for name, weight in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], weight, rtol=0, atol=0, msg=name)
    cm.enable()
    _exact(cm, plain)


def test_an_interrupted_construction_undoes_its_swap_and_install(monkeypatch):
    """Interrupted after its swap and before its install was complete, `CheckpointedModel(...)` left the layer's
    weights at zeros with remat's guards on it and no owner to find: a retried wrapper computed another loss."""
    model = _model()
    plain = copy.deepcopy(model)
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    install = Controller._install

    def interrupted(self):
        install(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(Controller, "_install", interrupted)
    with pytest.raises(KeyboardInterrupt):
        CheckpointedModel(model, CheckpointConfig(swap_layers=[1]))
    monkeypatch.undo()
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()] == hooks
    for name, weight in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], weight, rtol=0, atol=0, msg=name)
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(model))
    _exact(CheckpointedModel(model, CheckpointConfig(swap_layers=[1])), plain)


def test_an_interrupted_enable_leaves_the_swap_config_map_and_flags_of_before(monkeypatch):
    """`enable(swap_layers=...)` interrupted after its swap and before the flags followed the map: the config and the
    map said layer 1 was swapped and recomputed, its flag said it ran plainly, and its backward read the placeholders
    (gradients wrong, no error). Everything is as before the call, and the next step exact."""
    model = _model()
    plain = copy.deepcopy(model)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))  # layer 1: "none"
    config, shown, flags = cm.checkpoint_config, repr(cm.checkpoint_map), cm.checkpoint_map.checkpointed
    _interrupt_apply_map_once(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        cm.enable(swap_layers=[1])
    monkeypatch.undo()
    assert (cm.checkpoint_config, repr(cm.checkpoint_map)) == (config, shown)
    running = [i for i, layer in enumerate(decoder_layers(model)) if layer.gradient_checkpointing]
    assert running == flags
    _exact(cm, plain)


@pytest.mark.parametrize("tuner", ["peft", "tuner calls forward"])
def test_a_training_forward_interrupted_under_the_chunked_head_leaves_generation_as_it_was(tuner):
    """torch skipped the head's end-of-call hook on a Ctrl-C, and its hook on lm_head stayed: PEFT's generate calls
    the base model's forward (not the wrapper's model's, whose next forward would have removed it), and the head
    was handed no tokens (an IndexError). PEFT 0.17-0.18's tuner calls the causal LM's `forward` itself, past its
    hooks (a hook there never saw the training forward): imitated on the instance."""
    from peft import LoraConfig, get_peft_model

    model = _model()
    if tuner == "tuner calls forward":  # PeftModelForCausalLM (TRL's), whose forward calls its tuner's
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        model = get_peft_model(tiny_model(attention_dropout=0.0), lora)
    plain = copy.deepcopy(model)
    if tuner == "tuner calls forward":
        tuner_model = model.base_model
        tuner_model.forward = lambda *args, **kwargs: tuner_model.model.forward(*args, **kwargs)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2, head="chunked", head_chunk_tokens=8))
    handle = _interrupt(cm.layers[2])
    with pytest.raises(KeyboardInterrupt):
        cm(**batch()).loss.backward()
    handle.remove()
    prompt = batch()["input_ids"][:, :5]
    with cm.for_inference():
        generated = cm.generate(input_ids=prompt, max_new_tokens=3, do_sample=False)
    plain.eval()
    assert torch.equal(generated, plain.generate(input_ids=prompt, max_new_tokens=3, do_sample=False))
    plain.train()
    _exact(cm, plain)


def test_a_training_forward_interrupted_under_a_budget_does_not_make_the_next_forward_owe_a_backward():
    """The budget's watch of a forward's backward (a forward hook that removes itself) stayed after a Ctrl-C, fired on
    the next forward (an evaluation with gradients on, its loss kept), and a step of another bucket was refused as if
    a backward were owed."""
    model = _model()
    plain = copy.deepcopy(model)
    cm = _budget_cm(model)
    handle = _interrupt(cm.layers[2])
    with pytest.raises(KeyboardInterrupt):
        cm(**batch()).loss.backward()
    handle.remove()
    with cm.for_inference():
        kept = cm(**batch()).loss  # noqa: F841 - held, as a notebook's variable holds it
    _exact(cm, plain, batch(seed=4, size=4, seq=24))  # another bucket, another plan


@pytest.mark.parametrize("trainable", [True, False])
def test_a_load_interrupted_as_it_sets_the_mode_leaves_the_base_model_as_it_was(tmp_path, monkeypatch, trainable):
    """The mode switch at the end of `from_pretrained` ran outside what a refused load undoes: interrupted there, the
    base model kept PEFT's adapter layers and remat's install, and no wrapper was returned to disable them."""
    from conftest import lora_value, marked_lora_cm

    marked_lora_cm(0.25, seed=1).save_pretrained(tmp_path)
    base = tiny_model(seed=1)
    plain = copy.deepcopy(base)
    names = [name for name, _ in base.named_modules()]
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in base.modules()]
    mode = "for_training" if trainable else "for_inference"

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(CheckpointedModel, mode, interrupted)
    with pytest.raises(KeyboardInterrupt):
        CheckpointedModel.from_pretrained(base, tmp_path, is_trainable=trainable)
    monkeypatch.undo()
    assert [name for name, _ in base.named_modules()] == names
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in base.modules()] == hooks
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(base))
    assert base.training == plain.training
    with torch.no_grad():
        logits = [(torch.manual_seed(0), model(**batch()).logits)[1] for model in (base, plain)]  # the same dropout
    torch.testing.assert_close(*logits, rtol=0, atol=0)
    assert lora_value(CheckpointedModel.from_pretrained(base, tmp_path, is_trainable=trainable)) == 0.25


def test_a_join_or_leave_of_the_swap_interrupted_between_its_steps_keeps_the_weights_and_trains_exactly(monkeypatch):
    """A layer joining the swap was put at rest and guarded before the swapper knew it: interrupted there, `enable`
    put the map back but the layer's weights stayed zeros with no host copy. A layer leaving, brought home and
    unhooked before it was forgotten: interrupted there, it stayed listed without hooks and trained on zeros from
    its second step. Each interrupted, then three steps trained on without a retry: exact, and disable() gives
    back every weight."""
    import remat.swap.swapper as swapper_module

    model = _model()
    plain = copy.deepcopy(model)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    guard = swapper_module.guard_layer

    def guarded_then_interrupted(swapper, layer, module):
        guard(swapper, layer, module)
        raise KeyboardInterrupt

    monkeypatch.setattr(swapper_module, "guard_layer", guarded_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        cm.enable(swap_layers=[1])
    monkeypatch.undo()
    for seed in range(3):
        _exact(cm, plain, batch(seed=seed))
    cm.enable(swap_layers=[1])
    home = swapper_module.WeightSwapper._bring_home

    def home_then_interrupted(self, layer):
        home(self, layer)
        raise KeyboardInterrupt

    monkeypatch.setattr(swapper_module.WeightSwapper, "_bring_home", home_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        cm.enable(swap_layers=[])
    monkeypatch.undo()
    for seed in range(3):
        _exact(cm, plain, batch(seed=seed))
    cm.disable()
    for name, weight in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], weight, rtol=0, atol=0, msg=name)


def _budget_cm(model):
    probe = CheckpointedModel(copy.deepcopy(model))
    budget = max(p.predicted_device_bytes for p in probe.profile(batch(), repeats=1, progress=False).frontier())
    probe.disable()  # a budget the first step's bucket fits with nothing recomputed, and a longer one does not
    cm = CheckpointedModel(model, CheckpointConfig(budget=budget, budget_scope="activations"))
    cm(**batch()).loss.backward()  # profiled, planned
    return cm


def test_a_budgets_watch_left_by_a_ctrl_c_goes_with_disable():
    """The budget's watch a Ctrl-C left stayed on the model after `disable()`: a plain forward of the unwrapped model
    then owed a backward, and after `enable()` a step of another bucket was refused."""
    model = _model()
    plain = copy.deepcopy(model)
    cm = _budget_cm(model)
    handle = _interrupt(cm.layers[2])
    with pytest.raises(KeyboardInterrupt):
        cm(**batch()).loss.backward()
    handle.remove()
    cm.disable()
    assert not model._forward_hooks, "nothing of remat's on the disabled model"
    kept = model(**batch()).loss  # noqa: F841 - held
    cm.enable()
    _exact(cm, plain, batch(seed=4, size=4, seq=24))


def test_a_budgets_change_of_map_interrupted_plans_that_bucket_again(monkeypatch):
    """A step of another bucket interrupted while its map was applied: the map of before was put back, but the budget
    kept the new plan as the one running, and every later step of that bucket ran the old map under the new plan's
    receipt (over its budget, said within it). Everything recomputed there: the next steps run that map."""
    model = _model()
    cm = _budget_cm(model)
    longer = batch(seed=4, size=4, seq=24)
    _interrupt_apply_map_once(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        cm(**longer).loss.backward()
    monkeypatch.undo()
    cm(**longer).loss.backward()
    running = [i for i, layer in enumerate(decoder_layers(model)) if layer.gradient_checkpointing]
    assert running and running == cm.checkpoint_map.checkpointed
    assert cm.budget_receipts[-1].policies == tuple(p.policy for p in cm.checkpoint_map)
