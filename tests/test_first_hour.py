"""The first hour of a user: each line as a user types it works, or fails at once naming the way
that works. (Trainer(model=cm) and TRL trainers given cm: tests/test_trainer.py, tests/test_trl.py;
the ownership sequences: tests/test_ownership.py.)"""

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import RecomputeCounter, add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model
from test_trainer import _dataset
from transformers import TrainerCallback, TrainingArguments

from remat import CheckpointConfig, CheckpointedModel, RematTrainer
from remat.testing import trainer_checkpointing_args


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# -- torch.compile(cm) ---------------------------------------------------------------------------


def test_torch_compile_of_the_wrapper_trains_with_the_uncompiled_wrappers_gradients():
    """`torch.compile(cm)` used to fail inside the compile call (dynamo could not read the source
    of the wrapper's forward) and print the whole model. The backend is AOT autograd without code
    generation: the failing part (dynamo tracing the wrapper) is the same for every backend, and
    inductor's fused kernels reorder fp32 sums (about 1e-5 apart here) and take minutes on a CPU."""
    cm = CheckpointedModel(add_lora(tiny_model(num_hidden_layers=2), dropout=0.0), CheckpointConfig(every_n_layers=2))
    _, expected = step_grads(cm, _trainable(cm.model), batch())
    compiled = torch.compile(cm, backend="aot_eager")
    counter = RecomputeCounter(decoder_layers(cm.model))
    for _ in range(2):
        _, got = step_grads(compiled, _trainable(cm.model), batch())
        assert_same_grads(expected, got)
    assert compiled.checkpoint_map.checkpointed == [0]
    counter.remove()


# -- a disabled wrapper's map --------------------------------------------------------------------


def test_a_disabled_wrappers_printed_map_says_remat_is_off_and_enable_brings_it_back():
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    assert "OFF" not in str(cm.checkpoint_map) + repr(cm.checkpoint_map) + cm.summary() + repr(cm)
    cm.disable()
    for shown in (str(cm.checkpoint_map), repr(cm.checkpoint_map), cm.summary(), repr(cm)):
        assert "remat is OFF (cm.disable())" in shown, shown
    assert str(cm.checkpoint_map).splitlines()[0].startswith("remat is OFF (cm.disable()): no layer is checkpointed")
    counter = RecomputeCounter(decoder_layers(cm.model))
    step_grads(cm, _trainable(cm.model), batch())
    assert counter.recomputed() == [], "what the map says: nothing runs"
    assert cm.checkpoint_config.every_n_layers == 2 and cm.checkpoint_map.checkpointed == [0, 2], "the plan is kept"
    cm.enable()
    assert "OFF" not in str(cm.checkpoint_map)
    counter.reset()
    step_grads(cm, _trainable(cm.model), batch())
    assert counter.recomputed() == [0, 2]


# -- merge_and_unload / unload -------------------------------------------------------------------


def _instance_attributes(model):
    return {
        name: {k: id(v) for k, v in vars(m).items() if not isinstance(v, (dict, bool))}
        for name, m in model.named_modules()
    }


@pytest.mark.parametrize("method", ["merge_and_unload", "unload"])
def test_merge_and_unload_returns_a_plain_model_and_leaves_the_wrapper_disabled_saying_why(method, caplog):
    base = tiny_model()
    plain = _instance_attributes(base)
    cm = CheckpointedModel(add_lora(base), CheckpointConfig(every_n_layers=2, swap_layers=[1]))
    step_grads(cm, _trainable(cm.model), batch())
    with caplog.at_level(logging.WARNING, logger="remat"):
        model = getattr(cm, method)()
    assert model is base
    assert f"cm.{method}(): remat is now disabled on this wrapper" in caplog.text
    assert not cm.is_enabled and f"remat is OFF (cm.{method}())" in str(cm.checkpoint_map)
    # nothing of remat: no flag, function, route, override or marker on any module (PEFT's
    # replacement of the adapted linears aside, which is what unloading is)
    after = _instance_attributes(model)
    for name, attributes in plain.items():
        if name in after and "proj" not in name:
            assert after[name] == attributes, name
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

    # A full fine-tune of the returned model runs each layer once per step.
    model.train().requires_grad_(True)  # PEFT froze the base weights
    counter = RecomputeCounter(decoder_layers(model))
    for step in range(2):
        counter.reset()
        step_grads(model, list(model.named_parameters()), batch(seed=step))
        assert counter.counts == [1, 1, 1, 1]


@pytest.mark.parametrize("method", ["merge_and_unload", "unload"])
def test_merge_and_unload_before_a_checkpointed_forwards_backward_is_refused_and_the_backward_still_runs(method):
    """The backward's recompute ran the unloaded layers and torch failed ("a different number of tensors was
    saved"), the wrapper already off: refused, nothing changed; once the backward ran, the unload goes ahead."""
    from remat import StateError

    cm = CheckpointedModel(add_lora(base := tiny_model()), CheckpointConfig(every_n_layers=2))
    _, expected = step_grads(cm, _trainable(cm.model), batch())
    for _, p in _trainable(cm.model):
        p.grad = None
    torch.manual_seed(123)
    loss = cm(**batch()).loss
    with pytest.raises(StateError, match=rf"cm.{method}\(\) now would replace layers \[0, 2\] under a checkpointed"):
        getattr(cm, method)()
    assert cm.is_enabled
    loss.backward()
    assert_same_grads(expected, {n: p.grad for n, p in _trainable(cm.model)}, rtol=0, atol=0)
    assert getattr(cm, method)() is base


@pytest.mark.parametrize("method", ["merge_and_unload", "unload"])
def test_after_merge_and_unload_the_wrapper_refuses_to_save_or_enable_and_touches_nothing(method, tmp_path):
    """The adapters left cm.model with the merge: a save wrote an empty adapter file (fingerprinted, loadable as the
    untrained base: the training lost) and enable() put the routes back on the returned plain model."""
    from remat import StateError

    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    step_grads(cm, _trainable(cm.model), batch())
    (tmp_path / "save").mkdir()
    model = getattr(cm, method)()
    with pytest.raises(StateError, match=r"no adapter weight any more .*merged\.save_pretrained"):
        cm.save_pretrained(tmp_path / "save")
    assert list((tmp_path / "save").iterdir()) == []
    with pytest.raises(StateError, match=rf"enable\(\): cm\.{method}\(\) took the adapters out"):
        cm.enable()
    assert not cm.is_enabled and not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_a_save_after_pefts_own_merge_and_unload_on_cm_model_is_refused(tmp_path):
    """`cm.model.merge_and_unload()` (PEFT's idiom, unseen by the wrapper) leaves a PeftModel with no adapter weight:
    its save would be an empty adapter, loaded later as the untrained base."""
    from remat import StateError

    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    step_grads(cm, _trainable(cm.model), batch())
    cm.model.merge_and_unload()
    (tmp_path / "save").mkdir()
    with pytest.raises(StateError, match=r"holds no adapter weight any more.*merged\.save_pretrained"):
        cm.save_pretrained(tmp_path / "save")
    assert list((tmp_path / "save").iterdir()) == []


def test_a_trainer_save_after_merge_and_unload_is_refused_too(tmp_path):
    """RematTrainer saves through its own path (Trainer's `_save`), which wrote the empty adapter all the same."""
    from test_trainer import _dataset, _plain_args

    from remat import RematTrainer, StateError

    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    trainer = RematTrainer(model=cm, args=_plain_args(tmp_path / "run"), train_dataset=_dataset())
    cm.merge_and_unload()
    with pytest.raises(StateError, match=r"took the adapters out"):
        trainer.save_model(str(tmp_path / "final"))
    assert not (tmp_path / "final").exists() or not any((tmp_path / "final").iterdir())


def test_unloading_a_wrapper_without_peft_says_what_to_do():
    cm = CheckpointedModel(tiny_model())
    with pytest.raises(AttributeError, match=r"not a PeftModel.*cm.disable\(\)"):
        cm.merge_and_unload()
    assert cm.is_enabled


# -- resume replacing the wrapper's own config ---------------------------------------------------


def _args(output_dir, steps):
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=2,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        **trainer_checkpointing_args(True, None),
    )


class KeepMyMap(TrainerCallback):
    """The README's way to keep your own map over a saved one when resuming."""

    def __init__(self, cm, config):
        self.cm, self.config = cm, config

    def on_train_begin(self, args, state, control, **kwargs):
        self.cm.enable(self.config)


def test_a_resume_that_replaces_the_wrappers_config_warns_naming_both_maps_and_the_readme_way_keeps_it(
    tmp_path, caplog
):
    saved = CheckpointedModel(add_lora(tiny_model(seed=3)), CheckpointConfig(every_n_layers=2))
    RematTrainer(model=saved, args=_args(tmp_path, 2), train_dataset=_dataset()).train()

    denser = CheckpointConfig(every_n_layers=1)
    cm = CheckpointedModel(add_lora(tiny_model(seed=3)), denser)
    with caplog.at_level(logging.WARNING, logger="remat"):
        RematTrainer(model=cm, args=_args(tmp_path, 3), train_dataset=_dataset()).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-2")
        )
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "replaced this wrapper's own" in r.message]
    assert len(warned) == 1
    assert "every_n_layers 1 -> 2" in warned[0].message
    assert "recompute [0, 1, 2, 3]" in warned[0].message and "recompute [0, 2]" in warned[0].message
    assert cm.checkpoint_config.every_n_layers == 2

    kept = CheckpointedModel(add_lora(tiny_model(seed=3)), denser)
    trainer = RematTrainer(model=kept, args=_args(tmp_path, 3), train_dataset=_dataset())
    trainer.add_callback(KeepMyMap(kept, denser))
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert kept.checkpoint_config == denser and kept.checkpoint_map.checkpointed == [0, 1, 2, 3]


# -- light imports ---------------------------------------------------------------------------------


def test_the_config_and_the_plan_import_without_torch():
    script = textwrap.dedent(
        """
        import sys
        import remat.config, remat.plan
        from remat import CheckpointConfig, CheckpointMap
        config = CheckpointConfig(every_n_layers=2, layer_policies={1: "selective"})
        plan = remat.plan.plan_layers(config, ["a", "b", "c"])
        assert [p.policy for p in plan] == ["recompute", "selective", "recompute"]
        print(sorted(m for m in ("torch", "transformers", "peft") if m in sys.modules))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
