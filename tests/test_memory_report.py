"""cm.memory_report(batch): figures checked against hand-computed byte counts and against a
count that shares no code with remat (`independent_memory.held_bytes`)."""

import pytest
from conftest import assert_same_grads, batch, step_grads, tiny_model
from independent_memory import held_bytes

from remat import CheckpointConfig, CheckpointedModel

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
    assert report.total_bytes == held_bytes(cm, batch(size=B, seq=S))


@pytest.mark.parametrize("policies", ["RNSR", "SSSS", "NNNN"])
def test_the_total_matches_an_independent_count_for_every_policy(policies):
    names = {"R": "recompute", "N": "none", "S": "selective"}
    model = tiny_model(attention_dropout=0.0)
    config = CheckpointConfig(layer_policies={i: names[c] for i, c in enumerate(policies)})
    cm = CheckpointedModel(model, config)
    data = batch(size=B, seq=S)
    report = cm.memory_report(data)
    cm.zero_grad(set_to_none=True)
    assert report.device_bytes == held_bytes(cm, data)


def test_one_more_checkpointed_layer_adds_one_layer_input_to_the_total():
    totals = [_report(1, num_hidden_layers=n)[1].total_bytes for n in (3, 4, 5)]
    assert totals[1] - totals[0] == totals[2] - totals[1] == LAYER_INPUT


def test_the_report_step_is_a_normal_training_step():
    model = tiny_model(attention_dropout=0.0)
    named = list(model.named_parameters())
    data = batch(size=B, seq=S)
    _, expected = step_grads(model, named, data)
    for _, p in named:
        p.grad = None
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    cm.memory_report(data)
    assert_same_grads(expected, {n: p.grad for n, p in named})


def test_table_and_refusal_outside_training():
    cm, report = _report(2)
    text = str(report)
    assert "held MiB (device)" in text and "outside layers" in text and "runs" in text
    assert "nothing is offloaded" in text
    cm.for_inference()
    with pytest.raises(RuntimeError, match="for_training"):
        cm.memory_report(batch())
