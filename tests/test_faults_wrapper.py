"""A wrapper is a real object: copies and pickles are independent, DataParallel replicas run
their replica, a dropped wrapper frees its host memory without a GC pass, and modes nest and
cannot be bypassed from below the root."""

import copy
import gc
import importlib
import io
import weakref

import pytest
import torch
from conftest import (
    RecomputeCounter,
    add_lora,
    assert_same_grads,
    batch,
    decoder_layers,
    step_grads,
    tiny_model,
)
from test_remote_code import blocks, load_remote

from remat import CheckpointConfig, CheckpointedModel
from remat.model import controller_of
from remat.testing import SimulatedTransport


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _reference_grads(seed=0, data=None):
    model = add_lora(tiny_model(seed=seed))
    return step_grads(model, _trainable(model), data or batch())[1]


# -- copies and pickles --------------------------------------------------------------------------


def test_a_deep_copy_runs_its_own_model_and_its_routes_change_its_own_map():
    config = CheckpointConfig(every_n_layers=2, checkpoint_policy="offload", offload_min_bytes=0)
    cm = CheckpointedModel(add_lora(tiny_model()), config, offload_transport=SimulatedTransport())
    twin = copy.deepcopy(cm)
    assert twin.model is not cm.model and twin.checkpoint_config == cm.checkpoint_config
    original, copied = RecomputeCounter(decoder_layers(cm.model)), RecomputeCounter(decoder_layers(twin.model))
    _, got = step_grads(twin, _trainable(twin.model), batch())
    assert original.counts == [0, 0, 0, 0] and copied.recomputed() == [0, 2]
    assert_same_grads(_reference_grads(), got)

    twin.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"every_n_layers": 3})
    assert twin.checkpoint_map.checkpointed == [0, 3] and cm.checkpoint_map.checkpointed == [0, 2]
    twin.disable()
    copied.reset()
    _, got = step_grads(cm, _trainable(cm.model), batch())
    assert original.recomputed() == [0, 2] and copied.counts == [0, 0, 0, 0]
    assert_same_grads(_reference_grads(), got)


@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_a_pickled_wrapper_loads_and_trains_exactly(head):
    """Also with the chunked head, whose per-family logit op was a closure pickle could not take."""
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2, head=head))
    buffer = io.BytesIO()
    torch.save(cm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    counter = RecomputeCounter(decoder_layers(loaded.model))
    _, got = step_grads(loaded, _trainable(loaded.model), batch())
    assert counter.recomputed() == [0, 2] == loaded.checkpoint_map.checkpointed
    assert loaded.checkpoint_map.head.policy == head
    assert_same_grads(_reference_grads(), got)
    loaded.model.gradient_checkpointing_disable()
    assert loaded.checkpoint_map.checkpointed == [] and cm.checkpoint_map.checkpointed == [0, 2]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copying_a_wrapper_that_swaps_is_refused_before_anything_is_copied(how):
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(swap_layers=[1]))
    with pytest.raises(TypeError, match=r"block swap keeps the frozen weights of layer 1"):
        copy.deepcopy(cm) if how == "deepcopy" else torch.save(cm, io.BytesIO())
    assert_same_grads(_reference_grads(), step_grads(cm, _trainable(cm.model), batch())[1])


# -- nn.DataParallel -----------------------------------------------------------------------------


def _replicate(module, replicas, monkeypatch):
    """torch's own nn.DataParallel replication, with the GPU broadcast it starts with played on
    the CPU: replica j gets every parameter multiplied by j + 1 (buffers unchanged)."""
    replicate_module = importlib.import_module("torch.nn.parallel.replicate")  # the name is also a function
    calls = []

    def broadcast(tensors, devices, detach=False):
        calls.append(None)
        scale = len(calls) == 1  # the first call carries the parameters
        return [[t * (j + 1) if scale else t.clone() for t in tensors] for j in range(len(devices))]

    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape", broadcast)
    return replicate_module.replicate(module, list(range(replicas)))


def test_each_data_parallel_replica_runs_its_own_replica(tmp_path, monkeypatch):
    """Plain remote-code blocks (their forward is wrapped on the instance) and the wrapper's own
    forward: each replica's output is that of a model with its parameters."""
    model = load_remote(tmp_path, dropout=0.0)
    data = batch()
    expected = []
    for scale in (1, 2):
        scaled = copy.deepcopy(model)
        with torch.no_grad():
            for p in scaled.parameters():
                p.mul_(scale)
        expected.append(scaled(**data).logits)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    counter = RecomputeCounter(blocks(model))
    outputs = [replica(**data) for replica in _replicate(cm, 2, monkeypatch)]
    for output, logits in zip(outputs, expected, strict=True):
        torch.testing.assert_close(output.logits, logits, rtol=1e-5, atol=1e-6)
    sum(o.loss for o in outputs).backward()
    assert counter.counts == [4, 4, 4, 4], "each block ran (and was recomputed) once per replica"


def test_data_parallel_replication_with_block_swap_is_refused(monkeypatch):
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(swap_layers=[1]))
    with pytest.raises(RuntimeError, match=r"nn\.DataParallel.*DistributedDataParallel"):
        _replicate(cm, 2, monkeypatch)


# -- host memory ---------------------------------------------------------------------------------


def _swap_and_offload(model):
    """A wrapper that offloaded and swapped in a step: the offloaded inputs' host buffers went with
    the step's graph, the swapped weights' host copies are the wrapper's to free."""
    transport = SimulatedTransport()
    config = CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0, swap_layers=[1])
    cm = CheckpointedModel(model, config, offload_transport=transport)
    step_grads(cm, _trainable(model), batch())
    assert transport.allocations > 0 and transport.live_buffers() == 0
    host = [weakref.ref(t) for t in controller_of(cm).swapper.layers[1].host]
    assert len(host) > 1
    return cm, model, host


@pytest.mark.parametrize("blocks", ["transformers layers", "plain remote-code blocks"])
def test_a_dropped_wrapper_frees_its_host_memory_without_a_gc_pass(tmp_path, blocks):
    def build():
        if blocks == "transformers layers":
            return add_lora(tiny_model())
        from peft import LoraConfig, get_peft_model

        return get_peft_model(load_remote(tmp_path), LoraConfig(r=4, target_modules=["q_proj"]))

    build()  # transformers keeps a reference to the first model of a kind it builds
    gc.collect()
    gc.disable()
    try:
        cm, model, host = _swap_and_offload(build())
        del cm, model
        assert [r() for r in host] == [None] * len(host)

        cm, model, host = _swap_and_offload(build())
        state = weakref.ref(controller_of(cm))
        cm.disable()
        assert [r() for r in host] == [None] * len(host), "disable() gives the host memory back"
        del cm
        assert state() is None, "nothing of remat's stays alive with the model"
    finally:
        gc.enable()


def test_a_model_whose_wrapper_was_dropped_keeps_its_map():
    model = add_lora(tiny_model())
    CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    gc.collect()
    counter = RecomputeCounter(decoder_layers(model))
    _, got = step_grads(model, _trainable(model), batch())
    assert counter.recomputed() == [0, 2]
    assert_same_grads(_reference_grads(), got)


# -- modes ---------------------------------------------------------------------------------------


def test_nested_for_inference_blocks_restore_the_outer_mode_each_module_included():
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    embed = cm.model.get_input_embeddings()
    embed.eval()  # a module the user keeps in eval mode
    with cm.for_inference():
        with cm.for_inference():
            assert not cm.model.training
        assert not cm.model.training and not cm.model.is_gradient_checkpointing
        with cm.for_training():
            assert cm.model.training and cm.model.is_gradient_checkpointing
        assert not cm.model.training and not cm.model.is_gradient_checkpointing
    assert cm.model.training and cm.model.is_gradient_checkpointing and not embed.training
    counter = RecomputeCounter(decoder_layers(cm.model))
    cm.model.train()
    _, got = step_grads(cm, _trainable(cm.model), batch())
    assert counter.recomputed() == [0, 2]
    assert_same_grads(_reference_grads(), got)


def test_a_submodule_put_back_into_training_during_inference_trains_with_the_map():
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2, swap_layers=[1]))
    cm.for_inference()
    cm.model.base_model.model.model.train()  # below the root: the root stays in eval mode
    counter = RecomputeCounter(decoder_layers(cm.model))
    _, got = step_grads(cm, _trainable(cm.model), batch())
    assert counter.recomputed() == [0, 1, 2]
    assert_same_grads(_reference_grads(), got)


def test_a_layer_run_directly_in_training_during_inference_is_refused():
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    cm.for_inference()
    layer = cm.layers[0]
    layer.train()
    hidden = torch.randn(2, 5, 32, requires_grad=True)
    position = torch.arange(5).unsqueeze(0)
    embeddings = cm.model.base_model.model.model.rotary_emb(hidden, position)
    with pytest.raises(RuntimeError, match=r"layer 0 .* inference mode"):
        layer(hidden, position_embeddings=embeddings, position_ids=position)
    layer.eval()
    with torch.no_grad():
        layer(hidden, position_embeddings=embeddings, position_ids=position)


def test_a_copy_of_the_wrapped_model_alone_can_be_wrapped_again():
    """TRL's reference models and EMA copies deep-copy the model, not the wrapper: the copy keeps
    its map until a new wrapper takes it over."""
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2))
    twin = copy.deepcopy(cm.model)
    counter = RecomputeCounter(decoder_layers(twin))
    step_grads(twin, _trainable(twin), batch())
    assert counter.recomputed() == [0, 2]
    with pytest.raises(ValueError, match="already wrapped"):
        CheckpointedModel(cm.model)
    again = CheckpointedModel(twin, CheckpointConfig(every_n_layers=3))
    counter.reset()
    _, got = step_grads(again, _trainable(twin), batch())
    assert counter.recomputed() == [0, 3] and cm.checkpoint_map.checkpointed == [0, 2]
    assert_same_grads(_reference_grads(), got)


@pytest.mark.parametrize("route_off", [False, True], ids=["on", "off by a route"])
def test_a_refused_takeover_leaves_the_dropped_wrappers_map_on_the_model(route_off):
    """A new wrapper takes over from a dropped one by first undoing it; when the new map is then
    refused (a layer it would swap holds weights a pending backward needs), the old map is back,
    on or off as a route left it."""
    model = add_lora(tiny_model())
    CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    gc.collect()
    if route_off:
        model.gradient_checkpointing_disable()  # as TRL does before generating
    loss = model(**batch()).loss  # layer 1 runs without checkpointing: the graph holds its weights
    with pytest.raises(RuntimeError, match="held by an autograd graph"):
        CheckpointedModel(model, CheckpointConfig(every_n_layers=2, swap_layers=[1]))
    loss.backward()
    model.zero_grad(set_to_none=True)
    if route_off:
        counter = RecomputeCounter(decoder_layers(model))
        step_grads(model, _trainable(model), batch())
        assert counter.recomputed() == [], "still off, as the route left it"
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing_enable()
    counter = RecomputeCounter(decoder_layers(model))
    _, got = step_grads(model, _trainable(model), batch())
    assert counter.recomputed() == [0, 2], "the dropped wrapper's map still runs"
    assert_same_grads(_reference_grads(), got)
