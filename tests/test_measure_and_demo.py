"""The activation-bytes measurement against hand-computed counts, and a demo smoke run."""

import subprocess
import sys

import pytest
from conftest import batch, tiny_model

from remat import CheckpointConfig, CheckpointedModel
from remat.measure import held_bytes_after, weight_storages
from remat.testing import measure_held_activations

B, S, H = 2, 16, 32
LAYER_INPUT = B * S * H * 4  # one fp32 layer input: batch x seq x hidden x 4 bytes


def _held(layers, every_n):
    model = tiny_model(num_hidden_layers=layers, attention_dropout=0.0)
    data = batch(size=B, seq=S)
    if every_n is None:
        return measure_held_activations(model, data)
    return measure_held_activations(CheckpointedModel(model, CheckpointConfig(every_n_layers=every_n)), data)


def test_checkpointing_every_layer_holds_one_layer_input_per_layer():
    held = [_held(n, 1) for n in (2, 3, 4)]
    assert held[1] - held[0] == LAYER_INPUT
    assert held[2] - held[1] == LAYER_INPUT


def test_every_second_layer_holds_a_full_layer_for_each_skipped_one():
    full_layer = _held(3, None) - _held(2, None)  # what one un-checkpointed layer keeps
    assert full_layer > 10 * LAYER_INPUT
    assert _held(3, 2) - _held(2, 2) == LAYER_INPUT  # layer 2 is checkpointed
    assert _held(4, 2) - _held(3, 2) == full_layer  # layer 3 is not


def test_the_demo_runs_end_to_end_and_prints_nothing_on_stderr():
    """`make demo` shows the map, the loss, the table and a sample; nothing a user would take for
    an error (one run of the demo checks both)."""
    command = [sys.executable, "-m", "remat.demo", "--steps", "2", "--repeats", "1", "--seq", "16", "--batch-size", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "base_model.model.model.layers.5" in out and "step   1  loss" in out
    for row in ("no checkpointing", "every layer", "every second layer"):
        assert row in out
    assert "sample:" in out
    assert done.stderr == ""


def test_third_party_import_noise_is_quieted_for_the_scripts(capfd):
    """What bitsandbytes logs at import on CPUs with AVX512-BF16 (this one may not have them)."""
    import logging

    from remat.demo import quiet_third_party_noise

    quiet_third_party_noise()
    logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
    assert "gemm_4bit_forward" not in capfd.readouterr().err


@pytest.mark.parametrize("every_n", [1, 2])
def test_measuring_leaves_gradients_equal_to_a_plain_step(every_n):
    from conftest import assert_same_grads, step_grads

    model = tiny_model(attention_dropout=0.0)
    named = list(model.named_parameters())
    data = batch()
    _, ref = step_grads(model, named, data)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=every_n))
    for _, p in named:
        p.grad = None
    loss, _ = held_bytes_after(lambda: cm(**data).loss, weight_storages(cm))
    loss.backward()
    assert_same_grads(ref, {n: p.grad for n, p in named})


def test_held_bytes_can_be_counted_on_one_device_only():
    """An offloaded input waits in host memory: a device count must not include it. Here the
    held tensors are on the CPU, so a count on another device sees none of them."""
    import torch

    weight = torch.randn(64, 64, requires_grad=True)
    forward = lambda: (torch.randn(8, 64) @ weight).tanh().sum()
    _, anywhere = held_bytes_after(forward, {weight.untyped_storage().data_ptr()})
    _, on_cpu = held_bytes_after(forward, {weight.untyped_storage().data_ptr()}, "cpu")
    _, on_meta = held_bytes_after(forward, {weight.untyped_storage().data_ptr()}, "meta")
    assert anywhere == on_cpu >= 8 * 64 * 4 and on_meta == 0
    from remat.measure import _on

    cuda1 = torch.device("cuda", 1)  # a tensor on it reports its index; "cuda" means any of them
    assert _on(cuda1, torch.device("cuda")) and not _on(cuda1, torch.device("cuda:0"))
