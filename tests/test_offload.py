"""The "offload" policy: exact, only the checkpoint inputs move, keep-last and the floor decided
while forward runs, the host budget, fallbacks, and abandoned steps.

The ordering and bookkeeping run through `remat.testing.SimulatedTransport`, which plays a device/host pair on
the CPU with real (so exact) copies and logs every copy in order. CUDA tests at the end run the
real streams and torch's pinned allocator where a GPU exists.
"""

import logging

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

import remat.transport as transport_module
from remat import CheckpointConfig, CheckpointedModel
from remat.model import controller_of
from remat.offload import KEPT_LAST, KEPT_ON_CPU, KEPT_SMALL, Offloader
from remat.testing import SimulatedTransport
from remat.transport import default_host_budget

LAYER_INPUT = 2 * 12 * 32 * 4  # batch x seq x hidden x fp32, the conftest defaults


def _wrapped(config, transport=None, lora=False, **model_kwargs):
    model = tiny_model(**model_kwargs)
    if lora:
        model = add_lora(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return model, named, CheckpointedModel(model, config, offload_transport=transport)


@pytest.mark.parametrize(
    "config, offloaded",
    [
        (CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), [0, 1, 2]),
        (CheckpointConfig(checkpoint_policy="offload", every_n_layers=2, offload_min_bytes=0), [0]),
        # layer 2 is the last checkpointed layer of forward, so its input stays on the device
        (
            CheckpointConfig(
                layer_policies={0: "offload", 1: "recompute", 2: "offload", 3: "none"}, offload_min_bytes=0
            ),
            [0],
        ),
    ],
    ids=["every-layer", "every-n-2", "layer-policies"],
)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_offloaded_gradients_equal_no_checkpointing(config, offloaded, lora):
    model = tiny_model()
    if lora:
        model = add_lora(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ref_loss, ref = step_grads(model, named, batch())
    transport = SimulatedTransport()
    cm = CheckpointedModel(model, config, offload_transport=transport)
    counter = RecomputeCounter(decoder_layers(model))
    loss, got = step_grads(cm, named, batch())
    assert counter.recomputed() == cm.checkpoint_map.checkpointed
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)
    moved = sorted({layer for op, layer in transport.log if op == "to_host"})
    assert moved == offloaded
    for layer in offloaded:  # each input crosses exactly once each way
        assert transport.log.count(("to_host", layer)) == 1 == transport.log.count(("to_device", layer))


def test_last_checkpointed_layer_of_forward_stays_and_backward_prefetches_in_order():
    transport = SimulatedTransport()
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport)
    order = []
    for i, layer in enumerate(decoder_layers(model)):
        next(iter(layer.children())).register_forward_pre_hook(lambda m, a, i=i: order.append(("run", i)))
    transport.log = order  # one timeline for copies and layer runs
    step_grads(cm, named, batch())
    forward, backward = order[:7], order[7:]
    # forward: layer i's input is copied out when layer i+1 starts, overlapping its compute
    assert forward == [("run", 0), ("to_host", 0), ("run", 1), ("to_host", 1), ("run", 2), ("to_host", 2), ("run", 3)]
    # backward: layer 3's input never left; each fetch is issued before the recompute that precedes its use
    assert backward == [
        ("to_device", 2),
        ("run", 3),
        ("to_device", 1),
        ("run", 2),
        ("to_device", 0),
        ("run", 1),
        ("run", 0),
    ]
    stats = cm.offload_stats
    assert stats[3].kept_because == {KEPT_LAST: LAYER_INPUT} and stats[3].offloaded_bytes == 0
    assert all(stats[i].offloaded_bytes == LAYER_INPUT and stats[i].kept_bytes == 0 for i in range(3))


def test_a_backward_prefetches_only_inputs_of_its_own_step_not_of_an_earlier_graph_still_alive():
    """The prefetch took the input packed just before, whichever graph it was in: a step's graph kept alive (by
    retain_graph, or a reference cycle not yet collected: a compiled step's, which made test_compile's counts
    depend on when the collector ran) had its input copied back to the device in the next step's backward, and held
    there with that graph."""
    config = CheckpointConfig(layer_policies={0: "offload", 1: "recompute"}, offload_min_bytes=0)
    _, named, cm = _wrapped(config, SimulatedTransport(), lora=True, num_hidden_layers=2)
    kept = cm(**batch()).loss
    kept.backward(retain_graph=True)
    cm(**batch()).loss.backward()
    assert (cm.offload_stats[0].copies_to_host, cm.offload_stats[0].copies_to_device) == (2, 2)
    kept.backward()  # its own graph still fetches its input again
    assert cm.offload_stats[0].copies_to_device == 3
    kept = cm(**batch()).loss  # a graph kept without a backward (an evaluation in training mode, kept outputs)
    cm(**batch()).loss.backward()
    assert (cm.offload_stats[0].copies_to_host, cm.offload_stats[0].copies_to_device) == (4, 4)


def test_a_graph_backpropagated_twice_counts_the_input_it_kept_once_and_never_moves_it_later():
    """backward(retain_graph=True) twice: the last layer's input, kept on the device as backward's first, was counted
    kept at each backward, and a forward while that graph lived copied it to the host then."""
    transport = SimulatedTransport()
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport)
    loss = cm(**batch()).loss
    loss.backward(retain_graph=True)
    loss.backward()
    assert cm.offload_stats[3].kept_because == {KEPT_LAST: LAYER_INPUT}
    cm(**batch(seed=1)).loss.backward()  # a forward while the first graph lives
    assert ("to_host", 3) not in transport.log
    assert cm.offload_stats[3].kept_because == {KEPT_LAST: 2 * LAYER_INPUT}
    del loss


def test_keep_last_follows_the_map_when_it_changes_between_steps():
    transport = SimulatedTransport()
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport)
    step_grads(cm, named, batch())
    cm.enable(cm.checkpoint_config.replace(every_n_layers=2))  # now layers 0 and 2; the last one is 2
    cm.reset_offload_stats()
    transport.log.clear()
    step_grads(cm, named, batch())
    assert transport.log == [("to_host", 0), ("to_device", 0)]
    assert cm.offload_stats[2].kept_because == {KEPT_LAST: LAYER_INPUT}
    cm.enable(cm.checkpoint_config.replace(every_n_layers=1, layer_policies={3: "recompute"}))
    cm.reset_offload_stats()
    transport.log.clear()
    step_grads(cm, named, batch())
    # Layer 3 recomputes from the device, so layer 2's input is no longer the first one needed.
    assert [layer for op, layer in transport.log if op == "to_host"] == [0, 1, 2]


def test_inputs_under_the_floor_stay_on_the_device():
    transport = SimulatedTransport()
    model, named, cm = _wrapped(
        CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=LAYER_INPUT + 1), transport
    )
    model_ref = tiny_model()
    _, ref = step_grads(model_ref, list(model_ref.named_parameters()), batch())
    _, got = step_grads(cm, named, batch())
    assert_same_grads(ref, got)
    assert transport.log == []
    assert all(cm.offload_stats[i].kept_because == {KEPT_SMALL: LAYER_INPUT} for i in range(4))
    cm.enable(cm.checkpoint_config.replace(offload_min_bytes=LAYER_INPUT))  # "under" the floor: one of it goes
    step_grads(cm, named, batch())
    assert {layer for op, layer in transport.log if op == "to_host"} == {0, 1, 2}


def test_each_steps_host_buffers_are_freed_with_its_graph():
    """Reusing pinned blocks from step to step is torch's caching allocator's job (see the CUDA
    test below): offload holds a host buffer only while the graph that needs it lives."""
    transport = SimulatedTransport()
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport)
    for steps in (1, 2):
        step_grads(cm, named, batch())
        assert transport.allocations == 3 * steps and transport.live_buffers() == 0
    assert controller_of(cm).offloader.host_buffers[0].pinned_bytes == 0


def test_host_memory_goes_back_to_the_system_when_nothing_offloads_any_more(caplog):
    """Checked through the transport that allocated the buffers (`live_buffers()` counts those
    still referenced anywhere, `live_when_emptied` how many were alive each time its cache was
    emptied); real pinned memory is checked by the CUDA test below."""
    transport = SimulatedTransport()
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport)
    step_grads(cm, named, batch())
    cm.model.gradient_checkpointing_disable()  # a toggle (generation): the cache stays for its return
    cm.model.gradient_checkpointing_enable()
    assert transport.cache_emptied == 0
    with caplog.at_level(logging.INFO, logger="remat"):
        cm.disable()
        cm.disable()
    assert transport.live_when_emptied == [0], "emptied once, with no buffer alive"
    assert "gave its pinned host memory back" in caplog.text
    cm.enable()
    _, got = step_grads(cm, named, batch())  # pins again on demand, and exact
    reference = tiny_model()
    _, expected = step_grads(reference, list(reference.named_parameters()), batch())
    assert_same_grads(expected, got)
    cm.enable(CheckpointConfig())  # still checkpointing, but nothing offloads
    assert transport.live_when_emptied == [0, 0]


def test_a_graph_that_outlives_disable_frees_its_buffers_when_backward_is_done():
    transport = SimulatedTransport()
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport)
    reference = tiny_model()
    _, expected = step_grads(reference, list(reference.named_parameters()), batch())
    torch.manual_seed(123)
    loss = cm(**batch()).loss
    buffers = controller_of(cm).offloader.host_buffers[0]
    cm.disable()  # three inputs are in host buffers, held by the graph
    assert buffers.pinned_bytes == 3 * LAYER_INPUT and transport.cache_emptied == 0
    loss.backward()
    assert_same_grads(expected, {n: p.grad for n, p in named})
    del loss
    assert buffers.pinned_bytes == 0 and transport.cache_emptied == 1  # once, at the last
    assert transport.live_buffers() == 0 and transport.live_when_emptied == [0]


def test_pinning_failure_falls_back_to_pageable_memory_with_one_warning(caplog):
    transport = SimulatedTransport(pin_fails=True)
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport)
    ref_model = tiny_model()
    _, ref = step_grads(ref_model, list(ref_model.named_parameters()), batch())
    with caplog.at_level(logging.WARNING, logger="remat"):
        _, got = step_grads(cm, named, batch())
        step_grads(cm, named, batch())
    assert_same_grads(ref, got)
    warnings = [r for r in caplog.records if "pageable" in r.getMessage()]
    assert len(warnings) == 1 and "pinning host memory failed" in warnings[0].getMessage()
    assert controller_of(cm).offloader.host_buffers[0].pageable_fallbacks == 6  # every input of both steps


def test_past_the_host_budget_inputs_go_to_pageable_memory_with_one_warning(caplog):
    """The budget bounds the pinned bytes held at once: two inputs fit, the third of each step is
    pageable, and the next step pins again what the last one freed."""
    transport = SimulatedTransport()
    reference = tiny_model()
    _, expected = step_grads(reference, list(reference.named_parameters()), batch())
    model = tiny_model()
    config = CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0)
    cm = CheckpointedModel(model, config, offload_transport=transport, offload_host_budget=2 * LAYER_INPUT)
    with caplog.at_level(logging.WARNING, logger="remat"):
        for _ in range(2):
            assert_same_grads(expected, step_grads(cm, list(model.named_parameters()), batch())[1])
    assert transport.allocations == 4 and controller_of(cm).offloader.host_buffers[0].pageable_fallbacks == 2
    assert [r.getMessage() for r in caplog.records if "budget" in r.getMessage()] == [
        f"offload: the host budget of {2 * LAYER_INPUT} bytes would be exceeded; using pageable host memory, so "
        "copies will not overlap compute"
    ]


def test_the_default_host_budget_is_shared_by_the_ranks_of_one_host(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = default_host_budget()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_host_budget() == alone // 4
    assert Offloader(0, SimulatedTransport()).host_buffers[0].max_bytes == alone // 4
    model, named, cm = _wrapped(
        CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), SimulatedTransport()
    )
    assert controller_of(cm).offloader.host_buffers[0].max_bytes == alone // 4
    cm2 = CheckpointedModel(tiny_model(), CheckpointConfig(checkpoint_policy="offload"), offload_host_budget=123)
    assert controller_of(cm2).offloader.max_host_bytes == 123


def test_a_forward_without_backward_returns_its_buffers():
    transport = SimulatedTransport()
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport)
    loss = cm(**batch()).loss
    offloader = controller_of(cm).offloader
    assert transport.live_buffers() == 3 and offloader.live_host_bytes() == dict.fromkeys(range(3), LAYER_INPUT)
    del loss
    assert transport.live_buffers() == 0 and offloader.live_host_bytes() == {}
    assert offloader.host_buffers[0].pinned_bytes == 0
    _, got = step_grads(cm, named, batch())  # the next step is unaffected
    ref_model = tiny_model()
    _, ref = step_grads(ref_model, list(ref_model.named_parameters()), batch())
    assert_same_grads(ref, got)


def test_an_exception_in_forward_returns_its_buffers():
    transport = SimulatedTransport()
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport)
    layer3 = decoder_layers(model)[3]

    def boom(module, args):
        raise RuntimeError("boom")

    handle = next(iter(layer3.children())).register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        cm(**batch())
    handle.remove()
    import gc

    gc.collect()
    assert transport.live_buffers() == 0 and controller_of(cm).offloader.live_host_bytes() == {}
    assert controller_of(cm).offloader.host_buffers[0].pinned_bytes == 0


def test_native_offload_request_becomes_this_policy_and_moves_each_input_once():
    transport = SimulatedTransport()
    model, named, cm = _wrapped(CheckpointConfig(offload_min_bytes=0), transport)
    model.gradient_checkpointing_enable(offload=True)
    assert cm.checkpoint_config.checkpoint_policy == "offload" and set(p.policy for p in cm.checkpoint_map) == {
        "offload"
    }
    step_grads(cm, named, batch())
    assert [op for op, _ in transport.log].count("to_host") == 3
    assert sorted(transport.log) == sorted({*transport.log})  # no input copied twice


class RecordingTransport(SimulatedTransport):
    """Keeps what crossed: the tensors sent to the host and the device tensors given back."""

    def __init__(self):
        super().__init__()
        self.sent, self.returned = {}, {}

    def to_host(self, src, dst, layer):
        self.sent[layer] = src  # the device tensor itself, to compare with what the layer received
        return super().to_host(src, dst, layer)

    def to_device(self, src, meta, layer):
        tensor, event = super().to_device(src, meta, layer)
        self.returned[layer] = tensor
        return tensor, event


def test_offload_is_exact_and_each_recompute_runs_on_the_input_that_crossed_the_transport(monkeypatch):
    """The device's own transport (what a wrapper built without `offload_transport` uses) played
    by a recording device/host pair on the CPU. Seen from the layers (hooks on their first norm,
    independent of remat): in forward, the tensor each offloaded layer received is the one sent to
    the host; in backward, its recompute runs on the tensor the transport brought back, with the
    same values; the gradients equal a run without checkpointing. Without offload nothing would
    cross and the recomputes would read the forward's own tensors."""
    transport = RecordingTransport()
    monkeypatch.setitem(transport_module._TRANSPORTS, torch.device("cpu"), transport)
    reference = tiny_model()
    _, expected = step_grads(reference, list(reference.named_parameters()), batch())
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0))
    seen = {i: [] for i in range(4)}
    for i, layer in enumerate(decoder_layers(model)):
        layer.input_layernorm.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[0]))
    assert_same_grads(expected, step_grads(cm, named, batch())[1])
    assert sorted(transport.sent) == sorted(transport.returned) == [0, 1, 2]
    for layer in (0, 1, 2):
        forward_input, recompute_input = seen[layer]
        assert forward_input.data_ptr() == transport.sent[layer].data_ptr()
        assert recompute_input.data_ptr() == transport.returned[layer].data_ptr() != forward_input.data_ptr()
        assert torch.equal(recompute_input, forward_input)
    assert seen[3][0].data_ptr() == seen[3][1].data_ptr(), "keep-last: layer 3 recomputes from the device copy"


def test_on_a_cpu_model_offload_keeps_the_inputs_and_says_why():
    """A model on the CPU has no device memory to free: the inputs stay, and the counters, the
    report and the summary say why (exactness where inputs cross: the tests above)."""
    model, named, cm = _wrapped(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0))
    step_grads(cm, named, batch())
    assert all(cm.offload_stats[i].kept_because == {KEPT_ON_CPU: LAYER_INPUT} for i in range(4))
    assert all(cm.offload_stats[i].offloaded_bytes == 0 for i in range(4))
    report = cm.memory_report(batch())
    assert report.host_bytes == 0 and "nothing is offloaded" in str(report)
    assert "the model runs on the CPU" in cm.summary()


def test_memory_report_and_summary_show_where_offloaded_inputs_live():
    transport = SimulatedTransport()
    model, named, cm = _wrapped(
        CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0), transport, attention_dropout=0.0
    )
    report = cm.memory_report(batch())
    assert [layer.host_bytes for layer in report.layers] == [LAYER_INPUT] * 3 + [0]
    assert [layer.device_bytes for layer in report.layers] == [0, 0, 0, LAYER_INPUT]
    recompute = CheckpointedModel(tiny_model(attention_dropout=0.0), CheckpointConfig()).memory_report(batch())
    assert report.device_bytes == recompute.device_bytes - 3 * LAYER_INPUT
    assert report.layers[0].offload.startswith("out ") and KEPT_LAST in report.layers[3].offload
    assert KEPT_LAST in str(report)
    assert cm.offload_stats == {}, "the report's step is not counted in the wrapper's sums"
    cm(**batch()).loss.backward()
    summary = cm.summary()
    assert "offloaded MiB" in summary and KEPT_LAST in summary


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("every_n", [1, 2])
def test_cuda_offload_is_exact(every_n):
    model = tiny_model(attention_dropout=0.0).cuda()
    named = list(model.named_parameters())
    data = {k: v.cuda() for k, v in batch().items()}
    _, ref = step_grads(model, named, data)
    cm = CheckpointedModel(
        model, CheckpointConfig(checkpoint_policy="offload", every_n_layers=every_n, offload_min_bytes=0)
    )
    for step in range(3):
        _, got = step_grads(cm, named, data)
        assert_same_grads(ref, got)
        if step == 0:
            pinned_blocks = torch.cuda.host_memory_stats()["num_host_alloc"]
    # torch's caching pinned allocator reuses the first step's blocks: the later steps pin nothing new
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == pinned_blocks
    assert controller_of(cm).offloader.host_buffers[0].pageable_fallbacks == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_lowers_device_memory_held_after_forward():
    def held(config):
        model = tiny_model(attention_dropout=0.0, num_hidden_layers=8, hidden_size=256, intermediate_size=512).cuda()
        cm = CheckpointedModel(model, config)
        data = {k: v.cuda() for k, v in batch(seq=512).items()}
        step_grads(cm, list(model.named_parameters()), data)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = cm(**data).loss
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        loss.backward()
        return after - before

    recompute = held(CheckpointConfig(offload_min_bytes=0))
    offload = held(CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0))
    layer_input = 2 * 512 * 256 * 4
    assert recompute - offload >= 6 * layer_input


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_disable_gives_the_pinned_memory_back_to_the_system():
    model = tiny_model(attention_dropout=0.0).cuda()
    cm = CheckpointedModel(model, CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0))
    data = {k: v.cuda() for k, v in batch().items()}
    torch.cuda.empty_cache()
    torch.accelerator.empty_host_cache()
    pinned_before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    step_grads(cm, list(model.named_parameters()), data)
    assert controller_of(cm).offloader.host_buffers[0].pinned_bytes == 0  # freed with the step's graph
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] >= pinned_before + 3 * LAYER_INPUT  # cached
    cm.disable()
    # dropping the tensors alone would leave the blocks cached (and pinned) in torch's allocator
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] <= pinned_before


@pytest.mark.parametrize("policy", ["none", "recompute", "offload"])
def test_a_layer_input_changed_in_place_after_it_was_saved_raises_as_without_checkpointing(policy):
    """torch raises at backward for a saved tensor changed in place; offload saved the input on the host, where the
    change is copied along, so the recompute read the changed input and the gradients were silently wrong."""
    model = tiny_model()
    config = CheckpointConfig(layer_policies={i: policy for i in range(4)}, offload_min_bytes=0)
    cm = CheckpointedModel(model, config, offload_transport=SimulatedTransport())

    def scale_the_input(module, args, output):
        with torch.no_grad():
            args[0].mul_(0.5)  # after the layer ran: its saved input is at another version

    handle = decoder_layers(model)[0].register_forward_hook(scale_the_input)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        cm(**batch()).loss.backward()
    handle.remove()
    reference = tiny_model()
    _, expected = step_grads(reference, list(reference.named_parameters()), batch())
    _, got = step_grads(cm, list(model.named_parameters()), batch())  # the next step is whole
    assert_same_grads(expected, got)


def test_the_default_host_budget_is_shared_by_the_wrappers_of_a_process(monkeypatch, caplog):
    """Each wrapper took the whole default: two offloading models could pin twice what the process was allowed."""
    monkeypatch.setattr(transport_module, "default_host_budget", lambda: 4 * LAYER_INPUT)
    monkeypatch.setattr("remat.offload.default_host_budget", lambda: 4 * LAYER_INPUT)
    transport = SimulatedTransport()
    config = CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0)
    first, second = (CheckpointedModel(tiny_model(), config, offload_transport=transport) for _ in range(2))
    with caplog.at_level(logging.WARNING, logger="remat"):
        held = first(**batch()).loss  # 3 inputs pinned (the last stays on the device), its graph alive
        second(**batch()).loss.backward()  # 1 more fits the default; 2 go pageable
        held.backward()
    buffers = controller_of(second).offloader.host_buffers[0]
    assert buffers.pageable_fallbacks == 2
    assert [r.getMessage() for r in caplog.records if "host budget" in r.getMessage()] == [
        f"offload: the host budget of {4 * LAYER_INPUT} bytes would be exceeded; using pageable host memory, so "
        "copies will not overlap compute"
    ]
    own = CheckpointedModel(tiny_model(), config, offload_transport=transport, offload_host_budget=3 * LAYER_INPUT)
    held = first(**batch()).loss
    own(**batch()).loss.backward()  # its own budget: not shared
    held.backward()
    assert controller_of(own).offloader.host_buffers[0].pageable_fallbacks == 0
