"""The one host<->device transport: offload and block swap both go through the device's
transport, and the test doubles stay out of the library. CUDA tests at the end run the real
streams where a GPU exists."""

import ast
from pathlib import Path

import pytest
import torch
from conftest import add_lora, assert_same_grads, batch, step_grads, tiny_model

import remat.transport as transport_module
from remat import CheckpointConfig, CheckpointedModel
from remat.model import controller_of
from remat.testing import SimulatedTransport
from remat.transport import CpuTransport, transport_for

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
