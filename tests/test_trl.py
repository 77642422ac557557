"""TRL's trainers (GRPO, SFT, DPO) with `model=cm` and `model=cm.model`, run for real on a tiny
model with a byte tokenizer built locally: the map holds at every optimizer step through TRL's
generation and reference-pass toggles, checkpoints carry it, resuming restores it.

"Which layers ran again inside backward" is measured per optimizer step: a layer that starts
while autograd's engine is running a backward is being recomputed."""

import logging
import os

import pytest
import torch
from conftest import add_lora, batch, tiny_model
from transformers import TrainerCallback

from remat import CheckpointConfig, CheckpointedModel, remat_trainer_class
from remat.demo import byte_tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

EVERY_2ND = [0, 2, 4]


def _model():
    return add_lora(tiny_model(num_hidden_layers=6, vocab_size=256, attention_dropout=0.0), dropout=0.0)


class RecomputedPerStep(TrainerCallback):
    """The layers that started inside a backward, for each optimizer step."""

    def __init__(self, cm):
        self.steps, self._seen = [], set()
        for index, layer in enumerate(cm.layers):
            next(iter(layer.children())).register_forward_pre_hook(self._hook(index))

    def _hook(self, index):
        def hook(module, args):
            if torch._C._current_graph_task_id() != -1:  # autograd's engine is running a backward
                self._seen.add(index)

        return hook

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(sorted(self._seen))
        self._seen = set()


def _lora(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n and ".default." in n}


def _common(tmp_path, **extra):
    return {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 3,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_steps": 3,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        **extra,
    }


def _grpo(tmp_path, cm, hand, checkpointing_kwargs=None, **extra):
    def reward(completions, **kwargs):  # varies between completions, so advantages are not zero
        return [float(sum(c.encode()) % 7) for c in completions]

    args = trl.GRPOConfig(
        num_generations=2,
        max_completion_length=6,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs=checkpointing_kwargs,
        **_common(tmp_path, **extra),
    )
    data = datasets.Dataset.from_dict({"prompt": ["The cat", "A dog", "Hello", "Once upon"] * 4})
    counter = RecomputedPerStep(cm)
    cls = remat_trainer_class(trl.GRPOTrainer) if hand == "cm" else trl.GRPOTrainer
    model = cm if hand == "cm" else cm.model
    trainer = cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=byte_tokenizer(),
        callbacks=[counter],
    )
    return trainer, counter


@pytest.mark.parametrize("hand", ["cm", "cm.model"])
@pytest.mark.parametrize("where", ["wrapper config", "GRPOConfig kwargs"])
def test_grpo_recomputes_exactly_layers_0_2_4_at_every_step_through_generation_toggles(tmp_path, hand, where):
    config = CheckpointConfig(every_n_layers=2) if where == "wrapper config" else CheckpointConfig()
    cm = CheckpointedModel(_model(), config)
    kwargs = {"every_n_layers": 2} if where == "GRPOConfig kwargs" else None
    trainer, counter = _grpo(tmp_path, cm, hand, kwargs)
    toggles = []
    route = cm.model.base_model.model
    original = route.gradient_checkpointing_disable
    route.gradient_checkpointing_disable = lambda: (toggles.append(1), original())[1]
    before = _lora(cm.model)
    trainer.train()
    assert counter.steps == [EVERY_2ND] * 3
    assert len(toggles) >= 3, "TRL turned checkpointing off for generation at every step"
    assert cm.checkpoint_map.checkpointed == EVERY_2ND
    after = _lora(cm.model)
    assert any(not torch.equal(before[name], after[name]) for name in before), "the LoRA weights trained"
    files = set(os.listdir(tmp_path / "out" / "checkpoint-3"))
    assert {"adapter_model.safetensors", "adapter_config.json", "checkpoint_config.json"} <= files
    assert "model.safetensors" not in files


def test_grpo_with_a_kl_term_uses_the_adapter_as_reference_not_a_second_model(tmp_path):
    cm = CheckpointedModel(_model(), CheckpointConfig(every_n_layers=2))
    trainer, counter = _grpo(tmp_path, cm, "cm", beta=0.1)
    assert trainer.ref_model is None and "ref" in cm.model.peft_config
    trainer.train()
    assert counter.steps == [EVERY_2ND] * 3
    assert trainer.model is cm.model and trainer.checkpointed_model is cm


def _sft(tmp_path, cm, steps, resume=None):
    args = trl.SFTConfig(
        max_length=32,
        gradient_checkpointing=True,
        **_common(tmp_path, max_steps=steps, save_steps=2),
    )
    text = "the quick brown fox jumps over the lazy dog. " * 3
    data = datasets.Dataset.from_dict({"text": [text[i:] for i in range(16)]})
    counter = RecomputedPerStep(cm)
    trainer = remat_trainer_class(trl.SFTTrainer)(
        model=cm, args=args, train_dataset=data, processing_class=byte_tokenizer(), callbacks=[counter]
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, counter


def test_sft_resumes_into_a_differently_configured_wrapper_with_the_saved_map_and_step(tmp_path):
    saved = CheckpointConfig(every_n_layers=2)
    first, counter = _sft(tmp_path, CheckpointedModel(_model(), saved), steps=2)
    assert counter.steps == [EVERY_2ND] * 2
    assert "checkpoint_config.json" in os.listdir(tmp_path / "out" / "checkpoint-2")

    cm = CheckpointedModel(_model(), CheckpointConfig(every_n_layers=1))
    resumed, counter = _sft(tmp_path, cm, steps=4, resume=str(tmp_path / "out" / "checkpoint-2"))
    assert cm.checkpoint_config == saved and resumed.state.global_step == 4
    assert counter.steps == [EVERY_2ND] * 2, "the two steps after the saved one, with the saved map"


def test_dpo_keeps_the_map_through_its_reference_pass_at_every_step(tmp_path):
    cm = CheckpointedModel(_model(), CheckpointConfig(every_n_layers=2))
    args = trl.DPOConfig(
        max_length=32,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        **_common(tmp_path),
    )
    data = datasets.Dataset.from_dict(
        {
            "prompt": ["Say yes:", "Say no:", "Pick one:", "Answer:"] * 2,
            "chosen": [" yes", " no", " one", " it"] * 2,
            "rejected": [" no", " yes", " two", " not"] * 2,
        }
    )
    counter = RecomputedPerStep(cm)
    trainer = remat_trainer_class(trl.DPOTrainer)(
        model=cm, args=args, train_dataset=data, processing_class=byte_tokenizer(), callbacks=[counter]
    )
    assert trainer.ref_model is None, "the reference is the model with its adapter disabled"
    trainer.train()
    assert counter.steps == [EVERY_2ND] * 3
    assert cm.checkpoint_map.checkpointed == EVERY_2ND


def test_the_grpo_example_runs_and_shows_the_map_holding_at_every_step(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[1] / "examples" / "grpo.py"
    command = [sys.executable, str(example), "--steps", "2", "--output-dir", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("recomputed layers [0, 2, 4]") == 2
    assert done.stderr == ""


@pytest.mark.parametrize("trainer", ["sft", "grpo"])
def test_trls_selective_option_selects_the_selective_policy(tmp_path, trainer):
    """TRL's `gradient_checkpointing_kwargs={"selective": True}`: SFTTrainer turns it into a
    context_fn over torch's selective checkpoint contexts, GRPO passes it through; either way
    the wrapper's map runs remat's "selective" policy, and never crashes inside TRL."""
    cm = CheckpointedModel(_model(), CheckpointConfig(every_n_layers=2))
    kwargs = {"selective": True}
    if trainer == "grpo":
        run, counter = _grpo(tmp_path, cm, "cm", kwargs)
    else:
        args = trl.SFTConfig(
            max_length=32, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs, **_common(tmp_path)
        )
        data = datasets.Dataset.from_dict({"text": ["the quick brown fox jumps over the lazy dog"] * 16})
        counter = RecomputedPerStep(cm)
        run = remat_trainer_class(trl.SFTTrainer)(
            model=cm, args=args, train_dataset=data, processing_class=byte_tokenizer(), callbacks=[counter]
        )
    run.train()
    assert cm.checkpoint_config.checkpoint_policy == "selective"
    assert [p.policy for p in cm.checkpoint_map] == ["selective", "none"] * 3
    assert counter.steps == [EVERY_2ND] * 3


def test_disable_leaves_in_place_the_wrapper_trl_put_around_a_route():
    """TRL's `enable_selective_activation_checkpointing` wraps the enable method remat routed (a
    full fine-tune: the model itself carries the route); `cm.disable()` leaves TRL's wrapper on
    the model, and through it TRL's selective checkpointing reaches transformers' own method."""
    from trl.models.selective_activation_checkpointing import enable_selective_activation_checkpointing

    model = tiny_model(num_hidden_layers=6, vocab_size=256)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    enable_selective_activation_checkpointing(model)
    trls = model.__dict__["gradient_checkpointing_enable"]
    cm.disable()
    assert model.__dict__.get("gradient_checkpointing_enable") is trls
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing, "TRL's wrapper reached transformers' method"


@pytest.mark.parametrize("trainer", ["GRPOTrainer", "SFTTrainer", "DPOTrainer"])
def test_a_trl_trainer_given_the_wrapper_without_the_mixin_is_refused_before_any_generation(tmp_path, trainer):
    cm = CheckpointedModel(_model(), CheckpointConfig(every_n_layers=2))
    generated = []
    cm.model.register_forward_pre_hook(lambda module, args: generated.append(1))
    data = datasets.Dataset.from_dict({"prompt": ["The cat", "A dog"] * 2, "completion": [" sat", " ran"] * 2})
    if trainer == "GRPOTrainer":
        config = trl.GRPOConfig(num_generations=2, max_completion_length=4, **_common(tmp_path))
        build = lambda: trl.GRPOTrainer(
            model=cm,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config,
            train_dataset=data,
            processing_class=byte_tokenizer(),
        )
    elif trainer == "DPOTrainer":
        pairs = datasets.Dataset.from_dict(
            {"prompt": ["The cat", "A dog"], "chosen": [" sat", " ran"], "rejected": [" x", " y"]}
        )
        config = trl.DPOConfig(**_common(tmp_path))
        build = lambda: trl.DPOTrainer(model=cm, args=config, train_dataset=pairs, processing_class=byte_tokenizer())
    else:
        config = trl.SFTConfig(**_common(tmp_path))
        build = lambda: trl.SFTTrainer(model=cm, args=config, train_dataset=data, processing_class=byte_tokenizer())
    with pytest.raises(TypeError, match=rf"^{trainer}\(model=cm\).*remat_trainer_class\({trainer}\)\(model=cm"):
        build()
    assert generated == [], "nothing ran"
    assert not os.path.exists(tmp_path / "out" / "checkpoint-3")


def _trl_trainer(name, tmp_path, cm, callbacks, **trainer_kwargs):
    """A TRL trainer through `remat_trainer_class`, two steps, a checkpoint after the second."""
    common = _common(tmp_path, max_steps=2, save_steps=2)
    if name == "SFTTrainer":
        args = trl.SFTConfig(max_length=32, gradient_checkpointing=True, **common)
        text = "the quick brown fox jumps over the lazy dog. " * 3
        data = datasets.Dataset.from_dict({"text": [text[i:] for i in range(16)]})
    elif name == "DPOTrainer":
        args = trl.DPOConfig(max_length=32, gradient_checkpointing=True, **common)
        data = datasets.Dataset.from_dict(
            {
                "prompt": ["Say yes:", "Say no:", "Pick one:", "Answer:"] * 2,
                "chosen": [" yes", " no", " one", " it"] * 2,
                "rejected": [" no", " yes", " two", " not"] * 2,
            }
        )
    else:
        args = trl.GRPOConfig(num_generations=2, max_completion_length=6, gradient_checkpointing=True, **common)
        data = datasets.Dataset.from_dict({"prompt": ["The cat", "A dog", "Hello", "Once upon"] * 4})
        trainer_kwargs["reward_funcs"] = lambda completions, **kw: [float(sum(c.encode()) % 7) for c in completions]
    cls = remat_trainer_class(getattr(trl, name))
    return cls(
        model=cm,
        args=args,
        train_dataset=data,
        processing_class=byte_tokenizer(),
        callbacks=callbacks,
        **trainer_kwargs,
    )


def _base():
    return tiny_model(num_hidden_layers=6, vocab_size=256, attention_dropout=0.0)


@pytest.mark.parametrize("trainer", ["SFTTrainer", "DPOTrainer", "GRPOTrainer"])
def test_trls_peft_config_over_a_wrapped_base_model_is_adopted_and_its_checkpoint_reloads_whole(tmp_path, trainer):
    """TRL's own LoRA route: the trainer builds the PeftModel around cm.model; the wrapper adopts
    it (same layers, new names, the map kept), so the checkpoint's config names the adapters it
    holds and a reload gets every trained LoRA tensor."""
    from peft import LoraConfig, PeftModel

    cm = CheckpointedModel(_base(), CheckpointConfig(every_n_layers=2))
    counter = RecomputedPerStep(cm)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    run = _trl_trainer(trainer, tmp_path, cm, [counter], peft_config=lora)
    assert isinstance(cm.model, PeftModel) and run.model is cm.model and run.checkpointed_model is cm
    assert cm.checkpoint_map.checkpointed == EVERY_2ND
    assert cm.checkpoint_map[0].name == "base_model.model.model.layers.0"
    run.train()
    assert counter.steps == [EVERY_2ND] * 2, "the map held at every step"
    trained = _lora(cm.model)
    assert len(trained) == 24 and any(bool(p.abs().sum()) for n, p in trained.items() if "lora_B" in n)

    reloaded = CheckpointedModel.from_pretrained(_base(), str(tmp_path / "out" / "checkpoint-2"))
    loaded = _lora(reloaded.model)
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[name], trained[name]) for name in trained), "every trained LoRA tensor"
    assert reloaded.checkpoint_map.checkpointed == EVERY_2ND
    cm.save_pretrained(tmp_path / "again")  # the wrapper saves what it trains, too
    assert {"adapter_model.safetensors", "checkpoint_config.json"} <= set(os.listdir(tmp_path / "again"))


@pytest.mark.parametrize("trainer", ["SFTTrainer", "DPOTrainer"])
def test_checkpointing_kwargs_the_route_refuses_leave_the_model_without_trls_lora_wherever_the_arguments_go(
    tmp_path, trainer
):
    """Refused at train() (naming a route the user never called) after TRL's peft_config= had put LoRA layers into
    cm.model; DPO takes the arguments third, positionally."""
    from peft import LoraConfig

    from remat import ConfigError

    cm = CheckpointedModel(_base(), CheckpointConfig(every_n_layers=2))
    base, before = cm.model, (cm.checkpoint_config, cm.checkpoint_map)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    config = getattr(trl, trainer.replace("Trainer", "Config"))(
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrnt": False}, **_common(tmp_path)
    )
    cls = remat_trainer_class(getattr(trl, trainer))
    positional = (cm, None, config) if trainer == "DPOTrainer" else (cm, config)
    rows = {"prompt": ["Say yes:"] * 4, "chosen": [" yes"] * 4, "rejected": [" no"] * 4}
    data = datasets.Dataset.from_dict(rows if trainer == "DPOTrainer" else {"text": ["the quick brown fox"] * 4})
    with pytest.raises(ConfigError, match=r"^TrainingArguments' checkpointing kwargs: .*\['use_reentrnt'\]"):
        cls(*positional, train_dataset=data, processing_class=byte_tokenizer(), peft_config=lora)
    assert cm.model is base and not any("lora" in name for name, _ in base.named_modules())
    assert (cm.checkpoint_config, cm.checkpoint_map) == before


def test_a_base_model_adopted_into_trls_peft_model_is_still_owned(tmp_path):
    """After the adoption the wrapper owns the PeftModel and the base model inside it: a second
    wrapper of either is refused while the first is enabled, and a wrapper that took the base
    model after it was disabled keeps it."""
    from peft import LoraConfig

    cm = CheckpointedModel(_base(), CheckpointConfig(every_n_layers=2))
    base = cm.model
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    _trl_trainer("SFTTrainer", tmp_path, cm, [], peft_config=lora)
    for model in (base, cm.model):
        with pytest.raises(ValueError, match="already wrapped"):
            CheckpointedModel(model)
    cm.disable()
    assert "_remat_owner" not in vars(base) and "_remat_owner" not in vars(cm.model)
    rival = CheckpointedModel(base, CheckpointConfig(every_n_layers=3))  # the base model, free again
    with pytest.raises(RuntimeError, match="another CheckpointedModel took"):
        cm.enable()  # it would install on the layers the rival checkpoints
    assert rival.checkpoint_map.checkpointed == [0, 3] and not cm.is_enabled


def test_a_plain_trl_trainer_given_the_wrapper_and_peft_config_is_refused_naming_the_line_that_works(tmp_path):
    """The refusal speaks of peft_config only when one was given (TRL's PEFT then wrapped the
    wrapper and put adapter layers into cm's model)."""
    from peft import LoraConfig

    data = datasets.Dataset.from_dict({"text": ["the quick brown fox jumps over the lazy dog"] * 4})
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    messages = []
    for peft_config in (lora, None):
        cm = CheckpointedModel(_base(), CheckpointConfig(every_n_layers=2))
        with pytest.raises(TypeError) as refused:
            trl.SFTTrainer(
                model=cm,
                args=trl.SFTConfig(**_common(tmp_path)),
                train_dataset=data,
                processing_class=byte_tokenizer(),
                peft_config=peft_config,
            )
        messages.append(str(refused.value))
    assert "remat_trainer_class(SFTTrainer)(model=cm, peft_config=...)" in messages[0]
    assert "build the model and the wrapper again" in messages[0]
    assert "peft_config" not in messages[1] and "remat_trainer_class(SFTTrainer)(model=cm, ...)" in messages[1]


def test_a_plain_trl_trainer_given_cm_model_and_peft_config_says_its_checkpoints_lack_the_map(tmp_path, caplog):
    """TRL's PeftModel built around cm.model is not the wrapper's: the map runs, but its checkpoints held no
    checkpoint_config.json and cm could not save afterwards, and nothing said so until then."""
    from peft import LoraConfig

    cm = CheckpointedModel(_base(), CheckpointConfig(every_n_layers=2))
    cm(**batch()).loss.backward()  # a check before building the trainer: the adapters come after it
    cm.zero_grad(set_to_none=True)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    text = "the quick brown fox jumps over the lazy dog. " * 3
    trainer = trl.SFTTrainer(
        model=cm.model,
        args=trl.SFTConfig(max_length=32, **_common(tmp_path, max_steps=2, save_steps=2)),
        train_dataset=datasets.Dataset.from_dict({"text": [text[i:] for i in range(8)]}),
        processing_class=byte_tokenizer(),
        peft_config=lora,
    )
    with caplog.at_level(logging.WARNING, logger="remat"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "is not a PeftModel" in r.getMessage()]
    assert len(said) == 1 and "remat_trainer_class(SFTTrainer)(model=cm, peft_config=...)" in said[0]
    assert "checkpoint_config.json" not in os.listdir(tmp_path / "out" / "checkpoint-2")  # as the warning says


def test_sft_with_peft_config_resumes_its_own_checkpoint_with_the_saved_adapters_and_map(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    cm = CheckpointedModel(_base(), CheckpointConfig(every_n_layers=2))
    _trl_trainer("SFTTrainer", tmp_path, cm, [], peft_config=lora).train()
    saved = _lora(cm.model)

    resumed = CheckpointedModel(_base(), CheckpointConfig(every_n_layers=1))
    counter = RecomputedPerStep(resumed)
    run = _trl_trainer("SFTTrainer", tmp_path, resumed, [counter], peft_config=lora)
    run.args.max_steps = 3
    loaded = []
    run.add_callback(
        type("Seen", (TrainerCallback,), {"on_train_begin": lambda *a, **k: loaded.append(_lora(resumed.model))})()
    )
    run.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert all(torch.equal(loaded[0][name], saved[name]) for name in saved) and loaded[0].keys() == saved.keys()
    assert resumed.checkpoint_config.every_n_layers == 2 and run.state.global_step == 3
    assert counter.steps == [EVERY_2ND], "the step after the saved one ran the saved map"


def test_trls_peft_config_route_over_layers_added_since_wrapping_is_refused_not_found_again(tmp_path):
    """The route finds the layers again under the PeftModel's names: a layer appended after wrapping was counted as
    if wrapped, and the map of six layers trained and saved over seven (review helper-90)."""
    import copy

    from peft import LoraConfig

    from remat import StateError

    cm = CheckpointedModel(_base(), CheckpointConfig(every_n_layers=1))
    layers = cm.model.model.layers
    layers.append(copy.deepcopy(layers[5]))
    layers[6].self_attn.layer_idx, cm.model.config.num_hidden_layers = 6, 7
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    with pytest.raises(StateError, match=r"SFTTrainer\(peft_config=...\): .*model.layers holds 7 modules, 6 when"):
        _trl_trainer("SFTTrainer", tmp_path, cm, [], peft_config=lora)


def _distillation(tmp_path, cm, **extra):
    args = trl.DistillationConfig(
        max_completion_length=4, gradient_checkpointing=False, **_common(tmp_path, save_steps=100, **extra)
    )
    data = datasets.Dataset.from_dict({"prompt": ["Say yes:", "Say no:"] * 4, "completion": [" yes", " no"] * 4})
    teacher = tiny_model(num_hidden_layers=2, vocab_size=256, seed=5)
    counter = RecomputedPerStep(cm)
    trainer = remat_trainer_class(trl.DistillationTrainer)(
        model=cm, teacher_model=teacher, args=args, train_dataset=data, processing_class=byte_tokenizer(),
        callbacks=[counter],
    )  # fmt: skip
    return trainer, counter


def test_distillation_routes_its_loss_through_the_forward_which_keeps_a_map_and_a_budget_refuses_by_name(tmp_path):
    """TRL's DistillationTrainer calls `model(student, inputs, num_items)` with the instance's forward patched to its
    own loss: a map holds through it; a budget cannot measure such a step (it took the three arguments for a batch
    and failed inside TRL) and says so before the forward runs."""
    trainer, counter = _distillation(tmp_path, CheckpointedModel(_model(), CheckpointConfig(every_n_layers=2)))
    trainer.train()
    assert counter.steps == [EVERY_2ND] * 3
    cm = CheckpointedModel(_model(), CheckpointConfig(budget="64MiB"))
    trainer, _ = _distillation(tmp_path / "budget", cm, max_steps=1)
    before = {n: p.detach().clone() for n, p in cm.named_parameters()}
    with pytest.raises(ValueError, match=r"a module \(.*\) among its arguments.*DistillationTrainer"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in cm.named_parameters())
    assert cm.budget_receipts == []
    # TRL puts its forward back only inside it: the refused call left TRL's loss as the model's forward
    assert "_ForwardRedirection" not in cm.model.forward.__qualname__
    cm.enable(budget=None, every_n_layers=2)
    cm(**batch(size=2, seq=8)).loss.backward()
