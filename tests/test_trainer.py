"""A real Trainer run: checkpointing asked through TrainingArguments lands in the map, and
RematTrainer(model=cm) trains exactly like Trainer(model=cm.model). transformers' own
Trainer(model=cm) (or a subclass of it) is refused at construction, naming the line that works."""

import os

import pytest
import torch
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, tiny_model
from transformers import Trainer, TrainerCallback, TrainingArguments

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

    assert wrapped.checkpoint_config.every_n_layers == 2 and bare_owner.checkpoint_config.every_n_layers == 2
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
    assert cm.checkpoint_config == config
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


def _log_args(output_dir, checkpointing_kwargs=None):
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        **trainer_checkpointing_args(True, checkpointing_kwargs),
    )


class _Reported(TrainerCallback):
    """What a reporting integration (TensorBoard, W&B, MLflow) receives: every `on_log`."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def _remat_entries(entries):
    return [
        {k: v for k, v in e.items() if k.startswith("remat/")}
        for e in entries
        if any(k.startswith("remat/") for k in e)
    ]


def test_the_map_that_runs_reaches_the_trainers_logs_once_at_train_begin_as_numbers(tmp_path):
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=3))
    reported, counter = _Reported(), RecomputeCounter(decoder_layers(cm.model))
    trainer = RematTrainer(model=cm, args=_log_args(tmp_path), train_dataset=_dataset(), callbacks=[reported])
    trainer.train()
    assert counter.counts == [4, 2, 2, 4], "layers 0 and 3 recomputed at both steps"
    logged = [e for e in trainer.state.log_history if any(k.startswith("remat/") for k in e)]
    assert len(logged) == 1 and logged[0]["step"] == 0, "once, at train begin"
    summary = _remat_entries(logged)[0]
    assert summary["remat/layers"] == 4 and summary["remat/checkpointed_layers"] == 2
    assert summary["remat/layers_recompute"] == 2 and summary["remat/layers_none"] == 2
    assert summary["remat/swapped_layers"] == 0 and summary["remat/enabled"] == 1
    assert all(type(v) in (int, float) for v in summary.values()), "integrations record numbers only"
    assert _remat_entries(reported.logs) == [summary], "the integrations receive it through on_log"


def test_a_wrapper_left_in_inference_mode_logs_the_map_its_training_runs(tmp_path):
    """Logged at train begin, before the first training forward switched the wrapper back: every layer "none", while
    the map ran."""
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=3))
    cm.for_inference()
    counter = RecomputeCounter(decoder_layers(cm.model))
    trainer = RematTrainer(model=cm, args=_log_args(tmp_path), train_dataset=_dataset())
    trainer.train()
    assert counter.counts == [4, 2, 2, 4], "layers 0 and 3 recomputed at both steps"
    (summary,) = _remat_entries(trainer.state.log_history)
    assert summary["remat/checkpointed_layers"] == 2 and summary["remat/layers_recompute"] == 2


def test_a_planned_map_logs_its_predicted_bytes_and_budget(tmp_path):
    """A planned config (what `profile.plan` returns) keeps its prediction through the Trainer's
    own enable call, and the logs carry it. Built directly, as a profile costs seconds."""
    from remat.planner import PlannedConfig

    planned = PlannedConfig.of(
        CheckpointConfig(every_n_layers=2),
        choices=(),
        outside_bytes=123_456,
        planned_budget=1 << 30,
        scope="activations",
        tokens=4,
        predicted_seconds=0.5,
        predicted_peak_bytes=None,
        notes=(),
    )
    cm = CheckpointedModel(add_lora(tiny_model()), planned)
    trainer = RematTrainer(model=cm, args=_log_args(tmp_path), train_dataset=_dataset())
    trainer.train()
    (summary,) = _remat_entries(trainer.state.log_history)
    assert summary["remat/planned_activation_bytes"] == 123_456
    assert summary["remat/planned_budget_bytes"] == 1 << 30
    assert "remat/planned_step_peak_bytes" not in summary, "not measured, not logged"
    assert summary["remat/checkpointed_layers"] == 2


def test_training_arguments_that_replace_the_wrappers_map_say_so_once_as_a_warning(tmp_path, caplog):
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    with caplog.at_level("WARNING", logger="remat"):
        trainer = RematTrainer(model=cm, args=_log_args(tmp_path, {"every_n_layers": 3}), train_dataset=_dataset())
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1, warned
    assert "every_n_layers 2 -> 3" in warned[0] and "recompute [0, 2]" in warned[0] and "recompute [0, 3]" in warned[0]
    assert cm.checkpoint_map.checkpointed == [0, 3]
    (summary,) = _remat_entries(trainer.state.log_history)
    assert summary["remat/checkpointed_layers"] == 2

    caplog.clear()  # arguments that only ask for checkpointing keep the wrapper's map, with no word
    with caplog.at_level("WARNING", logger="remat"):
        RematTrainer(model=cm, args=_log_args(tmp_path / "b"), train_dataset=_dataset()).train()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert cm.checkpoint_map.checkpointed == [0, 3]


def test_under_a_budget_only_arguments_that_change_what_runs_are_warned_about(tmp_path, caplog):
    """A budget plans every layer: `every_n_layers` from the arguments changes nothing that runs, though the warning
    said the map "becomes recompute [0, 2]"; `use_reentrant` changes what the budget may plan."""
    said = []
    for options in ({"every_n_layers": 2}, {"use_reentrant": True}):
        cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(budget="64MiB"))
        caplog.clear()
        with caplog.at_level("WARNING", logger="remat"):
            RematTrainer(model=cm, args=_log_args(tmp_path / str(len(said)), options), train_dataset=_dataset())
        said.append([r.getMessage() for r in caplog.records if r.levelname == "WARNING"])
    assert said[0] == [], said[0]
    (warned,) = said[1]
    assert "use_reentrant False -> True" in warned and "the budget (64MiB) plans each step's map with them" in warned


class _CountingBackend:
    """A torch.compile backend that runs the captured graphs eagerly and counts their calls."""

    def __init__(self):
        self.compiled = self.calls = 0

    def __call__(self, graph, example_inputs):
        self.compiled += 1

        def run(*args):
            self.calls += 1
            return graph.forward(*args)

        return run


def test_cm_compile_then_remat_trainer_trains_compiled_with_the_map(tmp_path):
    """`cm.compile()` compiles cm.model, which the trainer trains: the compile is kept."""
    cm = CheckpointedModel(add_lora(tiny_model(num_hidden_layers=2), dropout=0.0), CheckpointConfig(every_n_layers=2))
    backend = _CountingBackend()
    cm.compile(backend=backend)
    counter = RecomputeCounter(decoder_layers(cm.model))
    trainer = RematTrainer(model=cm, args=_log_args(tmp_path), train_dataset=_dataset())
    trainer.train()
    assert backend.compiled > 0 and backend.calls >= 2, "the training steps ran compiled graphs"
    assert counter.counts == [4, 2], "layer 0 recomputed at both steps, layer 1 not"
    calls = backend.calls
    cm(**batch())
    assert backend.calls > calls, "cm's own forward runs compiled too"


def test_remat_trainer_given_torch_compile_of_the_wrapper_refuses_naming_what_to_write(tmp_path, monkeypatch):
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    with pytest.raises(TypeError) as refused:
        RematTrainer(model=torch.compile(cm, backend="eager"), args=_plain_args(tmp_path), train_dataset=_dataset())
    message = str(refused.value)
    assert "torch.compile(cm)" in message and "torch_compile=True" in message and "cm.compile(" in message
    assert "RematTrainer(model=cm, args=TrainingArguments(" in message
    assert cm.is_enabled and cm.checkpoint_map.checkpointed == [0, 2]

    # The line it names trains compiled, with the map (a one-step run; the eager backend keeps it short).
    # transformers before 5 sets ACCELERATE_DYNAMO_BACKEND for the whole process: undone after the test.
    from torch._dynamo.utils import counters

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "no")
    # A graph compiled by an earlier test for the same code and shapes would be reused (no new frame).
    torch._dynamo.reset()

    cm = CheckpointedModel(add_lora(tiny_model(num_hidden_layers=2), dropout=0.0), CheckpointConfig(every_n_layers=2))
    counter, frames = RecomputeCounter(decoder_layers(cm.model)), counters["frames"]["ok"]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        torch_compile=True,
        torch_compile_backend="eager",
    )
    trainer = RematTrainer(model=cm, args=args, train_dataset=_dataset())
    trainer.train()
    assert counters["frames"]["ok"] > frames, "dynamo compiled the model the trainer trained"
    assert trainer.model is cm.model and counter.counts == [2, 1]


@pytest.mark.parametrize("trainer", ["RematTrainer", "a subclass of it"])
def test_remat_trainer_given_a_model_no_wrapper_wraps_says_it_trains_without_remat(tmp_path, caplog, trainer):
    """`RematTrainer(model=peft_model)` (the wrapping forgotten) trained as Trainer without a word."""
    cls = RematTrainer if trainer == "RematTrainer" else type("MyTrainer", (RematTrainer,), {})
    with caplog.at_level("WARNING", logger="remat"):
        built = cls(model=add_lora(tiny_model()), args=_plain_args(tmp_path))
    (said,) = [r.getMessage() for r in caplog.records if "no CheckpointedModel wraps" in r.getMessage()]
    assert f"{cls.__name__} was given a PeftModel" in said and "trains as Trainer does" in said
    assert "CheckpointedModel(model, ...)" in said and built.checkpointed_model is None
    caplog.clear()
    with caplog.at_level("WARNING", logger="remat"):  # a wrapper's model: its map runs and saves carry the config
        cls(model=CheckpointedModel(add_lora(tiny_model())).model, args=_plain_args(tmp_path))
    assert not [r for r in caplog.records if "no CheckpointedModel wraps" in r.getMessage()]


def test_checkpointing_kwargs_the_route_refuses_are_refused_when_the_trainer_is_built_naming_the_arguments(tmp_path):
    """A typo in `gradient_checkpointing_kwargs` failed at `train()`, naming `activation_checkpointing_enable()`, a
    route the user never called."""
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    before = (cm.checkpoint_config, cm.checkpoint_map, cm.model)
    for options in ({"use_reentrnt": False}, "not a dict"):
        with pytest.raises((ValueError, TypeError), match=r"^TrainingArguments' checkpointing kwargs: .*"):
            RematTrainer(model=cm, args=_log_args(tmp_path, options), train_dataset=_dataset())
        assert (cm.checkpoint_config, cm.checkpoint_map, cm.model) == before
