"""The head row under the real trainers: `head="chunked"` in the config of a wrapper trained by
`RematTrainer`, TRL's SFT (both of its loss types), DPO and GRPO. Each trains, logs its usual
metrics, and the map's head row says what ran: remat's chunks where the trainer hands the model its
labels (`RematTrainer`), TRL's own fused head where TRL asks for it (its SFT, DPO and GRPO trainers
pass `fused_lm_head=True`)."""

import datasets
import pytest
import torch
import trl
from test_trl import _common, _model, _trl_trainer
from transformers import TrainingArguments

from remat import CheckpointConfig, CheckpointedModel, RematTrainer, remat_trainer_class
from remat.demo import byte_tokenizer

CHUNKED = CheckpointConfig(every_n_layers=2, head="chunked", head_chunk_tokens=8)


def _trained(trainer, cm):
    before = {n: p.detach().clone() for n, p in cm.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(cm.model.named_parameters())
    assert any(not torch.equal(value, after[name]) for name, value in before.items()), "the adapters trained"
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_remat_trainer_trains_with_the_chunked_head_and_its_row_says_so(tmp_path):
    cm = CheckpointedModel(_model(), CHUNKED)
    seen = []
    cm.model.register_forward_hook(lambda module, args, out: seen.append(out.logits is None))
    rows = [{"input_ids": list(range(3 + i, 19 + i)), "labels": list(range(3 + i, 19 + i))} for i in range(8)]
    args = TrainingArguments(**_common(tmp_path, max_steps=2, save_strategy="no"))
    logged = _trained(RematTrainer(model=cm, args=args, train_dataset=datasets.Dataset.from_list(rows)), cm)
    assert len(logged) == 2 and all(entry["loss"] > 0 for entry in logged)
    assert seen == [True, True], "both training forwards ran the chunked head (no logits)"
    assert cm.checkpoint_map.head.label == "chunked(8)"


def test_under_trainers_bf16_the_chunked_head_runs_in_bf16_and_trains_as_the_plain_head(tmp_path):
    """Trainer(bf16=True) puts accelerate's autocast inside the model's forward; the chunked loss, computed once the
    forward returned, ran its head matmuls in fp32 (other losses and weights than the plain head's under the same
    Trainer). It runs in the autocast the head was called under."""
    rows = [{"input_ids": list(range(3 + i, 19 + i)), "labels": list(range(3 + i, 19 + i))} for i in range(8)]
    runs = {}
    for head in ("plain", "chunked"):
        torch.manual_seed(0)
        cm = CheckpointedModel(_model(), CHUNKED.replace(head=head, head_chunk_tokens=8 if head == "chunked" else None))
        dtypes = set()
        lm_head = cm.model.get_output_embeddings()
        lm_head.register_forward_hook(lambda module, args, out, seen=dtypes: seen.add(out.dtype) if out.numel() else 0)
        args = TrainingArguments(**_common(tmp_path / head, max_steps=2, save_strategy="no", bf16=True))
        logged = _trained(RematTrainer(model=cm, args=args, train_dataset=datasets.Dataset.from_list(rows)), cm)
        runs[head] = ([entry["loss"] for entry in logged], dtypes)
    assert runs["chunked"][1] == runs["plain"][1] == {torch.bfloat16}
    torch.testing.assert_close(runs["chunked"][0], runs["plain"][0], rtol=1e-3, atol=0)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_trains_with_trls_fused_head_and_the_row_says_remat_stood_down(tmp_path, loss_type):
    cm = CheckpointedModel(_model(), CHUNKED)
    args = trl.SFTConfig(max_length=32, loss_type=loss_type, **_common(tmp_path, max_steps=2, save_strategy="no"))
    text = "the quick brown fox jumps over the lazy dog. " * 3
    data = datasets.Dataset.from_dict({"text": [text[i:] for i in range(16)]})
    sft = remat_trainer_class(trl.SFTTrainer)(
        model=cm, args=args, train_dataset=data, processing_class=byte_tokenizer()
    )
    logged = _trained(sft, cm)
    assert all({"loss", "mean_token_accuracy", "entropy"} <= entry.keys() for entry in logged), logged
    head = cm.checkpoint_map.head
    assert head.policy == "plain" and "TRL's fused LM head" in head.reason and "chunked(8) planned" in head.reason


@pytest.mark.parametrize("name, metric", [("DPOTrainer", "rewards/chosen"), ("GRPOTrainer", "reward")])
def test_dpo_and_grpo_train_with_trls_fused_head_and_the_row_says_remat_stood_down(tmp_path, name, metric):
    """TRL 1.16's DPO and GRPO compute their log-probabilities with TRL's fused head (labels and
    `fused_lm_head=True`): remat leaves those forwards to it."""
    cm = CheckpointedModel(_model(), CHUNKED)
    trainer = _trl_trainer(name, tmp_path, cm, [])
    logged = _trained(trainer, cm)
    assert logged and all(metric in entry for entry in logged), logged
    head = cm.checkpoint_map.head
    assert head.policy == "plain" and "TRL's fused LM head" in head.reason
