"""cm.memory_report(batch): figures checked against hand-computed byte counts and against a
count that shares no code and no method with remat (`independent_memory.held_bytes`, the
allocator's, and the parameters' and buffers' own sizes); the report leaves gradients
(accumulated ones), counters, RNG and buffers as they were, in a real Trainer callback too."""

import copy

import pytest
import torch
from conftest import add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model
from independent_memory import held_bytes, remat_blind_spots
from transformers import TrainerCallback, TrainingArguments

from remat import CheckpointConfig, CheckpointedModel, RematTrainer
from remat.model import controller_of
from remat.report import memory_report
from remat.swap import LayerSwapStats
from remat.testing import SimulatedTransport

B, S, H = 2, 16, 32
LAYER_INPUT = B * S * H * 4  # batch x seq x hidden x 4 bytes (fp32)


def _report(every_n, **model_kwargs):
    model = tiny_model(attention_dropout=0.0, **model_kwargs)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=every_n))
    return cm, cm.memory_report(batch(size=B, seq=S))


def test_every_layer_checkpointed_holds_exactly_one_layer_input_per_layer():
    _, report = _report(1)
    assert [layer.device_bytes for layer in report.layers] == [LAYER_INPUT] * 4
    assert [layer.runs for layer in report.layers] == [2, 2, 2, 2]
    assert report.host_bytes == 0
    assert report.device == "cpu"


def test_weights_are_the_layers_parameter_bytes():
    cm, report = _report(1)
    per_layer = sum(p.numel() * 4 for p in cm.layers[0].parameters())
    assert [layer.weight_bytes for layer in report.layers] == [per_layer] * 4


def test_every_second_layer_and_the_total_match_the_independent_measurement():
    cm, report = _report(2)
    layers = report.layers
    assert [layer.runs for layer in layers] == [2, 1, 2, 1]
    assert layers[0].device_bytes == layers[2].device_bytes == LAYER_INPUT
    assert layers[1].device_bytes == layers[3].device_bytes > 10 * LAYER_INPUT
    assert [layer.policy for layer in layers] == ["recompute", "none", "recompute", "none"]
    assert held_bytes(cm, batch(size=B, seq=S)) == report.total_bytes + remat_blind_spots(cm)


@pytest.mark.parametrize("policies", ["RNSR", "SSSS", "NNNN"])
def test_the_total_matches_an_independent_count_for_every_policy(policies):
    names = {"R": "recompute", "N": "none", "S": "selective"}
    model = tiny_model(attention_dropout=0.0)
    config = CheckpointConfig(layer_policies={i: names[c] for i, c in enumerate(policies)})
    cm = CheckpointedModel(model, config)
    data = batch(size=B, seq=S)
    report = cm.memory_report(data)
    cm.zero_grad(set_to_none=True)
    assert held_bytes(cm, data) == report.device_bytes + remat_blind_spots(cm)


def test_one_more_checkpointed_layer_adds_one_layer_input_to_the_total():
    totals = [_report(1, num_hidden_layers=n)[1].total_bytes for n in (3, 4, 5)]
    assert totals[1] - totals[0] == totals[2] - totals[1] == LAYER_INPUT


def test_the_report_step_is_a_normal_training_step_and_the_report_leaves_no_gradient():
    model = tiny_model(attention_dropout=0.0)
    named = list(model.named_parameters())
    data = batch(size=B, seq=S)
    _, expected = step_grads(model, named, data)
    for _, p in named:
        p.grad = None
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    cm.memory_report(data)
    assert all(p.grad is None for _, p in named), "cm.memory_report leaves the gradients as they were"
    memory_report(controller_of(cm), data)  # the step the planner measures keeps its gradients
    assert_same_grads(expected, {n: p.grad for n, p in named})


def _micro_batches():
    return [batch(seed=seed, size=B, seq=S) for seed in (1, 2)]


def _accumulate(cm, named, report_between):
    """Two micro-batches of gradient accumulation, with a report between them if asked; returns
    the gradients after the first, after the report, and after the second."""
    for _, p in named:
        p.grad = None
    first, second = _micro_batches()
    torch.manual_seed(5)
    cm(**first).loss.backward()
    after_first = {n: p.grad.clone() for n, p in named}
    if report_between:
        cm.memory_report(batch(seed=9, size=B, seq=S))
    after_report = {n: p.grad.clone() for n, p in named}
    cm(**second).loss.backward()
    return after_first, after_report, {n: p.grad.clone() for n, p in named}


def test_a_report_between_two_micro_batches_leaves_the_accumulated_gradients_bitwise():
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    named = [(n, p) for n, p in cm.model.named_parameters() if p.requires_grad]
    after_first, after_report, final = _accumulate(cm, named, report_between=True)
    _, _, without = _accumulate(cm, named, report_between=False)
    for name, grad in after_first.items():
        assert torch.equal(after_report[name], grad), name
        assert torch.equal(final[name], without[name]), name  # dropout too: the RNG was put back


def test_a_report_leaves_offload_and_swap_counters_rng_buffers_and_modes_as_they_were():
    config = CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0, swap_layers=[1])
    cm = CheckpointedModel(add_lora(tiny_model()), config, offload_transport=SimulatedTransport())
    cm(**batch()).loss.backward()  # a training step: counters to keep
    cm.zero_grad(set_to_none=True)
    offload = copy.deepcopy(cm.offload_stats)
    swap = {i: copy.copy(s) for i, s in cm.swap_stats.items()}
    assert any(s.offloaded_bytes or s.kept_because for s in offload.values()) and swap[1].fetches == 2
    mlp = decoder_layers(cm.model)[2].mlp  # counts its calls, as an MoE router counts tokens
    mlp.calls = 0
    mlp.register_buffer("seen", torch.zeros(1))

    def count(module, args):
        module.calls += 1
        module.seen += 1

    handle = mlp.register_forward_pre_hook(count)
    cm.model.base_model.model.lm_head.eval()  # a module in eval mode while training
    modes = [m.training for m in cm.model.modules()]
    rng = torch.random.get_rng_state()
    report = cm.memory_report(batch(seed=3))
    handle.remove()
    assert report.layers[1].weight_fetches == 2, "the report counted its own step"
    assert cm.offload_stats == offload, "offload_stats stay sums since the wrapper was made"
    assert cm.swap_stats == swap
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert mlp.calls == 0 and mlp.seen.item() == 0
    assert [m.training for m in cm.model.modules()] == modes
    assert all(p.grad is None for p in cm.parameters())


def test_the_offload_and_swap_counters_each_have_a_reset():
    """On the CPU, with the devices' own transports: swap fetches, offload says why it kept each
    input; each reset starts its counts from zero and leaves the other's."""
    config = CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0, swap_layers=[1])
    cm = CheckpointedModel(add_lora(tiny_model()), config)
    cm(**batch()).loss.backward()
    assert cm.swap_stats[1].fetches == 2 and all(cm.offload_stats[i].kept_bytes > 0 for i in range(4))
    offload = copy.deepcopy(cm.offload_stats)
    cm.reset_swap_stats()
    assert cm.swap_stats[1] == LayerSwapStats() and cm.offload_stats == offload
    cm(**batch()).loss.backward()
    assert cm.swap_stats[1].fetches == 2 and cm.swap_stats[1].bytes_fetched > 0
    swap = copy.deepcopy(cm.swap_stats)
    cm.reset_offload_stats()
    assert cm.offload_stats == {} and cm.swap_stats == swap


class _ReportEveryStep(TrainerCallback):
    def __init__(self, cm):
        self.cm, self.reports = cm, 0

    def _report(self):
        self.cm.memory_report(batch(seed=11, size=1, seq=S))
        self.reports += 1

    def on_substep_end(self, args, state, control, **kwargs):
        self._report()  # between the two micro-batches of an accumulation

    def on_step_end(self, args, state, control, **kwargs):
        self._report()  # after the optimizer step and zero_grad, before the next accumulation


def _train(tmp_path, with_reports):
    cm = CheckpointedModel(add_lora(tiny_model(seed=4)), CheckpointConfig(every_n_layers=2))
    rows = [{k: v[0] for k, v in batch(seed=seed, size=1, seq=S).items()} for seed in range(4)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=7,
        data_seed=7,
    )
    callback = _ReportEveryStep(cm)
    RematTrainer(model=cm, args=args, train_dataset=rows, callbacks=[callback] if with_reports else []).train()
    return {n: p.detach().clone() for n, p in cm.model.named_parameters()}, callback.reports


def test_the_counters_read_before_a_step_stay_as_they_were_read():
    """`offload_stats` and `swap_stats` held the live counters: a `before` taken for one step's own counts grew
    with that step (16384 -> 32768 bytes), and the difference came out zero."""
    config = CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0, swap_layers=[1])
    cm = CheckpointedModel(add_lora(tiny_model()), config)
    cm(**batch()).loss.backward()
    offload, swap = cm.offload_stats, cm.swap_stats
    kept, fetches = offload[0].kept_bytes, swap[1].fetches
    cm(**batch()).loss.backward()
    assert (offload[0].kept_bytes, swap[1].fetches) == (kept, fetches)
    assert (cm.offload_stats[0].kept_bytes, cm.swap_stats[1].fetches) == (2 * kept, 2 * fetches)


def test_reports_in_a_trainer_callback_leave_the_trained_weights_bitwise(tmp_path):
    reported, reports = _train(tmp_path / "a", with_reports=True)
    plain, _ = _train(tmp_path / "b", with_reports=False)
    assert reports == 4  # one substep and one step end per optimizer step
    for name, value in plain.items():
        assert torch.equal(reported[name], value), name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_weights_total_counts_every_parameter_and_buffer_once(tied):
    model = tiny_model(tie_word_embeddings=tied)
    cm = CheckpointedModel(model, CheckpointConfig())
    report = cm.memory_report(batch())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert report.weight_bytes == params + buffers
    in_layers = {id(p) for layer in decoder_layers(model) for p in (*layer.parameters(), *layer.buffers())}
    outside = [t for t in (*model.parameters(), *model.buffers()) if id(t) not in in_layers]
    assert report.outside_weight_bytes == sum(t.numel() * t.element_size() for t in outside)
    embeddings = model.get_input_embeddings().weight
    assert report.outside_weight_bytes >= embeddings.numel() * embeddings.element_size()
    text = str(report)
    assert "total (whole model)" in text and "every parameter and buffer" in text


def test_table_and_refusal_outside_training():
    cm, report = _report(2)
    text = str(report)
    assert "held MiB (device)" in text and "outside layers" in text and "runs" in text
    assert "nothing is offloaded" in text
    cm.for_inference()
    with pytest.raises(RuntimeError, match="for_training"):
        cm.memory_report(batch())
