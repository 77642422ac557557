"""A real Trainer run: checkpointing asked through TrainingArguments lands in the map, and
Trainer(model=cm) trains exactly like Trainer(model=cm.model)."""

import torch
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, tiny_model
from transformers import Trainer, TrainingArguments

from remat import CheckpointConfig, CheckpointedModel
from remat.integrations.transformers_compat import trainer_checkpointing_args

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
    trainer = Trainer(model=model_for_trainer, args=args, train_dataset=_dataset())
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
        trainer = Trainer(model=cm if wrapped else cm.model, args=args, eval_dataset=rows)
        losses.append(trainer.evaluate()["eval_loss"])
    assert losses[0] == losses[1]
