"""A budget under the real trainers: `RematTrainer` (the optimizer counted, the receipt in the logs,
a resume that plans from the saved profile) and TRL's `GRPOTrainer` (re-planned per bucket, the map
kept through every generation toggle)."""

import json
import logging

import datasets
import pytest
import torch
import trl
from conftest import tiny_model
from test_trl import RecomputedPerStep, _common, _model
from transformers import TrainingArguments

from remat import CheckpointConfig, CheckpointedModel, RematTrainer, remat_trainer_class
from remat.budget import bucket_of
from remat.demo import byte_tokenizer
from remat.model import controller_of


def _rows(lengths):
    return datasets.Dataset.from_list(
        [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in lengths]
    )


def _measured(caplog):
    return [r.getMessage() for r in caplog.records if "measuring a profile" in r.getMessage()]


def test_remat_trainer_plans_with_its_optimizer_logs_the_receipt_and_resumes_from_the_saved_profile(tmp_path, caplog):
    config = CheckpointConfig(budget="64MiB")  # budget_scope="step": weights, gradients, AdamW's state, activations
    cm = CheckpointedModel(_model(), config)
    args = TrainingArguments(**_common(tmp_path, max_steps=2, save_steps=2, per_device_train_batch_size=2))
    with caplog.at_level(logging.INFO, logger="remat"):
        trainer = RematTrainer(model=cm, args=args, train_dataset=_rows([12, 12, 40, 40]))
        (said,) = [r.getMessage() for r in caplog.records if "Trainer leaves it alone" in r.getMessage()]
        assert "budget 64MiB: planned per step length" in said, said  # not the pending map's "every layer"
        cm(**{k: torch.tensor([v]) for k, v in _rows([12])[0].items()}).loss.backward()  # a check before training
        trainer.train()
    first, again = _measured(caplog)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "no optimizer known" in r.msg]
    assert len(warned) == 1 and "the optimizer is known now" in again
    receipts = {r.bucket_tokens: r for r in cm.budget_receipts}
    assert set(receipts) == {bucket_of(12), bucket_of(24), bucket_of(80)}
    assert all(r.predicted_bytes <= 64 * 2**20 and r.scope == "step" for r in receipts.values())
    profile = controller_of(cm).budget.profile
    assert profile.measurements.step is not None, "the trainer's optimizer was counted"
    (begin,) = [e for e in trainer.state.log_history if "remat/layers" in e]  # the map is per step: not a count
    assert begin["remat/budget_bytes"] == 64 * 2**20 and not any(k.startswith("remat/layers_") for k in begin)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["remat/budget_bucket_tokens"] for e in logged] == [bucket_of(24), bucket_of(80)]
    assert all("remat/budget_predicted_bytes" in e for e in logged)

    caplog.clear()
    again = CheckpointedModel(_model(), config)
    args = TrainingArguments(**_common(tmp_path, max_steps=3, save_steps=10, per_device_train_batch_size=2))
    resumed = RematTrainer(model=again, args=args, train_dataset=_rows([12, 12, 40, 40, 12, 12]))
    with caplog.at_level(logging.INFO, logger="remat"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert _measured(caplog) == [], "planned from the saved profile, nothing measured"
    assert any("planning from the saved profile" in r.getMessage() for r in caplog.records)
    assert [r.bucket_tokens for r in again.budget_receipts] == [bucket_of(24)]


def test_an_optimizer_handed_to_the_trainer_is_counted_from_the_first_step(tmp_path, caplog):
    """`optimizers=(optimizer, None)`: Trainer never calls create_optimizer; the budget still knows it."""
    cm = CheckpointedModel(_model(), CheckpointConfig(budget="64MiB"))
    optimizer = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=1e-3)
    args = TrainingArguments(**_common(tmp_path, max_steps=1, save_strategy="no", per_device_train_batch_size=2))
    trainer = RematTrainer(model=cm, args=args, train_dataset=_rows([12, 12]), optimizers=(optimizer, None))
    with caplog.at_level(logging.INFO, logger="remat"):
        trainer.train()
    assert len(_measured(caplog)) == 1 and "no optimizer known" not in caplog.text
    assert optimizer.state, "profiled with it, then it stepped"


def test_grpo_replans_per_bucket_and_keeps_the_map_through_every_generation_toggle(tmp_path):
    cm = CheckpointedModel(_model(), CheckpointConfig(budget="1MiB", budget_scope="activations"))
    ran = []  # per training forward: its tokens and the map it ran
    measured = set()  # the forwards whose step measured a profile first (its recompute count has the profile's)

    def watch(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and controller_of(cm).measuring:
            measured.add(len(ran))
        elif module.training and torch.is_grad_enabled():
            ran.append((kwargs["input_ids"].numel(), tuple(p.policy for p in cm.checkpoint_map)))

    cm.model.register_forward_pre_hook(watch, with_kwargs=True)
    counter = RecomputedPerStep(cm)
    long = "The cat sat on the mat and then it sat on the other mat for a long while, "
    prompts = ["Hi", long + "and slept", "A", long + "and woke", "Once", long + "and ran", "Oh", long + "and sat"]

    def reward(completions, **kwargs):
        return [float(sum(c.encode()) % 7) for c in completions]

    args = trl.GRPOConfig(
        num_generations=2,
        max_completion_length=6,
        gradient_checkpointing=True,
        **_common(tmp_path, max_steps=4, save_strategy="no", per_device_train_batch_size=2),
    )
    trainer = remat_trainer_class(trl.GRPOTrainer)(
        model=cm,
        reward_funcs=reward,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=byte_tokenizer(),
        callbacks=[counter],
    )
    trainer.train()
    receipts = cm.budget_receipts  # one per plan a bucket ran
    assert len({r.bucket_tokens for r in receipts}) >= 2, receipts
    assert {r.policies.count("none") == len(r.policies) for r in receipts} == {True, False}, "short: none"
    assert len(ran) == sum(r.steps for r in receipts)
    for tokens, policies in ran:  # each training forward ran a plan of its bucket, whatever generation toggled
        assert policies in {r.policies for r in receipts if r.bucket_tokens == bucket_of(tokens)}
    assert 0 in measured
    for index, (step, recomputed) in enumerate(zip(ran, counter.steps, strict=True)):
        if index not in measured:
            assert recomputed == [i for i, p in enumerate(step[1]) if p != "none"]
    logged = [e for e in trainer.state.log_history if "reward" in e]
    assert logged and all("remat/budget_bucket_tokens" in e for e in logged)


def test_under_gradient_accumulation_each_log_carries_the_largest_micro_batch_and_evaluation_none(tmp_path):
    """A step of a long and a short micro-batch logged the short one's receipt (the last), and an evaluation's
    log line repeated it (or, between two logs, took it from the next training line); a check before training
    leaked into the first line. A training line carries the largest bucket trained since the previous one."""
    cm = CheckpointedModel(_model(), CheckpointConfig(budget="64MiB"))
    check = {k: torch.tensor([v]) for k, v in _rows([120])[0].items()}
    cm(**check).loss.backward()  # a check before training, at a bucket no step runs
    cm.model.zero_grad(set_to_none=True)
    tokens = []
    args = TrainingArguments(
        **_common(tmp_path, max_steps=2, save_strategy="no", per_device_train_batch_size=1, logging_steps=2),
        gradient_accumulation_steps=2,
        eval_strategy="steps",
        eval_steps=1,
    )

    class InOrder(RematTrainer):  # step 1: the long micro-batch, then a short one; step 2: two short ones
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def training_step(self, model, inputs, *args, **kwargs):
            tokens.append(inputs["input_ids"].numel())
            return super().training_step(model, inputs, *args, **kwargs)

    trainer = InOrder(model=cm, args=args, train_dataset=_rows([60, 6, 6, 6]), eval_dataset=_rows([60]))
    trainer.train()
    assert tokens == [60, 6, 6, 6] and bucket_of(120) > bucket_of(60) > bucket_of(6)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["remat/budget_bucket_tokens"] for e in logged] == [bucket_of(60)], "steps 1-2: the long one"
    evaluated = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(evaluated) == 2 and not any(key.startswith("remat/budget") for e in evaluated for key in e)


def test_a_log_carries_the_micro_batch_predicting_the_most_bytes_not_the_longest(tmp_path):
    """The log took the micro-batch of most tokens, whose plan (recomputing more) may predict less than a shorter one's:
    the step's peak was the shorter one's, and the line showed the other's, below it."""
    from conftest import add_lora, batch
    from independent_memory import activation_bytes

    build = lambda: add_lora(tiny_model(num_hidden_layers=4, attention_dropout=0.0), dropout=0.0)
    profile = CheckpointedModel(build()).profile(batch(size=2, seq=16), repeats=1, progress=False)
    budget = next(  # a budget where 2 rows of 16 keep more than 2 rows of 24 may (found from the bytes alone)
        b
        for b in range(60_000, 400_000, 1_000)
        if (short := _fits(profile, b, 32, None)) and (long := _fits(profile, b, 48, 24)) and short > long
    )
    cm = CheckpointedModel(build(), CheckpointConfig(budget=budget, budget_scope="activations"))
    args = TrainingArguments(
        **_common(tmp_path, max_steps=1, save_strategy="no", per_device_train_batch_size=2, logging_steps=1),
        gradient_accumulation_steps=2,
    )

    class InOrder(RematTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = InOrder(model=cm, args=args, train_dataset=_rows([16, 16, 24, 24]))
    trainer.train()
    receipts = {r.bucket_tokens: r for r in cm.budget_receipts}
    assert receipts.keys() == {32, 48} and receipts[32].predicted_bytes > receipts[48].predicted_bytes
    (logged,) = [e for e in trainer.state.log_history if "loss" in e]
    assert logged["remat/budget_bucket_tokens"] == 32
    assert logged["remat/budget_predicted_bytes"] == receipts[32].predicted_bytes
    held = {n: activation_bytes(cm, {k: torch.tensor([v] * 2) for k, v in _rows([n])[0].items()}) for n in (16, 24)}
    assert held[16] > held[24], "measured apart: the shorter micro-batch holds more"


def _fits(profile, budget, tokens, length):
    try:
        return profile.plan(budget, tokens=tokens, length=length).predicted_device_bytes
    except ValueError:
        return None


def test_a_profile_saved_without_an_optimizer_is_measured_again_on_the_trainers_first_step(tmp_path, caplog):
    """Saved from a plain loop (no optimizer state counted), loaded, trained by RematTrainer: the first step planned
    from the saved profile as if the optimizer held nothing, and the second measured again."""
    saved = CheckpointedModel(_model(), CheckpointConfig(budget="64MiB"))
    saved(**{k: torch.tensor([v]) for k, v in _rows([12])[0].items()}).loss.backward()
    saved.save_pretrained(tmp_path / "saved")
    base = tiny_model(num_hidden_layers=6, vocab_size=256, attention_dropout=0.0)
    cm = CheckpointedModel.from_pretrained(base, tmp_path / "saved", is_trainable=True)
    steps = []
    cm.model.register_forward_pre_hook(lambda *_: steps.append(controller_of(cm).measuring))
    args = TrainingArguments(**_common(tmp_path, max_steps=2, save_strategy="no", per_device_train_batch_size=2))
    trainer = RematTrainer(model=cm, args=args, train_dataset=_rows([12, 12, 12, 12]))
    with caplog.at_level(logging.INFO, logger="remat"):
        trainer.train()
    said = [m for r in caplog.records if "budget" in (m := r.getMessage()) and "use_cache=False" not in m]
    said = [m for m in said if "no optimizer known" not in m]  # (said once per wrapper, by the run that saved)
    assert "saved profile is not used (the optimizer is known now, and its profile counted no" in said[0]
    assert len(_measured(caplog)) == 1 and not any("planning from the saved profile" in m for m in said)
    assert steps[-2:] == [False, False] and not controller_of(cm).budget.without_optimizer
    (receipt,) = cm.budget_receipts
    assert receipt.steps == 2 and "no optimizer state" not in str(controller_of(cm).budget.active)


def test_a_log_after_steps_of_one_token_bucket_in_rows_of_two_lengths_carries_the_longer_rows_receipt(tmp_path):
    """An epoch's last batch of one row (24 tokens after batches of 2 x 12) has its own receipt for its rows' length:
    the log compared the receipts' keys and failed ("'>' not supported between 'NoneType' and 'int'")."""

    class InOrder(RematTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    cm = CheckpointedModel(_model(), CheckpointConfig(budget="64MiB"))
    args = TrainingArguments(
        **_common(tmp_path, max_steps=3, logging_steps=3, per_device_train_batch_size=2, save_strategy="no")
    )
    trainer = InOrder(model=cm, args=args, train_dataset=_rows([12, 12, 12, 12, 24]))
    trainer.train()
    rows, packed = cm.budget_receipts
    assert [(r.bucket_tokens, r.bucket_length) for r in (rows, packed)] == [(24, None), (24, 24)]
    (logged,) = [e for e in trainer.state.log_history if "loss" in e]
    assert logged["remat/budget_predicted_bytes"] == packed.predicted_bytes


def _oom_once(module):
    """A forward pre-hook on `module` raising the device's out-of-memory error (CUDA's words) at its first call."""
    fired = []

    def hook(*_):
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    return module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("where", ["profile", "budget"])
def test_auto_find_batch_size_halves_a_batch_the_budgets_first_step_or_the_budget_cannot_take(tmp_path, where):
    """Trainer's `auto_find_batch_size=True` (accelerate's batch-size finder) halves the batch on an out-of-memory
    error: remat's profile turned the device's into a StateError (no cause kept), and a budget's "fits no map" was a
    ValueError, so training stopped where a smaller batch fits (helper-91). Both are torch's OutOfMemoryError too."""
    ids = torch.randint(3, 96, (16, 12), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()} for r in ids]
    budget: int | str = "1GiB"
    if where == "budget":  # 8 rows of 12 tokens fit (every layer recomputed), 16 rows do not
        probe = CheckpointedModel(_model(), CheckpointConfig(budget="1GiB", budget_scope="activations"))
        probe(**{k: torch.stack([r[k] for r in rows[:8]]) for k in rows[0]}).loss.backward()
        budget = int(1.2 * controller_of(probe).budget.profile.frontier(tokens=96)[0].predicted_device_bytes)
    cm = CheckpointedModel(_model(), CheckpointConfig(budget=budget, budget_scope="activations"))
    handle = _oom_once(next(iter(cm.layers[2].children()))) if where == "profile" else None
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        auto_find_batch_size=True,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = RematTrainer(model=cm, args=args, train_dataset=rows)
    trainer.train()
    assert trainer._train_batch_size < 16 and trainer.state.global_step == 2  # accelerate's finder: 0.9x a retry
    if handle is not None:
        handle.remove()


def test_under_trainers_bf16_a_step_is_of_the_autocast_kind_and_measured_again(tmp_path, caplog):
    """accelerate's mixed precision (Trainer's bf16=True) wraps the model's forward in autocast, which remat's forward
    pre-hook ran before: the steps were taken for fp32 ones, planned from an fp32 profile, and a profile measured
    under it was saved as "autocast off" (a resume in fp32 planned from bf16 prices)."""
    cm = CheckpointedModel(_model(), CheckpointConfig(budget="64MiB"))
    with caplog.at_level(logging.INFO, logger="remat"):
        cm(**{k: torch.tensor([v]) for k, v in _rows([12])[0].items()}).loss.backward()  # an fp32 step first
        args = TrainingArguments(**_common(tmp_path, max_steps=1, save_steps=1, bf16=True))
        RematTrainer(model=cm, args=args, train_dataset=_rows([12, 12])).train()
    first, again = _measured(caplog)
    assert "not of the kind profiled (this: inputs tokens only; autocast cpu bfloat16; profiled: " in again, again
    saved = json.loads((tmp_path / "out" / "checkpoint-1" / "checkpoint_config.json").read_text())
    assert saved["budget_profile"]["kind"] == "inputs tokens only; autocast cpu bfloat16"
