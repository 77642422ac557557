"""Discovery: every GradientCheckpointingLayer in module order, vision towers included."""

import pytest
import torch
import transformers
from conftest import RecomputeCounter, decoder_layers, step_grads, tiny_model
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from remat import CheckpointConfig, CheckpointedModel
from remat.layers import discover_layers


def tiny_llava():
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4
    )
    text = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    # vision_feature_layer=-1: every vision layer feeds the text model (the default -2 leaves the last unused)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=63, vision_feature_layer=-1
    )
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config)


def test_layers_are_found_in_module_order_with_their_qualified_names():
    model = tiny_model()
    cm = CheckpointedModel(model)
    assert [p.name for p in cm.checkpoint_map] == [f"model.layers.{i}" for i in range(4)]
    modules = dict(model.named_modules())
    assert [modules[p.name] for p in cm.checkpoint_map] == decoder_layers(model) == cm.layers


def test_vision_tower_and_text_layers_share_one_map_in_transformers_order():
    model = tiny_llava()
    names = discover_layers(model).names
    expected = [n for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    assert names == expected and len(names) == 5
    assert any("vision" in n for n in names[:2]) and all("language" in n for n in names[2:])
    if "every_n_layers" in str(__import__("inspect").signature(type(model).gradient_checkpointing_enable)):
        # transformers >= 5.16 counts every_n_layers over the same list: compare with its choice.
        native = tiny_llava()
        native.gradient_checkpointing_enable(every_n_layers=2)
        natively_on = [
            n
            for n, m in native.named_modules()
            if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
        ]
        cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
        assert [p.name for p in cm.checkpoint_map if p.checkpointed] == natively_on


class PassThrough(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class OuterLayer(GradientCheckpointingLayer):
    """A layer that owns two other layers, as some composite blocks do."""

    def __init__(self, first, inner):
        super().__init__()
        self.first = first
        self.inner = inner

    def forward(self, hidden_states, *args, **kwargs):
        return self.inner(self.first(hidden_states, *args, **kwargs), *args, **kwargs)


def test_a_layer_nested_in_another_layer_is_not_checkpointed_twice():
    model = tiny_model()
    layers = model.model.layers
    layers[1], layers[2] = OuterLayer(layers[1], layers[2]), PassThrough()
    cm = CheckpointedModel(model)
    assert [p.name for p in cm.checkpoint_map] == ["model.layers.0", "model.layers.1", "model.layers.3"]
    counter = RecomputeCounter(decoder_layers(model))
    ids = torch.randint(3, 90, (1, 6))
    step_grads(cm, list(model.named_parameters()), {"input_ids": ids, "labels": ids})
    assert max(counter.counts) == 2, "no layer runs three times (a nested checkpoint would)"
    assert counter.recomputed() == list(range(len(counter.counts)))


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_holders_never_checkpoint_and_turn_the_cache_off_while_training(arch):
    model = tiny_model(arch)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    discovery = discover_layers(model)
    assert discovery.holders, "the model that holds the stack carries a flag"
    out = cm(input_ids=torch.randint(3, 90, (1, 6)), use_cache=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    assert cache is None or cache.get_seq_length() == 0, "no layer filled a cache while training with checkpointing"
