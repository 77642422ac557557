"""Frozen weights that are tensor subclasses (torchao's and optimum-quanto's quantized weights: helper-88's trial),
here torch's own wrapper subclass `TwoTensor` (two plain tensors inside, as a quantized weight holds its data and
scales). Its storage is a stand-in with no data pointer, and `param.data = ...` leaves its tensors in place."""

import pytest
import torch
from conftest import add_lora, batch, hook_snapshot, tiny_model
from torch.testing._internal.two_tensor import TwoTensor

from remat import BlockSwapError, CheckpointedModel


def _with_a_subclass_weight(layer: int = 1):
    """LoRA's model with layer `layer`'s frozen up_proj weight a TwoTensor of two copies of itself."""
    model = add_lora(tiny_model(), dropout=0.0)
    linear = model.base_model.model.model.layers[layer].mlp.up_proj
    weight = linear.weight.detach()
    linear.weight = torch.nn.Parameter(TwoTensor(weight.clone(), weight.clone()), requires_grad=False)
    return model, weight.nbytes


def test_memory_report_counts_the_tensors_inside_a_subclass_weight_and_leaves_no_hook():
    """Before: the weights' storage pointers raised ("invalid python storage") in memory_report, profile and every
    budget step, and each failed report left its 24 measuring hooks on the model."""
    plain = CheckpointedModel(add_lora(tiny_model(), dropout=0.0), every_n_layers=1).memory_report(batch())
    model, extra = _with_a_subclass_weight()
    cm = CheckpointedModel(model, every_n_layers=1)
    hooks = hook_snapshot(model)
    report = cm.memory_report(batch())
    weights = [row.weight_bytes for row in plain.layers]
    weights[1] += extra  # the second tensor inside
    assert [row.weight_bytes for row in report.layers] == weights
    assert report.weight_bytes == plain.weight_bytes + extra
    assert hook_snapshot(model) == hooks


def test_block_swap_of_a_subclass_weight_is_refused_before_anything_moves():
    """Before: accepted, the map saying "swapped" while `param.data = placeholder` left the weight where it was (a
    silent no-op for optimum-quanto; torchao's failed at the first forward, deep in its copy)."""
    model, _ = _with_a_subclass_weight(layer=1)
    inside = {n: (p.a.data_ptr(), p.b.data_ptr()) for n, p in model.named_parameters() if isinstance(p, TwoTensor)}
    for swap in ([1], [0, 1], 4):
        with pytest.raises(BlockSwapError, match=r"layer 1 .*up_proj.*TwoTensor.*leave this layer out of swap_layers"):
            CheckpointedModel(model, swap_layers=swap)
        assert {n: (p.a.data_ptr(), p.b.data_ptr()) for n, p in model.named_parameters() if n in inside} == inside
    cm = CheckpointedModel(model, swap_layers=[0, 2])  # the others still swap
    assert [row.swapped for row in cm.checkpoint_map] == [True, False, True, False]


def test_a_memory_report_that_fails_before_its_step_leaves_no_measuring_hook(monkeypatch):
    """Any fault while the report set up (here: reading the weights' storages) left its measuring hooks on every
    layer and submodule, run by each later forward, piling up a list of weak references each."""
    import remat.report

    cm = CheckpointedModel(add_lora(tiny_model()), every_n_layers=1)
    hooks = hook_snapshot(cm.model)
    monkeypatch.setattr(remat.report, "weight_storages", lambda module: (_ for _ in ()).throw(RuntimeError("read")))
    with pytest.raises(RuntimeError, match="read"):
        cm.memory_report(batch())
    assert hook_snapshot(cm.model) == hooks
