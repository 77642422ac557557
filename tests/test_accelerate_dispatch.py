"""Models placed by accelerate's `dispatch_model` with layers offloaded to "disk": their weights are `meta` at rest,
loaded for each forward by an `AlignDevicesHook` (helper-87's trial). remat measures where the layers compute, refuses
to swap a weight that is not there, and leaves no offloaded weight loaded after a recomputed layer's backward."""

import pytest
import torch
from conftest import assert_same_grads, batch, step_grads, tiny_model

from remat import BlockSwapError, CheckpointedModel

accelerate = pytest.importorskip("accelerate")

LAYERS = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def _dispatched(tmp_path, on_disk: tuple[str, ...], lora: bool = False):
    """The test's model, the modules `on_disk` offloaded to disk; with LoRA on layers 0 and 2 only (PEFT makes an
    offloaded layer's adapters on meta, where no backward runs, with or without remat)."""
    model = tiny_model(seed=3)
    placement = {**LAYERS, **{f"model.layers.{i}": "cpu" for i in range(4)}, **dict.fromkeys(on_disk, "disk")}
    model = accelerate.dispatch_model(model, placement, main_device="cpu", offload_dir=str(tmp_path / "offload"))
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[0, 2], lora_dropout=0.0)
        model = get_peft_model(model, config)
    model.train()
    return model


def _on_device(model, prefixes: tuple[str, ...]) -> list[str]:
    return [n for n, p in model.named_parameters() if any(f".{o}" in n for o in prefixes) and p.device.type != "meta"]


def test_an_offloaded_first_weight_is_not_where_the_step_is_measured(tmp_path):
    """The embedding offloaded (its weight, the model's first parameter, on meta at rest): the step is measured where
    the layers compute, and holds what the same model holds undispatched (on meta, it held 0 bytes, and a budget far
    below the step's peak was taken with every layer "none")."""
    data = batch()
    plain = CheckpointedModel(tiny_model(seed=3), every_n_layers=2).memory_report(data)
    model = _dispatched(tmp_path, ("model.embed_tokens",))
    assert next(model.parameters()).device.type == "meta"
    report = CheckpointedModel(model, every_n_layers=2).memory_report(data)
    assert report.device_bytes > 0 and report.device_bytes == plain.device_bytes
    assert [row.device_bytes for row in report.layers] == [row.device_bytes for row in plain.layers]
    held = lambda profile: [layer.held for layer in profile.measurements.layers]
    profiled = CheckpointedModel(model, every_n_layers=2).profile(data)
    assert held(profiled) == held(CheckpointedModel(tiny_model(seed=3), every_n_layers=2).profile(data))


def test_block_swap_of_a_layer_accelerate_offloads_is_refused_before_anything_moves(tmp_path):
    model = _dispatched(tmp_path, ("model.layers.1", "model.layers.3"), lora=True)
    before = {n: (p.device, p.data_ptr()) for n, p in model.named_parameters()}
    hooks = {n: m._hf_hook for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    for swap in ([1], 2, [0, 1]):
        with pytest.raises(BlockSwapError, match=r"layer 1 .*meta device.*leave this layer out of swap_layers"):
            CheckpointedModel(model, swap_layers=swap)
        assert {n: (p.device, p.data_ptr()) for n, p in model.named_parameters()} == before
        assert {n: m._hf_hook for n, m in model.named_modules() if hasattr(m, "_hf_hook")} == hooks
    cm = CheckpointedModel(model, swap_layers=[0])  # a layer accelerate does not offload still swaps
    assert [row.swapped for row in cm.checkpoint_map] == [True, False, False, False]


@pytest.mark.parametrize("policies", [{1: "recompute", 3: "recompute"}, {1: "selective", 3: "recompute"}])
def test_a_recomputed_offloaded_layer_leaves_no_weight_loaded_and_its_gradients_are_exact(tmp_path, policies):
    """torch's recompute stops early (once it has what backward needs), so the hook that puts the offloaded weights
    of the layer's last submodule back to meta never ran: they stayed loaded through backward and after. Gradients
    equal the same placement without checkpointing."""
    offloaded = ("layers.1.", "layers.3.")
    data = batch()
    reference = _dispatched(tmp_path / "a", ("model.layers.1", "model.layers.3"), lora=True)
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    expected_loss, expected = step_grads(reference, named, data)
    model = _dispatched(tmp_path / "b", ("model.layers.1", "model.layers.3"), lora=True)
    cm = CheckpointedModel(model, layer_policies=policies)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss, grads = step_grads(cm, named, data)
    assert _on_device(reference, offloaded) == [] and _on_device(model, offloaded) == []
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert_same_grads(expected, grads)
    assert [row.policy for row in cm.checkpoint_map][1::2] == list(policies.values())
