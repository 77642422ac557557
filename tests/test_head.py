"""The head row: `head="chunked"` computes the causal-LM loss in chunks of counted tokens.

Judged against the model's own forward (the same weights, head="plain"): the loss and every
gradient equal in fp32 on every family remat chunks, with half the labels ignored; a LoRA'd head,
tied embeddings, Gemma 2's softcapping, Cohere's scale and a MoE auxiliary loss included. What
the chunked forward creates is watched by a dispatch mode of the test's own (no full logits, no
vocabulary x hidden gradient for a frozen head)."""

import logging
import math

import pytest
import torch
from conftest import ARCHS, HEAD_FAMILIES, VOCAB, add_lora, assert_same_grads, batch, step_grads, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat import CheckpointConfig, CheckpointedModel
from remat.errors import ConfigError

CHUNK = 5  # tokens: several chunks and a short last one


def _half_ignored(seed: int = 0):
    data = batch(seed=seed)
    labels = data["labels"]
    labels[:, ::2] = -100
    return data


def _loss_and_grads(model, head: str, data, **config):
    cm = CheckpointedModel(model, CheckpointConfig(head=head, **config))
    loss, grads = step_grads(cm, list(cm.model.named_parameters()), data)
    cm.disable()
    return loss, grads


def _same_as_plain(build, data, **config):
    plain_loss, plain = _loss_and_grads(build(), "plain", data, **config)
    loss, grads = _loss_and_grads(build(), "chunked", data, head_chunk_tokens=CHUNK, **config)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-7, equal_nan=True)  # nan only as the plain
    assert_same_grads(plain, grads)
    assert grads, "some parameter got a gradient"
    return plain_loss, plain


@pytest.mark.parametrize("arch", [*ARCHS, "gemma2", "cohere", "qwen2", *HEAD_FAMILIES])
def test_the_chunked_loss_and_every_gradient_equal_the_models_own(arch):
    """Every family remat chunks (`remat.head.FAMILIES`): MoE auxiliary losses on, Gemma's softcapping, Cohere's
    scale and Granite's divisor small enough to matter; the chunked head ran (its output has no logits)."""
    build = lambda: tiny_model(arch)
    if arch == "qwen2_moe":  # its auxiliary loss on
        build = lambda: tiny_model(arch, output_router_logits=True)
    _same_as_plain(build, _half_ignored())
    cm = CheckpointedModel(build(), CheckpointConfig(head="chunked"))
    assert cm(**_half_ignored()).logits is None, cm.checkpoint_map.head.reason


def test_a_lora_head_and_tied_embeddings_train_exactly():
    from peft import LoraConfig, get_peft_model

    def lora_head():
        model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
        return model

    _same_as_plain(lora_head, _half_ignored())
    _same_as_plain(lambda: tiny_model(tie_word_embeddings=True), _half_ignored(1))


@pytest.mark.parametrize("items", [None, torch.tensor(10), torch.tensor(0)], ids=["counted", "items", "no-items"])
@pytest.mark.parametrize("arch", ["llama-lora", "qwen2_moe"])
def test_a_batch_with_no_counted_token_has_the_models_own_loss_and_gradients(arch, items):
    """Every label ignored (a fully masked micro-batch): the model's own loss is nan over its counted
    tokens, 0 over `num_items_in_batch` (nan over 0), still in the graph: every trainable parameter
    gets a gradient, zeros (a MoE model: its auxiliary loss's). The chunked loss and gradients too."""
    if arch == "qwen2_moe":
        build = lambda: tiny_model(arch, output_router_logits=True)
    else:
        build = lambda: add_lora(tiny_model(), dropout=0.0)
    data = batch()
    data["labels"][:] = -100
    if items is not None:
        data["num_items_in_batch"] = items
    plain_loss, plain = _same_as_plain(build, data)
    assert plain_loss.dtype == torch.float32
    assert plain_loss.isnan() if items is None or items == 0 else plain_loss.isfinite()
    assert len(plain) == sum(p.requires_grad for p in build().parameters()), "every trainable parameter"
    if arch != "qwen2_moe":
        assert all(not g.any() for g in plain.values()), "the plain head's gradients: zeros"


def test_the_output_has_the_loss_and_no_logits_and_the_map_shows_the_head_row():
    cm = CheckpointedModel(tiny_model(), CheckpointConfig(head="chunked", head_chunk_tokens=CHUNK))
    out = cm(**batch())
    assert out.logits is None and "logits" not in out and out.loss.requires_grad
    head = cm.checkpoint_map.head
    assert (head.name, head.label) == ("lm_head", f"chunked({CHUNK})")
    last = str(cm.checkpoint_map).splitlines()[-1].split()
    assert last[:3] == ["head", "lm_head", f"chunked({CHUNK})"]
    assert "head chunked(5)" in repr(cm.checkpoint_map)
    plain = CheckpointedModel(tiny_model(), CheckpointConfig())
    assert str(plain.checkpoint_map).splitlines()[-1].split()[:3] == ["head", "lm_head", "plain"]


def test_evaluation_generation_and_forwards_without_labels_or_gradients_run_the_models_own_head():
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked", head_chunk_tokens=CHUNK))
    data = batch()
    with torch.no_grad():  # training mode, dropout on: the same seed for both
        torch.manual_seed(0)
        expected = model.lm_head(model.model(**{k: v for k, v in data.items() if k != "labels"}).last_hidden_state)
        torch.manual_seed(0)
        assert torch.equal(cm(**data).logits, expected)  # no gradients
    no_labels = {k: v for k, v in data.items() if k != "labels"}
    assert cm(**no_labels).logits.shape == (*data["input_ids"].shape, VOCAB)
    with cm.for_inference():
        out = cm(**data)
        assert out.logits.shape[-1] == VOCAB and out.loss is not None
        assert cm.generate(input_ids=data["input_ids"][:1, :4], max_new_tokens=2, do_sample=False).shape == (1, 6)
    # the row said what the training forward without labels ran; with labels it chunks again
    assert cm.checkpoint_map.head.policy == "plain" and "without labels" in cm.checkpoint_map.head.reason
    assert cm(**data).logits is None and cm.checkpoint_map.head.label == f"chunked({CHUNK})"


class _Shapes(TorchDispatchMode):
    """Every shape an op makes while it is on, views aside (the test's own watch, not remat's)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.shapes.update(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def test_a_frozen_head_gets_no_vocabulary_by_hidden_gradient_and_no_full_logits_are_made():
    cm = CheckpointedModel(add_lora(tiny_model(), dropout=0.0), CheckpointConfig(head="chunked", head_chunk_tokens=4))
    data = batch()
    tokens = data["input_ids"].numel()
    hidden = cm.model.config.hidden_size
    watch = _Shapes()
    with watch:
        cm(**data).loss.backward()
    assert (VOCAB, hidden) not in watch.shapes and (hidden, VOCAB) not in watch.shapes
    rows = lambda shapes: {math.prod(s[:-1]) for s in shapes if len(s) >= 2 and s[-1] == VOCAB}
    assert max(rows(watch.shapes)) == 4, "logits of one chunk at a time, never more"
    # the same watch sees the full logits in the plain forward
    plain = _Shapes()
    cm.enable(cm.checkpoint_config.replace(head="plain", head_chunk_tokens=None))
    with plain:
        cm(**data).loss.backward()
    assert max(rows(plain.shapes)) == tokens


def test_num_items_in_batch_divides_as_the_models_own_loss():
    data = _half_ignored()
    for items in (7, torch.tensor(31)):
        losses = []
        for head in ("plain", "chunked"):
            cm = CheckpointedModel(tiny_model(), CheckpointConfig(head=head))
            losses.append(cm(**data, num_items_in_batch=items).loss)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-7)


def _trained_as_the_plain_head(tmp_path, records, batch_size):
    """One optimizer step of two micro-batches through a real `RematTrainer`, plain head and chunked:
    the adapters move, and equally."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from remat import RematTrainer

    weights = {}
    for head in ("plain", "chunked"):
        cm = CheckpointedModel(add_lora(tiny_model(), dropout=0.0), CheckpointConfig(head=head))
        before = {n: p.detach().clone() for n, p in cm.model.named_parameters() if p.requires_grad}
        args = TrainingArguments(
            output_dir=str(tmp_path / head),
            max_steps=1,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            optim="sgd",  # linear in the gradients: Adam would magnify the last bit of tiny ones
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
        )
        trainer = RematTrainer(model=cm, args=args, train_dataset=Dataset.from_list(records))
        trainer.train()
        weights[head] = {n: p.detach().clone() for n, p in cm.model.named_parameters() if p.requires_grad}
        assert any(not torch.equal(before[n], w) for n, w in weights[head].items()), "the adapters trained"
        assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert_same_grads(weights["plain"], weights["chunked"])


def test_gradient_accumulation_through_a_real_trainer_trains_as_the_plain_head(tmp_path):
    rows = [_half_ignored(seed) for seed in range(2)]
    records = [{k: v[i].tolist() for k, v in row.items()} for row in rows for i in range(2)]
    records[1]["labels"][:6] = [-100] * 6  # unequal counts: the sum over num_items_in_batch matters
    _trained_as_the_plain_head(tmp_path, records, batch_size=2)


def test_a_fully_masked_micro_batch_in_gradient_accumulation_trains_as_the_plain_head(tmp_path):
    """A micro-batch with no counted token (a prompt-only example): its loss, 0 over the step's
    `num_items_in_batch`, still goes through backward, and the step equals the plain head's."""
    rows = [{k: v[0].tolist() for k, v in _half_ignored(seed).items()} for seed in range(2)]
    rows[1]["labels"] = [-100] * len(rows[1]["labels"])
    _trained_as_the_plain_head(tmp_path, rows, batch_size=1)  # one row a micro-batch: one of the two is masked


def test_a_family_remat_cannot_reproduce_keeps_its_own_head_and_says_why():
    model = tiny_model()
    model.config.model_type = "somebody_elses"
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked"))
    head = cm.checkpoint_map.head
    assert head.policy == "plain" and "'somebody_elses') is not one of them" in head.reason
    assert cm(**batch()).logits is not None
    # a masked LM is not a family remat lacks: its loss is another (the list of families invited "add bert")
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    reason = CheckpointedModel(bert, CheckpointConfig(head="chunked")).checkpoint_map.head.reason
    assert reason.startswith("BertForMaskedLM is not a causal language model"), reason
    from transformers import GPT2Config, GPT2LMHeadModel  # a causal LM outside the families, named otherwise

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4))
    reason = CheckpointedModel(gpt2, CheckpointConfig(head="chunked")).checkpoint_map.head.reason
    assert "('gpt2') is not one of them" in reason, reason


def test_adaloras_regularized_loss_keeps_its_own_head_and_trains_exactly():
    """AdaLoRA adds its orthogonal regularization to `outputs.loss` in its own forward: the chunked head's loss
    bypassed it (loss 4.60 against 5.81, other gradients), silently. A tuner with a forward of its own keeps the
    model's own head."""
    from peft import AdaLoraConfig, get_peft_model

    def build():
        config = AdaLoraConfig(
            init_r=6, target_r=2, total_step=5, target_modules=["q_proj", "v_proj"], orth_reg_weight=0.5,
            lora_dropout=0.0, task_type="CAUSAL_LM",
        )  # fmt: skip
        return get_peft_model(tiny_model(attention_dropout=0.0), config)

    plain_loss, plain = _loss_and_grads(build(), "plain", batch())
    model = build()
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked"))
    assert cm.checkpoint_map.head.policy == "plain" and "AdaLoraModel has a forward of its own" in (
        cm.checkpoint_map.head.reason
    )
    loss, grads = step_grads(cm, list(model.named_parameters()), batch())
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(plain, grads)


def test_a_forward_that_raises_leaves_the_head_as_it_was():
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked", head_chunk_tokens=CHUNK))

    def fail(*_):
        raise RuntimeError("injected")

    handle = model.model.norm.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        cm(**batch())
    handle.remove()
    assert not model.lm_head._forward_pre_hooks
    assert cm(**batch()).loss is not None
    cm.disable()
    assert not model.lm_head._forward_pre_hooks and not model._forward_hooks
    assert cm.model(**batch()).logits is not None


def test_head_chunk_tokens_without_chunked_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match='add head="chunked"'):
        CheckpointConfig(head_chunk_tokens=256)
    with pytest.raises(ValueError, match="head"):
        CheckpointConfig(head="fused")
    config = CheckpointConfig(head="chunked", head_chunk_tokens=256)
    assert CheckpointConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_profile_of_the_chunked_head_predicts_the_step_peak_memtracker_measures(arch):
    """The planner measures the head as it runs: profiled with head="chunked", every plan keeps the
    head and its predicted step peak is within 5% of MemTracker's, at three budgets, on Llama and on
    Gemma 2 (final softcapping)."""
    from independent_memory import step_peak_bytes

    model = tiny_model(arch, num_hidden_layers=4)
    cm = CheckpointedModel(add_lora(model, dropout=0.0), CheckpointConfig(head="chunked", head_chunk_tokens=8))
    data = _half_ignored()
    trainable = [p for p in cm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    profile = cm.profile(data, optimizer=optimizer, repeats=1, progress=False)
    frontier = profile.frontier(scope="step")
    low, high = frontier[0].predicted_peak_bytes, frontier[-1].predicted_peak_bytes
    for fraction in (0.1, 0.5, 0.9):
        planned = profile.plan(int(low + fraction * (high - low)), scope="step")
        assert (planned.head, planned.head_chunk_tokens) == ("chunked", 8)
        cm.enable(planned)
        cm(**data).loss.backward()  # a first step makes the optimizer's state
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measured = step_peak_bytes(cm, data, optimizer)
        assert abs(measured - planned.predicted_peak_bytes) <= 0.05 * planned.predicted_peak_bytes, (
            fraction,
            measured,
            planned.predicted_peak_bytes,
        )
        assert cm.checkpoint_map.head.label == "chunked(8)"
        optimizer.state.clear()


def test_an_explicit_profile_on_a_batch_with_every_label_ignored_prices_steps_that_count_them():
    """cm.profile(batch) with head="chunked" counts every label as a budget's profile does: the chunked head holds per
    counted token, and a first batch whose labels were all ignored (a padded micro-batch) priced it at nothing; every
    plan was then about 2x under MemTracker's peak of a step of the same length with its labels counted."""
    from independent_memory import step_peak_bytes

    cm = CheckpointedModel(
        add_lora(tiny_model(num_hidden_layers=4, vocab_size=1024, attention_dropout=0.0), dropout=0.0),
        CheckpointConfig(head="chunked"),
    )
    first = batch(size=2, seq=32)
    first["labels"][:] = -100
    no_state = torch.optim.SGD([p for p in cm.parameters() if p.requires_grad], lr=0.0)
    frontier = cm.profile(first, optimizer=no_state, repeats=1, progress=False).frontier(scope="step")
    counted = batch(size=2, seq=32, seed=1)
    for planned in frontier:
        cm.enable(planned)
        assert step_peak_bytes(cm, counted, no_state) <= planned.predicted_peak_bytes, planned


def test_a_head_choosing_profile_prices_its_chunks_for_more_and_fewer_tokens_than_it_measured():
    """Every chunked plan of `frontier(scope="step", tokens=..., length=...)` against MemTracker's peak of such a
    step. A chunk was priced as a difference from the profiled head's step, kept at any tokens: at half the tokens
    2.7x under. It keeps its whole for fewer tokens now; for more tokens, or longer rows, the difference stays and the
    recomputes' floor takes no chunk's saving (with it, one row twice as long was 1.3x under: eager attention's
    scores grow faster than anything the profile measured)."""
    from independent_memory import step_peak_bytes

    model = add_lora(tiny_model(num_hidden_layers=4, vocab_size=1024, attention_dropout=0.0), dropout=0.0)
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked"))
    optimizer = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=1e-3)
    profiled = batch(size=2, seq=64)
    cm(**profiled).loss.backward()  # the optimizer's state first
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    profile = cm.profile(profiled, optimizer=optimizer, repeats=1, progress=False)
    for (size, seq), length, slack in [((1, 128), 128, 1.07), ((2, 32), None, 1.0)]:  # (the README's 7%: longer rows)
        data = batch(size=size, seq=seq, seed=3)
        chunked = [p for p in profile.frontier(scope="step", tokens=size * seq, length=length) if p.head == "chunked"]
        assert len(chunked) >= 2, (size, seq)
        for planned in chunked:
            cm.enable(planned)
            measured = step_peak_bytes(cm, data, optimizer)
            assert measured <= slack * planned.predicted_peak_bytes, (size, seq, planned, measured)


def test_the_planner_chooses_the_head_and_the_largest_chunk_that_fits_with_the_layers():
    """Profiled with head="chunked" and no head_chunk_tokens, the profile measures the head plain and
    at two chunk sizes; plans then choose the head with the layers: plain where it fits (fastest),
    else the largest chunk that fits; a budget under every plan with the plain head, which before
    was "nothing fits", gets a chunked head. Each plan's step peak within 5% of MemTracker's."""
    from independent_memory import step_peak_bytes

    model = add_lora(tiny_model(vocab_size=4096, num_hidden_layers=4), dropout=0.0)
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked"))
    data = batch(size=2, seq=32)
    data["labels"][:, :8] = -100
    optimizer = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=1e-3)
    profile = cm.profile(data, optimizer=optimizer, repeats=1, progress=False)
    frontier = profile.frontier(scope="step")
    heads = [(p.head, p.head_chunk_tokens) for p in frontier]
    assert heads[-1] == ("plain", None) and {("chunked", 16), ("chunked", 32)} <= set(heads)
    least_plain = min(p.predicted_peak_bytes for p in frontier if p.head == "plain")
    assert profile.plan(least_plain - 1, scope="step").head == "chunked"
    assert profile.plan(frontier[-1].predicted_peak_bytes * 2, scope="step").head == "plain"
    options = profile.measurements.head.choices()
    for budget in (
        frontier[0].predicted_peak_bytes,
        (frontier[0].predicted_peak_bytes + least_plain) // 2,
        least_plain,
    ):
        planned = profile.plan(budget, scope="step")
        if planned.head == "chunked":  # a larger chunk with the same layers does not fit
            larger = [o for o in options if o.policy == "chunked" and o.chunk_tokens > planned.head_chunk_tokens]
            chosen = next(o for o in options if o.chunk_tokens == planned.head_chunk_tokens)
            own = planned.predicted_peak_bytes - chosen.outside - chosen.extra
            assert all(own + o.outside + o.extra > budget for o in larger)
        cm.enable(planned)
        cm(**data).loss.backward()  # a first step makes the optimizer's state
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measured = step_peak_bytes(cm, data, optimizer)
        assert abs(measured - planned.predicted_peak_bytes) <= 0.05 * planned.predicted_peak_bytes
        assert cm.checkpoint_map.head.label == (
            f"chunked({planned.head_chunk_tokens})" if planned.head == "chunked" else "plain"
        )
        optimizer.state.clear()
    assert "outside layers (head " in str(planned)


def test_a_quantized_head_runs_as_a_module_per_chunk(tmp_path):
    """An 8-bit head (bitsandbytes on the CPU, the LM head quantized too) goes through the quantized
    module once per chunk (and once on no tokens, the model's own call), and trains. Not bit-equal to
    the model's own head: int8 scales its input by what each call holds (here 0.6% apart in the loss)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model(attention_dropout=0.0, hidden_size=64, intermediate_size=128).save_pretrained(tmp_path)
    losses = {}
    for head in ("plain", "chunked"):
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path,
            quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=[]),
            device_map="cpu",
        )
        assert type(model.lm_head).__name__ == "Linear8bitLt"
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        model.train()
        cm = CheckpointedModel(
            model, CheckpointConfig(head=head, head_chunk_tokens=CHUNK if head == "chunked" else None)
        )
        rows = []
        record = lambda module, args, out, rows=rows: rows.append(args[0].shape[-2])  # what the head ran on
        model.base_model.model.lm_head.register_forward_hook(record)
        data = _half_ignored()
        loss = cm(**data).loss
        loss.backward()
        losses[head] = float(loss)
        lora = [p.grad for n, p in model.named_parameters() if "lora_" in n]
        assert all(g is not None and torch.isfinite(g).all() for g in lora) and any(g.abs().sum() > 0 for g in lora)
    counted = int((data["labels"][:, 1:] != -100).sum())
    chunks = [min(CHUNK, counted - start) for start in range(0, counted, CHUNK)]
    assert rows == [0, *chunks, *chunks[::-1]], rows  # the model's own call on no tokens; forward; backward
    assert losses["chunked"] == pytest.approx(losses["plain"], rel=0.02)


def test_trls_fused_head_is_measured_as_it_runs():
    """A batch that asks for TRL's fused head (as TRL's trainers do): remat stands down in the
    profile's steps too, so the profile measures TRL's head, and a plan's step peak is within 5% of
    MemTracker's for that batch; no head options are offered (remat's head does not run)."""
    from independent_memory import step_peak_bytes
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model(vocab_size=4096, num_hidden_layers=4)
    add_fused_lm_head(model, outputs=("log_probs",))
    cm = CheckpointedModel(add_lora(model, dropout=0.0), CheckpointConfig(head="chunked"))
    data = {**batch(size=2, seq=32), "fused_lm_head": True}
    optimizer = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=1e-3)
    profile = cm.profile(data, optimizer=optimizer, repeats=1, progress=False)
    assert profile.measurements.head is None
    frontier = profile.frontier(scope="step")
    planned = profile.plan((frontier[0].predicted_peak_bytes + frontier[-1].predicted_peak_bytes) // 2, scope="step")
    cm.enable(planned)
    cm(**data).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    measured = step_peak_bytes(cm, data, optimizer)
    assert abs(measured - planned.predicted_peak_bytes) <= 0.05 * planned.predicted_peak_bytes
    assert "TRL's fused LM head" in cm.checkpoint_map.head.reason


@pytest.mark.parametrize("when", ["before wrapping", "after wrapping"])
def test_where_liger_replaced_the_forward_remat_stands_down_and_liger_computes_the_loss(when, monkeypatch):
    """Liger Kernel's own forward (its fused linear cross-entropy) gets the labels and computes the
    loss; the row says Liger's head ran; the layers are still checkpointed exactly. Liger's loss
    kernel is Triton (no CPU), so the test swaps it, inside Liger's forward, for the same loss in
    torch: the spy proves Liger's fused path ran with the labels remat would otherwise take."""
    liger = pytest.importorskip("liger_kernel.transformers")
    from liger_kernel.transformers.model import llama as liger_llama

    calls = []

    def fused_loss(self, hidden_states, hidden_size, labels, shift_labels, **kwargs):
        calls.append(labels)
        logits = self.lm_head(hidden_states)
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

    monkeypatch.setattr(liger_llama, "lce_maybe_trainable_lm_head", fused_loss)

    def patch(model):
        flags = dict(rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True)
        liger._apply_liger_kernel_to_instance(model=model, **flags)

    data = batch()
    plain = tiny_model()
    expected_loss, expected = step_grads(plain, list(plain.named_parameters()), data)
    model = tiny_model()
    if when == "before wrapping":
        patch(model)
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked"))
    if when == "after wrapping":
        patch(model)
    loss, grads = step_grads(cm, list(model.named_parameters()), data)
    assert len(calls) == 1 and torch.equal(calls[0], data["labels"])
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(expected, grads)
    head = cm.checkpoint_map.head
    assert head.policy == "plain" and "Liger Kernel replaced the forward" in head.reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's fused loss is a Triton kernel: it needs a GPU")
def test_liger_on_a_gpu_computes_the_loss_beside_remats_checkpointed_layers():
    """The same stand-down with Liger's real Triton loss: the loss is the model's own (to Liger's
    precision), the layers are checkpointed, and the row names Liger."""
    liger = pytest.importorskip("liger_kernel.transformers")
    data = {key: value.cuda() for key, value in batch().items()}
    plain = tiny_model().cuda()
    expected = plain(**data).loss
    model = tiny_model().cuda()
    liger._apply_liger_kernel_to_instance(model=model, rope=False, rms_norm=False, swiglu=False)
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked"))
    loss = cm(**data).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    assert "Liger Kernel replaced the forward" in cm.checkpoint_map.head.reason


def test_a_head_profile_prices_a_chunk_between_its_measured_points_never_below_them():
    """Pure: between two measured chunk sizes a chunk is priced on the line through them; below the
    first as the first; beyond the last on the last line. Plain and the recompute grow with the
    tokens (`tokens=`), a chunk's own bytes do not."""
    from remat.planner.chooser import HeadProfile

    head = HeadProfile(
        counted=100,
        profiled=100,
        plain=(1000, 500),
        points=((16, 0, -900), (64, 0, -600), (100, 0, 0)),
        recompute_seconds=0.01,
        chunk_seconds=0.001,
    )
    priced = {c.chunk_tokens: c for c in head.choices()}
    assert sorted(k for k in priced if k is not None) == [16, 32, 64, 100]
    assert (priced[16].extra, priced[32].extra, priced[64].extra, priced[100].extra) == (-900, -800, -600, 0)
    assert priced[None].seconds == pytest.approx(-(0.01 + 0.001)) and priced[100].seconds == 0.0
    assert priced[16].seconds == pytest.approx(0.001 * (7 - 1))  # 7 chunks instead of 1
    double = {c.chunk_tokens: c for c in head.scaled(2.0, 0, 0, True).choices()}
    assert max(k for k in double if k is not None) == 200 and double[None].outside == 2000
    assert double[200].extra == 1667  # beyond the last point: on the last line (64 -> 100)
    assert double[16].extra == -900 and head.scaled(2.0, 0, 0, True).grown  # more tokens: the difference stays
    # at half the tokens the profiled head's step extra shrank by 900: chunk 16 keeps its whole (a chunk's buffers do
    # not shrink), no longer 900 below the new extra; plain's logits halve
    halved = {c.chunk_tokens: c for c in head.scaled(0.5, 900, 0, False).choices()}
    assert halved[16].extra == -900 + 900 and halved[None].extra == 250


def test_a_deep_copy_chunks_on_its_own_model_and_disabling_it_leaves_the_original_chunking():
    import copy

    cm = CheckpointedModel(tiny_model(), CheckpointConfig(head="chunked", head_chunk_tokens=CHUNK))
    twin = copy.deepcopy(cm)
    assert twin(**batch()).logits is None and twin.checkpoint_map.head.label == f"chunked({CHUNK})"
    twin.disable()
    assert twin.model(**batch()).logits is not None and not twin.model.lm_head._forward_pre_hooks
    assert cm(**batch()).logits is None, "the original still chunks"


def test_pre_shifted_labels_and_tuple_outputs_are_reproduced_as_the_model_gives_them():
    """`shift_labels` (what Trainer passes under sequence parallelism) are scored unshifted, as the
    model's own loss scores them; a caller asking for return_dict=False runs the model's own head (its
    logits are what it asked for)."""
    data = _half_ignored()
    shifted = torch.roll(data["labels"], -1, dims=1)
    shifted[:, -1] = -100
    shifted[0, :3] = -100
    losses = []
    for head in ("plain", "chunked"):
        cm = CheckpointedModel(
            tiny_model(), CheckpointConfig(head=head, head_chunk_tokens=CHUNK if head != "plain" else None)
        )
        torch.manual_seed(0)
        losses.append(cm(**data, shift_labels=shifted).loss)
        torch.manual_seed(0)
        losses.append(cm(**data).loss)
        torch.manual_seed(0)
        out = cm(**data, return_dict=False)
        losses.append(out[0])
        assert out[1].shape[-1] == VOCAB  # the logits the caller asked for
    plain, chunked = losses[:3], losses[3:]
    assert chunked[2].requires_grad and cm.checkpoint_map.head.policy == "plain"  # the last call ran plain
    for a, b in zip(plain, chunked, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(plain[0], plain[1]), "the shifted labels changed the loss: the test can tell"


def test_the_shorter_batch_of_a_head_choosing_profile_is_measured_with_the_chunked_head():
    """Measuring the head's options left the wrapper at the plain head, and the shorter batch was then measured with
    it: the smallest map at half the tokens was predicted 10x larger than at the full length, and a budget refused
    shorter steps that fit."""
    cm = CheckpointedModel(add_lora(tiny_model(vocab_size=4096, attention_dropout=0.0)), head="chunked")
    profile = cm.profile(batch(size=2, seq=16), repeats=1, progress=False)
    m = profile.measurements
    assert m.shorter.outside.checkpointing <= m.outside.checkpointing
    smallest = [profile.frontier(tokens=tokens)[0].predicted_device_bytes for tokens in (8, 16, 32)]
    assert smallest == sorted(smallest), smallest
    from independent_memory import activation_bytes

    shorter = batch(size=2, seq=8)  # the profile's own shorter batch: what a plan for 16 tokens holds, counted apart
    planned = profile.frontier(tokens=16)[0]
    cm.enable(planned)
    measured = activation_bytes(cm, shorter)
    assert abs(measured - planned.predicted_device_bytes) <= 0.05 * planned.predicted_device_bytes


@pytest.mark.parametrize("adapter", ["lora", "loha"])
def test_an_adapter_head_with_dropout_gets_the_gradient_of_the_loss_it_returned(adapter, caplog):
    """Each chunk's recompute draws its forward's random numbers again: without the RNG state kept, a LoRA'd head's
    gradients depended on what drew random numbers between forward and backward (0.5 of a 1.2 gradient), and a
    LoHa head's module dropout failed backward (another number of tensors saved in the recompute)."""
    from peft import LoHaConfig, LoraConfig, get_peft_model

    def lora_head():
        if adapter == "lora":
            config = LoraConfig(r=4, lora_dropout=0.5, target_modules=["lm_head"])
        else:
            config = LoHaConfig(r=4, module_dropout=0.5, rank_dropout=0.3, target_modules=["lm_head"])
        model = get_peft_model(tiny_model(), config)
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.5)
        return model

    if adapter == "lora":  # one row, every position counted: the chunks draw the plain forward's mask
        data = batch(size=1)
        data["shift_labels"] = torch.roll(data["labels"], -1, dims=1)
        _same_as_plain(lora_head, data)
    cm = CheckpointedModel(lora_head(), CheckpointConfig(head="chunked", head_chunk_tokens=CHUNK))
    params = list(cm.model.named_parameters())
    grads = []
    caplog.set_level(logging.INFO, logger="remat")
    for draws in (0, 7):
        for _, param in params:
            param.grad = None
        torch.manual_seed(0)
        loss = cm(**_half_ignored()).loss
        torch.rand(draws)  # other work between forward and backward
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in params if p.grad is not None})
    assert_same_grads(*grads, rtol=0, atol=0)
    said = [r.getMessage() for r in caplog.records if "the head draws random numbers" in r.getMessage()]
    assert len(said) == 1, "one INFO per wrapper: a seeded run draws other numbers than the plain head"
    caplog.clear()
    still = get_peft_model(tiny_model(), LoraConfig(r=4, lora_dropout=0.0, target_modules=["lm_head"]))
    CheckpointedModel(still, CheckpointConfig(head="chunked"))(**batch()).loss.backward()  # a head that draws nothing
    assert not [r for r in caplog.records if "the head draws random numbers" in r.getMessage()]


def test_a_loss_remat_does_not_reproduce_runs_the_models_own_head_and_says_why():
    """A loss function set on the model (after wrapping too), a subclass's own forward: remat computed plain cross
    entropy instead (label smoothing and a z-loss silently dropped). transformers' `ignore_index` loss argument is
    honoured."""
    from transformers import LlamaForCausalLM

    class ZLoss(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if out.loss is not None:
                out.loss = out.loss + 1e-2 * out.logits.float().logsumexp(-1).pow(2).mean()
            return out

    torch.manual_seed(0)
    subclassed = ZLoss(tiny_model().config).train()
    cm = CheckpointedModel(subclassed, CheckpointConfig(head="chunked"))
    assert cm.checkpoint_map.head.policy == "plain" and "ZLoss.forward is " in cm.checkpoint_map.head.reason
    assert cm(**batch()).logits is not None

    smoothed = lambda logits, labels, vocab_size, **kw: torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), label_smoothing=0.1
    )
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked", head_chunk_tokens=CHUNK))
    model.loss_function = smoothed  # after wrapping: read at each forward
    out = cm(**batch())
    assert out.logits is not None and "loss_function is not transformers'" in cm.checkpoint_map.head.reason
    torch.testing.assert_close(out.loss, smoothed(out.logits, batch()["labels"], VOCAB))

    data = batch()
    data["labels"][:, ::3] = 0
    data["ignore_index"] = 0  # labels holding the pad id, ignored as transformers' loss ignores them
    _same_as_plain(tiny_model, data)


def test_an_output_embedding_or_setting_changed_after_wrapping_is_the_one_the_chunks_run():
    """The head, its post-ops and a MoE's auxiliary coefficient are read at each forward: a resized vocabulary (new
    special tokens) failed every step, an adapter added on the head crashed in PEFT, a softcap changed after wrapping
    was not applied."""

    def changed(arch, change):
        build = lambda: tiny_model(arch, output_router_logits=True) if arch == "qwen2_moe" else tiny_model(arch)

        data = _half_ignored()
        plain_model, chunked_model = build(), build()
        plain = CheckpointedModel(plain_model, CheckpointConfig(head="plain"))
        chunked = CheckpointedModel(chunked_model, CheckpointConfig(head="chunked", head_chunk_tokens=CHUNK))
        for model in (plain_model, chunked_model):  # after wrapping
            torch.manual_seed(2)
            change(model)
        loss, grads = step_grads(chunked, list(chunked.model.named_parameters()), data)
        plain_loss, plain_grads = step_grads(plain, list(plain.model.named_parameters()), data)
        assert chunked.checkpoint_map.head.policy == "chunked"
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-7)
        assert_same_grads(plain_grads, grads)

    changed("llama", lambda model: model.resize_token_embeddings(VOCAB + 7))
    changed("gemma2", lambda model: setattr(model.config, "final_logit_softcapping", 2.0))
    changed("qwen2_moe", lambda model: setattr(model, "router_aux_loss_coef", 0.5))


def test_hooks_on_the_head_run_once_on_each_token_before_or_after_wrapping():
    """A pre-hook that shifts the hidden states ran on the whole sequence and again on each chunk (the chunks read
    the states after it): loss and every gradient as a model with the shift applied twice. A forward hook's logit
    bias, and either hook added after wrapping, apply once too."""

    def hooked(model):
        head = model.get_output_embeddings()
        head.register_forward_pre_hook(lambda module, args: (args[0] + 0.1,))
        head.register_forward_hook(lambda module, args, output: output + 0.2 * torch.arange(output.shape[-1]) / VOCAB)
        return model

    _same_as_plain(lambda: hooked(tiny_model("llama")), _half_ignored())
    data = _half_ignored()
    reference = hooked(tiny_model("llama"))
    plain_loss, plain = step_grads(reference, list(reference.named_parameters()), data)
    cm = CheckpointedModel(tiny_model("llama"), CheckpointConfig(head="chunked", head_chunk_tokens=CHUNK))
    hooked(cm.model)
    loss, grads = step_grads(cm, list(cm.model.named_parameters()), data)
    assert cm(**data).logits is None, "the chunked head ran"
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(plain, grads)


def test_an_adapter_on_the_head_added_after_wrapping_trains_exactly():
    from peft import LoraConfig

    def build():
        model = add_lora(tiny_model(), dropout=0.0)
        return model, CheckpointedModel(model, CheckpointConfig(head="plain"))

    results = []
    for head in ("plain", "chunked"):
        model, cm = build()
        cm.enable(head=head, **({"head_chunk_tokens": CHUNK} if head == "chunked" else {}))
        torch.manual_seed(5)
        model.add_adapter("second", LoraConfig(r=4, lora_dropout=0.0, target_modules=["q_proj", "lm_head"]))
        model.set_adapter("second")
        torch.manual_seed(3)
        for name, param in model.named_parameters():
            if "lora_B.second" in name:
                torch.nn.init.normal_(param, std=0.5)
        results.append(step_grads(cm, list(model.named_parameters()), _half_ignored()))
    (plain_loss, plain), (loss, grads) = results
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(plain, grads)
    assert any("lm_head.lora_A.second" in name for name in grads)


def test_logits_to_keep_zero_keeps_every_position_and_the_chunked_head():
    """transformers reads `logits_to_keep=0` as every position: the chunked head computes that loss, and the head row
    says so."""
    data = batch()
    expected = tiny_model()(**data).loss
    cm = CheckpointedModel(tiny_model(), CheckpointConfig(head="chunked"))
    loss = cm(**data, logits_to_keep=0).loss
    assert cm.checkpoint_map.head.policy == "chunked"
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)


def test_logits_to_keep_as_a_tensor_runs_the_models_own_head():
    data = batch()
    keep = torch.tensor([4, 9, 11])
    data["shift_labels"] = data["labels"][:, keep]
    losses = []
    for head in ("plain", "chunked"):
        cm = CheckpointedModel(tiny_model(), CheckpointConfig(head=head))
        out = cm(**data, logits_to_keep=keep)
        assert out.logits.shape[1] == 3 and cm.checkpoint_map.head.policy == "plain"
        losses.append(out.loss)
    torch.testing.assert_close(losses[1], losses[0])


@pytest.mark.parametrize("vocab, seq, hidden", [(512, 32, 64), (4096, 128, 32)])
def test_no_plan_that_chooses_the_head_predicts_less_than_memtracker_measures(vocab, seq, hidden):
    """The head's options were measured with every layer recomputed only, where the step peaks in the last layer's
    recompute and hides the head's own backward: a map ending "none" with the plain head went 12 KB over its
    prediction. And one chunk of all is cheaper than the line through the smaller chunks (no second gradient of a
    trained head, no hidden-state gradient rebuilt from slices): a chunk priced between them went 3.2% over.
    Every plan of the frontier now holds its predicted peak or less, as MemTracker counts it."""
    from independent_memory import step_peak_bytes

    torch.manual_seed(0)
    model = tiny_model(vocab_size=vocab, num_hidden_layers=2, hidden_size=hidden, intermediate_size=2 * hidden)
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked", head_chunk_tokens=None))
    data = batch(size=2, seq=seq)
    optimizer = torch.optim.SGD(cm.parameters(), lr=0.0)
    profile = cm.profile(data, optimizer=optimizer, repeats=1, progress=False)
    over = []
    for option in profile.frontier(scope="step"):
        planned = profile.plan(option.predicted_peak_bytes, scope="step")
        cm.enable(planned)
        measured = step_peak_bytes(cm, data, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if measured > planned.predicted_peak_bytes:
            over.append(
                (planned.choices, planned.head, planned.head_chunk_tokens, measured - planned.predicted_peak_bytes)
            )
    assert not over, over


def test_a_head_of_four_counted_tokens_is_profiled():
    """`_head_sizes(4)` gave no chunk size, and the profile failed with an IndexError."""
    cm = CheckpointedModel(tiny_model(num_hidden_layers=2), CheckpointConfig(head="chunked"))
    data = batch(size=1, seq=5)  # 4 counted tokens (the labels shift by one)
    profile = cm.profile(data, repeats=1, progress=False)
    assert {(o.policy, o.chunk_tokens) for o in profile.measurements.head.choices()} >= {
        ("chunked", 4),
        ("plain", None),
    }


def test_labels_that_do_not_fit_the_tokens_are_refused_before_a_chunk_runs_and_the_next_step_runs():
    """Labels cut short or of floats failed inside a chunk's checkpoint (an IndexError on a mask's shape, "expected
    target dtype to be Long"), naming neither the labels nor the head."""
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(head="chunked", head_chunk_tokens=CHUNK))
    data, ran = batch(), []
    hook = cm.model.get_base_model().model.layers[0].register_forward_hook(lambda *_: ran.append(1))
    for labels in (data["labels"][:, :5], data["labels"].float()):
        with pytest.raises(ConfigError, match=r"head='chunked': the labels .* must be token ids, one per position"):
            cm(input_ids=data["input_ids"], labels=labels)
    hook.remove()
    assert not ran, "refused before any layer ran (a refused forward would owe its backward)"
    loss, _ = step_grads(cm, list(cm.model.named_parameters()), data)
    assert torch.isfinite(loss) and all(p.grad is not None for n, p in cm.model.named_parameters() if p.requires_grad)
