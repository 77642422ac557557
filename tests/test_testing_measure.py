"""`remat.testing.measure_held_activations` and `measure_step_peak`: a user's own check of a
plan's bytes on a LoRA model (where torch's `MemTracker` alone fails), agreeing with the plan's
prediction and with the suite's independent counts (tests/independent_memory.py)."""

import torch
from conftest import add_lora, batch, tiny_model
from independent_memory import held_bytes, remat_blind_spots, step_peak_bytes

from remat import CheckpointedModel
from remat.testing import measure_held_activations, measure_step_peak


def test_a_plans_bytes_checked_with_the_public_helpers_on_a_lora_model():
    cm = CheckpointedModel(add_lora(tiny_model(num_hidden_layers=2), dropout=0.0))
    data = batch(size=1)
    optimizer = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=1e-4)
    profile = cm.profile(data, optimizer=optimizer, progress=False)
    options = profile.frontier(scope="step")
    assert len(options) >= 2
    before = {n: p.detach().clone() for n, p in cm.named_parameters() if not p.requires_grad}
    planned = profile.plan(options[0].planned_budget, scope="step")  # every layer recomputed: the least
    cm.enable(planned)
    peak = measure_step_peak(cm, data, optimizer)
    assert abs(peak - planned.predicted_peak_bytes) <= 0.01 * planned.predicted_peak_bytes
    held = measure_held_activations(cm, data)
    assert abs(held - planned.predicted_device_bytes) <= 0.05 * planned.predicted_device_bytes
    # the allocator's count agrees, with what no dispatch mode sees: Python scalars autograd saves
    # per layer (eager attention's scaling, and LoRA's on q_proj, v_proj, down_proj) and RNG states
    assert held + remat_blind_spots(cm, saved_scalars_per_layer=4) == held_bytes(cm, data)
    assert all(torch.equal(p, before[n]) for n, p in cm.named_parameters() if not p.requires_grad)
    assert all(p.grad is None for p in cm.parameters())


def test_the_step_peak_of_a_fresh_optimizer_is_that_of_a_later_step():
    """remat predicts a step after the first (the optimizer's state made); the helper makes the
    state first, uncounted, so a fresh optimizer gives the same count as a used one."""
    cm = CheckpointedModel(add_lora(tiny_model(num_hidden_layers=2), dropout=0.0))
    data = batch(size=1)
    fresh = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=1e-4)
    first = measure_step_peak(cm, data, fresh)
    assert fresh.state, "the optimizer made its state"
    assert first == step_peak_bytes(cm, data, fresh)  # the suite's MemTracker count of a later step
