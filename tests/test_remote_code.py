"""Any model: remote-code blocks, the old checkpointing format, MoE counters, vision towers."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import RecomputeCounter, assert_same_grads, batch, hook_snapshot, step_grads, tiny_model
from test_discovery import tiny_llava

from remat import CheckpointConfig, CheckpointedModel, NoCheckpointableLayersError
from remat.testing import SimulatedTransport

SOURCE = Path(__file__).parent / "remote_code" / "modeling_remote.py"


def load_remote(tmp_path, cls="RemoteForCausalLM", seed=0, **config):
    """Write a remote-code model folder and load it with trust_remote_code=True (no network)."""
    folder = tmp_path / f"remote-{cls}"
    folder.mkdir(exist_ok=True)
    shutil.copy(SOURCE, folder / "modeling_remote.py")
    payload = {
        "model_type": "remat_remote",
        "auto_map": {"AutoConfig": "modeling_remote.RemoteConfig", "AutoModelForCausalLM": f"modeling_remote.{cls}"},
        **config,
    }
    (folder / "config.json").write_text(json.dumps(payload))
    loaded = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(loaded, trust_remote_code=True)
    model.train()
    return model


def blocks(model):
    return list(model.model.blocks)


def _run(model, config, data=None, **wrapper_kwargs):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    data = data or batch()
    ref_loss, ref = step_grads(model, named, data)
    cm = CheckpointedModel(model, config, **wrapper_kwargs)
    counter = RecomputeCounter(blocks(model))
    loss, got = step_grads(cm, named, data)
    counter.remove()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)
    return cm, counter


@pytest.mark.parametrize("cls", ["RemoteForCausalLM", "RemoteOldForCausalLM"], ids=["flag-func", "old-format"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_remote_blocks_every_n_layers_2_recomputes_layers_0_and_2_exactly(tmp_path, cls, reentrant):
    model = load_remote(tmp_path, cls)
    assert not any(isinstance(b, transformers.modeling_layers.GradientCheckpointingLayer) for b in blocks(model))
    cm, counter = _run(model, CheckpointConfig(every_n_layers=2, use_reentrant=reentrant))
    assert [p.name for p in cm.checkpoint_map] == [f"model.blocks.{i}" for i in range(4)]
    assert counter.recomputed() == [0, 2]
    assert max(counter.counts) == 2, "the model's own loop never nests a checkpoint around remat's"


@pytest.mark.parametrize("cls", ["RemoteForCausalLM", "RemoteOldForCausalLM"], ids=["flag-func", "old-format"])
def test_native_route_with_every_n_layers_reaches_remote_blocks(tmp_path, cls):
    model = load_remote(tmp_path, cls)
    cm = CheckpointedModel(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"every_n_layers": 2})
    counter = RecomputeCounter(blocks(model))
    step_grads(cm, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 2]


def test_transformers_alone_checkpoints_every_remote_block_whatever_every_n_layers_says(tmp_path):
    """The defect remat fixes: native every_n_layers counts only GradientCheckpointingLayers."""
    model = load_remote(tmp_path)
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    import inspect

    if "every_n_layers" not in inspect.signature(enable).parameters:
        with pytest.raises(TypeError):  # before 5.16 the native route has no every_n_layers at all
            enable(every_n_layers=2)
        return
    enable(every_n_layers=2)
    counter = RecomputeCounter(blocks(model))
    step_grads(model, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 1, 2, 3]


def test_remote_blocks_take_offload_and_swap(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_remote(tmp_path), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.train()
    config = CheckpointConfig(every_n_layers=2, checkpoint_policy="offload", offload_min_bytes=0, swap_layers=[1, 3])
    transport = SimulatedTransport()
    cm, counter = _run_peft(model, config, transport)
    assert counter.recomputed() == [0, 1, 2, 3]  # swapped layers 1 and 3 are checkpointed too
    assert {layer for op, layer in transport.log if op == "to_host"} == {0, 1, 2}
    assert all(cm.swap_stats[i].fetches == 2 for i in (1, 3))


def _run_peft(model, config, transport):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ref_loss, ref = step_grads(model, named, batch())
    cm = CheckpointedModel(model, config, offload_transport=transport)
    counter = RecomputeCounter(list(model.base_model.model.model.blocks))
    loss, got = step_grads(cm, named, batch())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)
    return cm, counter


def test_remote_moe_gradients_exact_and_router_counters_not_counted_twice(tmp_path):
    plain = load_remote(tmp_path, num_experts=4, dropout=0.0)
    step_grads(plain, list(plain.named_parameters()), batch())
    expected_tokens = [b.mlp.tokens_per_expert.clone() for b in blocks(plain)]
    expected_calls = [b.mlp.calls for b in blocks(plain)]
    assert all(t.sum() > 0 for t in expected_tokens)

    model = load_remote(tmp_path, num_experts=4, dropout=0.0)
    cm, counter = _run(model, CheckpointConfig())
    assert counter.recomputed() == [0, 1, 2, 3]
    # _run did one step without and one with checkpointing: twice the plain counts, not three times
    for block, tokens, calls in zip(blocks(model), expected_tokens, expected_calls, strict=True):
        assert torch.equal(block.mlp.tokens_per_expert, 2 * tokens)
        assert block.mlp.calls == 2 * calls


def test_qwen2_moe_is_exact_with_every_layer_recomputed():
    model = tiny_model("qwen2_moe")
    named = list(model.named_parameters())
    _, ref = step_grads(model, named, batch())
    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=True))
    _, got = step_grads(cm, named, batch())
    assert_same_grads(ref, got)
    assert all(torch.isfinite(g).all() for g in got.values())


def test_old_format_blocks_are_found_by_structure_and_layer_class_names_them_explicitly(tmp_path):
    model = load_remote(tmp_path, "RemoteOldForCausalLM")
    assert CheckpointedModel(model).checkpoint_map[3].name == "model.blocks.3"
    other = load_remote(tmp_path, "RemoteOldForCausalLM")
    cm = CheckpointedModel(other, layer_class="RemoteAttention")  # any class may be named
    assert [p.name for p in cm.checkpoint_map] == [f"model.blocks.{i}.attn" for i in range(4)]
    with pytest.raises(NoCheckpointableLayersError, match="NoSuchBlock"):
        CheckpointedModel(load_remote(tmp_path, "RemoteOldForCausalLM"), layer_class="NoSuchBlock")
    with pytest.raises(TypeError, match="layer_class"):
        CheckpointedModel(load_remote(tmp_path, "RemoteOldForCausalLM"), layer_class=3)


def test_old_format_blocks_that_return_their_cache_train_exactly_with_use_cache_on(tmp_path, caplog):
    """GPT-2's pre-4.35 loop reads each block's `present` when it asked for the cache (its own flag off: remat
    leaves it off, as the loop calls torch's checkpoint itself). remat passed `use_cache=False` into the block, which
    then returned no `present`: IndexError. The call is left as the model made it (the cache is a new output, not
    a cache object updated in place), and a warning says the cache is held."""
    model = load_remote(tmp_path, "RemoteCachedForCausalLM", use_cache=True)
    with caplog.at_level("WARNING", logger="remat"):
        _, counter = _run(model, CheckpointConfig())
    assert counter.recomputed() == [0, 1, 2, 3]
    assert "use_cache=False" in caplog.text and "RemoteCachedBlock" in caplog.text


def test_disable_restores_remote_blocks_exactly(tmp_path):
    model = load_remote(tmp_path)
    hooks = hook_snapshot(model)
    attrs = {n: dict(vars(m)).keys() for n, m in model.named_modules()}
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    step_grads(cm, list(model.named_parameters()), batch())
    cm.disable()
    assert hook_snapshot(model) == hooks
    assert {n: dict(vars(m)).keys() for n, m in model.named_modules()} == attrs
    assert model.model.gradient_checkpointing is False


def _llava_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (2, 10), generator=g)
    ids[:, 1:5] = 63  # image tokens: (8 / 4) ** 2 = 4 patches per image
    pixels = torch.randn(2, 3, 8, 8, generator=g)
    return {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids), "labels": ids}


@pytest.mark.parametrize("reentrant", [False, True])
def test_llava_one_map_over_both_towers_with_exact_gradients(reentrant):
    model = tiny_llava()
    model.train()
    named = list(model.named_parameters())
    data = _llava_batch()
    ref_loss, ref = step_grads(model, named, data)
    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=reentrant))
    names = [p.name for p in cm.checkpoint_map]
    assert len(names) == 5 and "vision" in names[0] and "language" in names[-1]
    counter = RecomputeCounter(cm.layers)
    loss, got = step_grads(cm, named, data)
    assert counter.recomputed() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)


def test_llava_with_frozen_towers_and_reentrant_checkpointing_still_trains_the_adapters():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llava(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.train()
    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=True))
    cm(**_llava_batch()).loss.backward()
    lora = {n: p.grad for n, p in model.named_parameters() if "lora_B" in n}  # lora_A starts with zero grad
    vision = [g for n, g in lora.items() if "vision" in n]
    text = [g for n, g in lora.items() if "language" in n]
    assert vision and text and all(g is not None and g.abs().sum() > 0 for g in vision + text)
