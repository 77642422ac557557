"""A real Trainer run: checkpointing asked through TrainingArguments lands in the map, and
RematTrainer(model=cm) trains exactly like Trainer(model=cm.model). transformers' own
Trainer(model=cm) (or a subclass of it) is refused at construction, naming the line that works."""

import os

import pytest
import torch
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, tiny_model
from transformers import Trainer, TrainingArguments

from remat import CheckpointConfig, CheckpointedModel, RematTrainer, remat_trainer_class
from remat.testing import trainer_checkpointing_args

STEPS = 3


def _dataset():
    rows = []
    for seed in range(STEPS * 2):
        data = batch(seed=seed, size=1)
        rows.append({k: v[0] for k, v in data.items()})
    return rows


def _train(model_for_trainer, output_dir, checkpointing_kwargs):
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=7,
        data_seed=7,
        **trainer_checkpointing_args(True, checkpointing_kwargs),
    )
    trainer_class = RematTrainer if isinstance(model_for_trainer, CheckpointedModel) else Trainer
    trainer = trainer_class(model=model_for_trainer, args=args, train_dataset=_dataset())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_checkpointing_kwargs_reach_the_map_and_match_training_the_bare_model(tmp_path):
    wrapped = CheckpointedModel(add_lora(tiny_model(seed=3)))
    bare_owner = CheckpointedModel(add_lora(tiny_model(seed=3)))

    counter = RecomputeCounter(decoder_layers(wrapped.model))
    losses_wrapped = _train(wrapped, tmp_path / "a", {"every_n_layers": 2})
    counter.remove()
    losses_bare = _train(bare_owner.model, tmp_path / "b", {"every_n_layers": 2})

    assert wrapped.config.every_n_layers == 2 and bare_owner.config.every_n_layers == 2
    assert counter.counts == [2 * STEPS, STEPS, 2 * STEPS, STEPS]
    assert len(losses_wrapped) == STEPS
    assert losses_wrapped == losses_bare
    for (name, a), (_, b) in zip(wrapped.model.named_parameters(), bare_owner.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    trained = [p for n, p in wrapped.model.named_parameters() if "lora_A" in n]
    assert any((p != 0).any() for p in trained)


def test_trainer_defaults_keep_the_wrappers_config(tmp_path):
    config = CheckpointConfig(every_n_layers=3)
    cm = CheckpointedModel(add_lora(tiny_model()), config)
    counter = RecomputeCounter(decoder_layers(cm.model))
    _train(cm, tmp_path, None)
    assert cm.config == config
    assert counter.counts == [2 * STEPS, STEPS, STEPS, 2 * STEPS]


def test_trainer_evaluates_the_wrapper_like_the_bare_model(tmp_path):
    rows = _dataset()
    losses = []
    for wrapped in (True, False):
        cm = CheckpointedModel(add_lora(tiny_model(seed=5)))
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_eval_batch_size=2)
        trainer = (
            RematTrainer(model=cm, args=args, eval_dataset=rows)
            if wrapped
            else Trainer(cm.model, args, eval_dataset=rows)
        )
        losses.append(trainer.evaluate()["eval_loss"])
    assert losses[0] == losses[1]


def _plain_args(output_dir):
    return TrainingArguments(
        output_dir=str(output_dir), max_steps=2, save_steps=1, report_to=[], use_cpu=True, per_device_train_batch_size=2
    )


@pytest.mark.parametrize("trainer_class", ["Trainer", "a Trainer subclass"])
def test_a_plain_trainer_given_the_wrapper_is_refused_before_anything_runs_naming_remat_trainer(
    tmp_path, trainer_class
):
    class MyTrainer(Trainer):
        pass

    cls = Trainer if trainer_class == "Trainer" else MyTrainer
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    before = {n: p.detach().clone() for n, p in cm.model.named_parameters()}
    with pytest.raises(TypeError) as refused:
        cls(model=cm, args=_plain_args(tmp_path), train_dataset=_dataset())
    message = str(refused.value)
    works = "RematTrainer(model=cm" if cls is Trainer else "remat_trainer_class(MyTrainer)(model=cm"
    assert works in message and "peft_config" not in message
    assert "\n" not in message and len(message) < 200
    assert not os.path.exists(tmp_path / "checkpoint-1")
    assert all(torch.equal(p, before[n]) for n, p in cm.model.named_parameters())
    assert cm.is_enabled and cm.checkpoint_map.checkpointed == [0, 2]

    # The line the error names works, for the subclass too, and saves adapters with the map.
    remat_trainer_class(cls)(model=cm, args=_plain_args(tmp_path), train_dataset=_dataset()).train()
    files = set(os.listdir(tmp_path / "checkpoint-2"))
    assert {"adapter_model.safetensors", "checkpoint_config.json"} <= files
    assert not files & {"model.safetensors", "pytorch_model.bin"}


def test_a_plain_trainer_given_a_model_init_that_returns_the_wrapper_is_refused(tmp_path):
    def model_init():
        return CheckpointedModel(add_lora(tiny_model()))

    with pytest.raises(TypeError, match=r"RematTrainer\(model=cm"):
        Trainer(model_init=model_init, args=_plain_args(tmp_path), train_dataset=_dataset())


def test_the_trainer_says_the_wrappers_map_applies_only_while_the_wrapper_is_enabled(tmp_path, caplog):
    """With checkpointing not asked of Trainer, RematTrainer says once that the wrapper's map
    applies; a disabled wrapper has no map running, so nothing is said."""
    said = "the wrapper's map applies"
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    with caplog.at_level("INFO", logger="remat"):
        RematTrainer(model=cm, args=_plain_args(tmp_path / "on"), train_dataset=_dataset())
    assert sum(said in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    cm.disable()
    with caplog.at_level("INFO", logger="remat"):
        RematTrainer(model=cm, args=_plain_args(tmp_path / "off"), train_dataset=_dataset())
    assert not any(said in r.getMessage() for r in caplog.records)
