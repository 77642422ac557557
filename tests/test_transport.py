"""The one host<->device transport: offload and block swap both go through the device's
transport, and the test doubles stay out of the library. The streamed transport's waits are
checked on an accelerator played on the CPU (`emulated_streams`), under many completion orders;
CUDA tests at the end run the real streams where a GPU exists."""

import ast
import logging
from pathlib import Path

import pytest
import torch
from conftest import add_lora, assert_same_grads, batch, step_grads, tiny_model
from emulated_streams import FakeStreams

import remat.transport as transport_module
from remat import CheckpointConfig, CheckpointedModel
from remat.model import controller_of
from remat.offload import HostBuffers
from remat.testing import SimulatedTransport
from remat.transport import (
    AcceleratorTransport,
    CpuTransport,
    CudaTransport,
    NoTransport,
    StreamTransport,
    TensorMeta,
    transport_for,
)

SOURCE = Path(__file__).resolve().parents[1] / "src" / "remat"


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def test_each_device_has_one_transport_in_the_process():
    cpu = torch.device("cpu")
    assert transport_for(cpu) is transport_for(torch.device("cpu"))
    assert isinstance(transport_for(cpu), CpuTransport)
    assert not transport_for(cpu).handles(torch.zeros(1)), "on the CPU, offload has no device memory to free"


def test_offload_and_swap_of_a_default_wrapper_share_the_devices_transport(monkeypatch):
    """The device's transport replaced by a simulated device/host pair: a wrapper built with
    no transport of its own sends offloaded inputs and swapped weights through that one object."""
    shared = SimulatedTransport()
    monkeypatch.setitem(transport_module._TRANSPORTS, torch.device("cpu"), shared)
    reference = add_lora(tiny_model())
    _, expected = step_grads(reference, _trainable(reference), batch())
    model = add_lora(tiny_model())
    config = CheckpointConfig(every_n_layers=2, swap_layers=[1, 3], checkpoint_policy="offload", offload_min_bytes=0)
    cm = CheckpointedModel(model, config)
    _, got = step_grads(cm, _trainable(model), batch())
    assert_same_grads(expected, got)
    controller = controller_of(cm)
    assert all(layer.mover is shared for layer in controller.swapper.layers.values())
    assert [route.transport for route in controller.offloader._routes.values()] == [shared]
    ops = [op for op, _ in shared.log]
    # layers 0..3 are all checkpointed (1 and 3 because they are swapped); 3's input stays (keep-last)
    assert ops.count("to_host") == 3 == ops.count("to_device")
    # each swapped layer's weights are fetched in forward and again for its recompute
    per_layer = len(controller.swapper.layers[1].params)
    assert ops.count("fetch") == 2 * 2 * per_layer


def test_the_test_doubles_live_in_remat_testing_and_the_library_never_imports_them():
    importers = []
    for path in SOURCE.rglob("*.py"):
        if path.name == "testing.py" and path.parent == SOURCE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                targets = {module} | {f"{module}.{alias.name}".lstrip(".") for alias in node.names}
                relative = node.level > 0 and any(t.split(".")[0] == "testing" for t in targets)
                if relative or "remat.testing" in targets:
                    importers.append(str(path.relative_to(SOURCE)))
            elif isinstance(node, ast.Import) and any(alias.name == "remat.testing" for alias in node.names):
                importers.append(str(path.relative_to(SOURCE)))
    assert importers == []


def _emulate_accelerator(monkeypatch, kind="xpu"):
    """torch believes `kind` is this machine's accelerator (as compressed-tensors' tests emulate an XPU)."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device(kind))
    monkeypatch.setattr(transport_module, "_TRANSPORTS", {})


def test_each_copy_waits_for_what_it_reads_and_keeps_what_it_frees():
    """The calls each copy makes, in order: the copy to the host waits for the compute stream that wrote its source
    and keeps that memory from reuse until the copy is done; the copy back waits for the copy to the host; a weight
    fetch waits for the compute stream's use of the slot before it."""
    fake = FakeStreams(seed=0)
    transport = AcceleratorTransport(torch.device("cpu"), fake)
    src = torch.randn(4, 8)
    with fake:  # the emulated device pins
        host = transport.allocate_host(src.nbytes)
    meta = TensorMeta(src.shape, src.dtype, src.device, src.nbytes)

    def calls(copy):
        fake.log.clear()
        with fake:
            result = copy()
        return fake.log, result

    assert calls(lambda: transport.to_host(src, host, 0))[0] == [
        "side1 wait_stream compute",
        "record_stream side1",
        "record side1",
    ]
    log, (back, event) = calls(lambda: transport.to_device(host, meta, 0))
    assert log == ["side2 wait_stream side1", "record_stream compute", "record side2"]
    with fake:
        event.wait()
    assert torch.equal(back, src)
    slot = torch.empty(4, 8)
    assert calls(lambda: transport.fetch(slot, src))[0] == ["side2 wait_stream compute", "record side2"]


def test_the_emulated_streams_see_a_copy_read_before_its_event():
    """The checker the next test relies on: reading a copy's result without waiting for its event is a race, and the
    reader sees poison; after the wait, neither."""
    fake = FakeStreams(seed=0, progress=0.0)
    transport = AcceleratorTransport(torch.device("cpu"), fake)
    src = torch.randn(4, 8)
    slot = torch.empty(4, 8)
    with fake:
        event = transport.fetch(slot, src)
        early = slot.sum()
    assert torch.isnan(early) and fake.races and "aten.sum" in fake.races[0]
    fake.races.clear()
    with fake:
        event.wait()
        late = slot.sum()
    assert torch.equal(late, src.sum()) and fake.races == []


@pytest.mark.parametrize("recorded", [True, False], ids=["record_stream", "no-record_stream"])
@pytest.mark.parametrize("copy", ["to_host", "to_device"])
def test_device_memory_a_copy_may_still_use_is_freed_only_through_record_stream(copy, recorded, monkeypatch):
    """The emulated allocator: the copy to the host's source is freed by the compute stream while the copy may still
    read it; the copy back's result, allocated on the side stream, is freed after the compute stream read it. The
    block may be reused at once by the stream it was allocated on, so each free is a race unless the transport named
    the other stream in `record_stream` (the fake is told to forget those calls to show the race)."""
    fake = FakeStreams(seed=0, progress=0.0)
    if not recorded:
        monkeypatch.setattr(fake, "record_stream", lambda tensor, stream: None)
    transport = AcceleratorTransport(torch.device("cpu"), fake)
    with fake:
        src = torch.randn(4, 8)  # device memory, allocated on the compute stream
        meta = TensorMeta(src.shape, src.dtype, src.device, src.nbytes)
        host = transport.allocate_host(src.nbytes)
        expected = src.sum()
        transport.to_host(src, host, 0)
        if copy == "to_device":
            src = None  # the compute stream freeing the source is checked by the other case
            fake.collect_freed()
            fake.races.clear()
            back, event = transport.to_device(host, meta, 0)
            event.wait()
            got = back.sum()  # the compute stream reads what the side stream allocated
            del back
        else:
            del src
        fake.collect_freed()
    fake.finish()
    freed_on = {"to_host": "compute", "to_device": "side2"}[copy]
    reader = {"to_host": "copy on side1 on side1", "to_device": "aten.sum.default on compute"}[copy]
    if recorded:
        assert fake.races == []
    else:
        assert len(fake.races) == 1 and fake.races[0].startswith(f"memory freed while {reader} may still use it")
        assert f"{freed_on} may reuse it at once" in fake.races[0]
    if copy == "to_device":
        assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["offload", "recompute"], ids=["offload-and-swap", "swap"])
def test_accelerator_transport_is_exact_whatever_order_its_copies_complete_in(policy, seed, monkeypatch):
    """A training step through "offload" and block swap (4 layers sharing 3 slots) on an emulated accelerator whose
    copies complete in an order the seed picks: no memory is read before the copy writing it is waited for, no slot
    or buffer is written while an earlier use may still run (checked by the stream order and the waits alone, so
    for every order), and the gradients equal a run without checkpointing."""
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: None)  # the CPU has no pinned-memory cache
    reference = add_lora(tiny_model())
    _, expected = step_grads(reference, _trainable(reference), batch())
    fake = FakeStreams(seed)
    transport = AcceleratorTransport(torch.device("cpu"), fake)
    model = add_lora(tiny_model())
    config = CheckpointConfig(swap_layers=[0, 1, 2, 3], checkpoint_policy=policy, offload_min_bytes=0)
    with fake:  # the emulated accelerator pins the host copies made here
        cm = CheckpointedModel(model, config, offload_transport=transport, swap_mover=transport)
        _, got = step_grads(cm, _trainable(model), batch())
    fake.finish()
    assert transport._pins, "the host copies are pinned"
    assert fake.races == []
    assert_same_grads(expected, got)
    offloaded = 3 if policy == "offload" else 0  # layer 3's input stays (keep-last)
    assert fake.log.count("side1 wait_stream compute") == offloaded == fake.log.count("side2 wait_stream side1")
    assert fake.log.count("side2 wait_stream compute") == 2 * 4 * len(controller_of(cm).swapper.layers[0].params)


def test_where_pinning_fails_swap_copies_are_pageable_with_one_warning_and_offload_counts_its_own(monkeypatch, caplog):
    """Swap's host copies fall back in the transport; offload's buffers in HostBuffers, which counts them and keeps
    them out of the pinned budget (the transport raises for those)."""
    tried = []
    empty = torch.empty

    def unpinnable(*args, pin_memory=False, **kwargs):
        if pin_memory:
            tried.append(1)
            raise RuntimeError("no pinned memory allocator")
        return empty(*args, **kwargs)

    transport = AcceleratorTransport(torch.device("cpu"), FakeStreams(seed=0))
    monkeypatch.setattr(torch, "empty", unpinnable)
    host_buffers = HostBuffers(transport, max_bytes=1 << 20)
    with caplog.at_level(logging.WARNING, logger="remat"):
        copies = [transport.host_copy(torch.ones(3)), transport.host_copy(torch.ones(2))]
        buffers = [host_buffers.take(64), host_buffers.take(64)]
    assert [b.is_pinned() for b in copies + buffers] == [False] * 4 and torch.equal(copies[0], torch.ones(3))
    assert host_buffers.pageable_fallbacks == 2 and host_buffers.pinned_bytes == 0
    assert len(tried) == 3, "swap does not ask again; each offload buffer does"
    warnings = [r.getMessage() for r in caplog.records if r.name == "remat"]
    assert len(warnings) == 2, warnings
    assert "swap" in warnings[0] and "cannot be pinned" in warnings[0] and "pageable" in warnings[1]


def test_transport_for_picks_the_devices_transport(monkeypatch):
    _emulate_accelerator(monkeypatch, "xpu")
    monkeypatch.setattr(transport_module, "CudaStreams", lambda: FakeStreams(seed=0))
    monkeypatch.setattr(transport_module, "AcceleratorStreams", lambda: FakeStreams(seed=0))
    cuda = transport_for(torch.device("cuda", 0))
    xpu = transport_for(torch.device("xpu", 0))
    assert type(cuda) is CudaTransport and type(xpu) is AcceleratorTransport
    assert isinstance(cuda, StreamTransport) and isinstance(xpu, StreamTransport)  # one copy of the waits
    assert xpu.device == torch.device("xpu", 0) and not xpu.handles(torch.zeros(1))
    assert type(transport_for(torch.device("cpu"))) is CpuTransport
    other = transport_for(torch.device("mps"))
    assert type(other) is NoTransport and other.reason.startswith("mps is not torch's accelerator")


@pytest.mark.skipif(torch.xpu.is_available(), reason="this torch can make XPU streams")
def test_a_device_whose_streams_cannot_be_made_has_no_transport_and_says_why(monkeypatch):
    _emulate_accelerator(monkeypatch, "xpu")
    transport = transport_for(torch.device("xpu", 0))
    assert type(transport) is NoTransport and not transport.handles(torch.zeros(1))
    assert transport.reason.startswith("xpu has no host<->device transport in remat")
    assert transport.reason.endswith("the input stays on the device")
    weight = torch.randn(3)
    assert torch.equal(transport.host_copy(weight), weight), "swap still works, with synchronous copies"


NO_STREAMS = "mps has no host<->device transport in remat: the input stays on the device"


@pytest.mark.parametrize("given", ["offload_transport", "the device's"])
def test_a_device_without_a_transport_keeps_its_inputs_says_why_in_the_map_and_warns_once(given, monkeypatch, caplog):
    transport = NoTransport(NO_STREAMS)
    if given == "the device's":
        monkeypatch.setitem(transport_module._TRANSPORTS, torch.device("cpu"), transport)
    model = tiny_model()
    config = CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0)
    cm = CheckpointedModel(model, config, offload_transport=transport if given == "offload_transport" else None)
    with caplog.at_level(logging.WARNING, logger="remat"):
        for _ in range(2):
            step_grads(cm, list(model.named_parameters()), batch())
    layer_input = 2 * 12 * 32 * 4
    assert all(cm.offload_stats[i].kept_because == {NO_STREAMS: 2 * layer_input} for i in range(4))
    assert [r.getMessage() for r in caplog.records if r.name == "remat"] == [f"offload: {NO_STREAMS}"]
    assert NO_STREAMS in cm.summary()
    assert all(NO_STREAMS in row.offload for row in cm.memory_report(batch()).layers)


def test_on_the_cpu_the_inputs_stay_without_a_warning(caplog):
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0))
    with caplog.at_level(logging.WARNING, logger="remat"):
        step_grads(cm, list(model.named_parameters()), batch())
    assert [r for r in caplog.records if r.name == "remat"] == [] and CpuTransport.reason in cm.summary()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_and_swap_share_the_devices_transport_and_stay_exact():
    model = add_lora(tiny_model(attention_dropout=0.0)).cuda()
    data = {k: v.cuda() for k, v in batch().items()}
    _, expected = step_grads(model, _trainable(model), data)
    config = CheckpointConfig(every_n_layers=2, swap_layers=[1, 3], checkpoint_policy="offload", offload_min_bytes=0)
    cm = CheckpointedModel(model, config)
    for _ in range(2):
        assert_same_grads(expected, step_grads(cm, _trainable(model), data)[1])
    controller = controller_of(cm)
    device = next(model.parameters()).device
    shared = transport_for(device)
    assert controller.offloader._routes[device].transport is shared
    assert all(layer.mover is shared for layer in controller.swapper.layers.values())
    loss = cm(**data).loss  # the inputs in host memory now are pinned
    held = [p.host for p in list(controller.offloader._live.values()) if p.host is not None]
    assert len(held) == 3 and all(buffer.is_pinned() for buffer in held)  # layers 0-2; 3's stays (keep-last)
    loss.backward()
    assert all(t.is_pinned() for layer in controller.swapper.layers.values() for t in layer.host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_generic_accelerator_transport_is_exact_on_a_real_device():
    """torch's device-generic streams and events (what XPU, NPU or MPS get) on a real accelerator: CUDA here, where
    `transport_for` itself keeps `torch.cuda`'s."""
    model = add_lora(tiny_model(attention_dropout=0.0)).cuda()
    data = {k: v.cuda() for k, v in batch().items()}
    _, expected = step_grads(model, _trainable(model), data)
    device = next(model.parameters()).device
    assert type(transport_for(device)) is CudaTransport
    transport = AcceleratorTransport(device)
    config = CheckpointConfig(swap_layers=[0, 1, 2, 3], checkpoint_policy="offload", offload_min_bytes=0)
    cm = CheckpointedModel(model, config, offload_transport=transport, swap_mover=transport)
    for _ in range(2):
        assert_same_grads(expected, step_grads(cm, _trainable(model), data)[1])
    controller = controller_of(cm)
    assert [controller.offloader.stats[i].copies_to_host for i in range(4)] == [2, 2, 2, 0]
    loss = cm(**data).loss
    held = [p.host for p in list(controller.offloader._live.values()) if p.host is not None]
    assert len(held) == 3 and all(buffer.is_pinned() for buffer in held)
    loss.backward()
    assert all(t.is_pinned() for layer in controller.swapper.layers.values() for t in layer.host)
