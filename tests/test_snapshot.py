"""`remat.snapshot`: the one "put modules back as they were" helper, used by the recompute shim
(a recompute leaves a layer as its forward did) and by the planner (measuring leaves the model
as it was). Judged by behaviour: counters, buffers, gradients and RNG after a step."""

import logging
import random

import numpy
import pytest
import torch
from conftest import batch, decoder_layers, tiny_model
from torch import nn

from remat import CheckpointConfig, CheckpointedModel
from remat.snapshot import Watched, model_left_as_it_was


def _counting(model):
    """Layer 1's MLP counts its calls three ways, as an MoE router or a step counter would: a
    plain int, a buffer written in place, and a buffer replaced by a new tensor each call."""
    mlp = decoder_layers(model)[1].mlp
    mlp.calls = 0
    mlp.register_buffer("seen", torch.zeros(1))
    mlp.register_buffer("cache", torch.zeros(1))

    def count(module, args):
        module.calls += 1
        module.seen += 1
        module._buffers["cache"] = module.cache + 1

    mlp.register_forward_pre_hook(count)
    return mlp


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recompute_leaves_the_layers_counters_and_buffers_as_its_forward_did(reentrant):
    plain = tiny_model(attention_dropout=0.0)
    expected = _counting(plain)
    plain(**batch()).loss.backward()
    model = tiny_model(attention_dropout=0.0)
    mlp = _counting(model)
    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=reentrant))
    cm(**batch()).loss.backward()
    assert cm.checkpoint_map[1].checkpointed
    assert (mlp.calls, mlp.seen.item(), mlp.cache.item()) == (expected.calls, expected.seen.item(), 1.0)
    replaced = mlp.cache
    cm(**batch()).loss.backward()  # the replaced buffer is followed: the second step counts from it
    assert (mlp.calls, mlp.seen.item(), mlp.cache.item()) == (2, 2.0, 2.0) and mlp.cache is not replaced


def test_a_snapshot_restores_what_changed_and_names_what_it_could_not():
    module = nn.Module()
    module.register_buffer("small", torch.zeros(4))
    module.register_buffer("large", torch.zeros(1024))
    module.steps = 3
    module.rate = 0.5
    module.flag = True  # a bool is a flag, not a counter
    watched = Watched([module])
    assert {e.name for e in watched.buffers} == {"small", "large"}
    assert {e.name for e in watched.numbers} == {"steps", "rate"}
    before = watched.snapshot(copy=True, copy_limit=64)
    untouched = module.small
    module.small += 1
    module.large += 1
    module.steps, module.rate = 4, 0.25
    assert {e.name for e in before.changed().buffers} == {"small", "large"}
    assert {e.name for e in before.changed().numbers} == {"steps", "rate"}
    assert before.restore() == ["large"]  # too large to copy: named, not restored
    assert module.small is untouched and module.small.sum().item() == 0 and module.large.sum().item() == 1024
    assert (module.steps, module.rate) == (3, 0.5)
    again = watched.snapshot(copy=True)
    versions = (module.small._version, module.large._version)
    assert not again.changed() and again.restore() == []
    assert (module.small._version, module.large._version) == versions, "nothing unchanged is written"


def test_python_and_numpy_rng_are_left_as_they_were_by_every_measuring_call():
    """Musicgen's LayerDrop draws from `random`, Wav2Vec2's SpecAugment from `numpy.random`: a profile, a memory report
    or a budget's first step left those streams advanced, so a seeded run diverged from the same run without remat."""
    model = tiny_model()
    drawn = []
    hook = lambda module, args: drawn.append((random.random(), numpy.random.rand()))
    decoder_layers(model)[1].register_forward_pre_hook(hook)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    for measure in (lambda: cm.memory_report(batch()), lambda: cm.profile(batch(), repeats=1)):
        states = random.getstate(), numpy.random.get_state()
        measure()
        assert drawn, "the layer drew while measuring"
        assert random.getstate() == states[0] and numpy.array_equal(numpy.random.get_state()[1], states[1][1])
        drawn.clear()
    twin, seeded = tiny_model(), []
    decoder_layers(twin)[1].register_forward_pre_hook(lambda module, args: seeded.append(random.random()))
    budgeted = CheckpointedModel(tiny_model(), budget="1GiB")
    decoder_layers(budgeted.model)[1].register_forward_pre_hook(lambda module, args: drawn.append(random.random()))
    for run, into in ((twin, seeded), (budgeted, drawn)):  # the budget's first step profiles first
        random.seed(0)
        run(**batch()).loss.backward()
        into.append(random.random())
    assert drawn[-2:] == seeded[-2:], "the step and what comes after draw as without remat"


def test_the_model_is_left_as_it_was_gradients_buffers_and_rng(caplog):
    model = nn.Linear(4, 4)
    model.register_buffer("count", torch.zeros(1))
    model.register_buffer("weights_kept_as_buffer", torch.zeros(64))
    marker = torch.ones(4, 4)
    model.weight.grad = marker
    rng = torch.random.get_rng_state()
    caplog.set_level(logging.WARNING, logger="remat")
    with model_left_as_it_was(model, copy_limit=16, what="a test"):
        assert model.weight.grad is None, "the body starts with no gradients"
        model(torch.randn(2, 4)).sum().backward()
        model.count += 1
        model.weights_kept_as_buffer += 1
    assert model.weight.grad is marker and model.bias.grad is None and model.count.item() == 0
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert "a test: buffer weights_kept_as_buffer changed while measuring and is too large to restore" in caplog.text
    with pytest.raises(RuntimeError, match="inside"), model_left_as_it_was(model, copy_limit=16, what="a test"):
        model.count += 1
        raise RuntimeError("inside")
    assert model.count.item() == 0 and model.weight.grad is marker
