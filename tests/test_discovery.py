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


def test_layer_ten_and_up_are_not_taken_for_layers_inside_layer_one():
    model = tiny_model(num_hidden_layers=12)
    cm = CheckpointedModel(model)
    assert [p.name for p in cm.checkpoint_map] == [f"model.layers.{i}" for i in range(12)]
    counter = RecomputeCounter(decoder_layers(model))
    ids = torch.randint(3, 90, (1, 6))
    step_grads(cm, list(model.named_parameters()), {"input_ids": ids, "labels": ids})
    assert counter.recomputed() == list(range(12))


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


def _holder(source: str, in_a_file: bool, tmp_path):
    """A module class whose forward is `source`, defined from a file or from a string (remote
    code built at run time has no source file for inspect to read)."""
    code = "import torch\nfrom torch import nn\nclass Holder(nn.Module):\n" + source
    namespace: dict = {}
    if in_a_file:
        path = tmp_path / "holder_module.py"
        path.write_text(code)
        exec(compile(code, str(path), "exec"), namespace)
    else:
        exec(compile(code, "<generated>", "exec"), namespace)
    return namespace["Holder"]()


_CALLS_TORCH = """
    def forward(self, layers, h):
        for layer in layers:
            h = torch.utils.checkpoint.checkpoint(lambda x: layer(x), h, use_reentrant=False)
        return h
"""
_NESTED = """
    def forward(self, layers, h):
        def run(x):
            return checkpoint(layers[0], x)
        return run(h)
"""
_THROUGH_THE_FUNCTION = """
    def forward(self, layers, h):
        # a comment that says checkpoint( does not call it
        for layer in layers:
            h = self._gradient_checkpointing_func(layer.__call__, h)
        return h, "checkpoint(h)"
"""


@pytest.mark.parametrize("in_a_file", [True, False], ids=["from a file", "built at run time"])
def test_a_holder_that_calls_torchs_checkpoint_itself_is_recognised_from_its_code(tmp_path, in_a_file):
    from remat.layers import calls_checkpoint_directly

    assert calls_checkpoint_directly(_holder(_CALLS_TORCH, in_a_file, tmp_path))
    assert calls_checkpoint_directly(_holder(_NESTED, in_a_file, tmp_path))
    assert not calls_checkpoint_directly(_holder(_THROUGH_THE_FUNCTION, in_a_file, tmp_path))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class SharedBlock(Block):
    pass


class Hybrid(nn.Module):
    """A list entry that runs a block shared by every such entry, then its own block (Zamba's hybrid layer)."""

    def __init__(self, shared):
        super().__init__()
        self.shared, self.own = shared, Block()

    def forward(self, x):
        return self.own(self.shared(x))


class HybridStack(transformers.PreTrainedModel):
    config_class = transformers.PretrainedConfig
    _no_split_modules = ("Block", "SharedBlock")

    def __init__(self):
        super().__init__(transformers.PretrainedConfig())
        torch.manual_seed(0)
        shared = SharedBlock()
        self.layers = nn.ModuleList([Block(), Block(), Hybrid(shared), Block(), Hybrid(shared)])

    def forward(self, x, labels=None):
        for layer in self.layers:
            x = layer(x)
        return transformers.modeling_outputs.CausalLMOutput(loss=x.pow(2).mean())


def zamba():
    config = transformers.ZambaConfig(
        vocab_size=64,
        hidden_size=32,
        attention_hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=2,
        mamba_d_state=4,
        mamba_dt_rank=4,
        n_mamba_heads=1,
        attn_layer_period=3,
        attn_layer_offset=2,
        use_mamba_kernels=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.ZambaForCausalLM(config).train()


@pytest.mark.parametrize("build", [HybridStack, zamba])
def test_a_list_entry_holding_a_block_beside_blocks_is_the_layer_so_its_shared_block_is_checkpointed(build):
    """Found by its blocks' classes (Zamba on transformers 4.x, whose layers carry no flag), a hybrid entry of the list
    used to be found as its own Mamba block alone: the shared attention it also runs was never checkpointed."""
    model, reference = build(), build()
    stack = "layers" if build is HybridStack else "model.layers"
    calls = {"model": [], "reference": []}
    for key, built in (("model", model), ("reference", reference)):
        kinds = ("SharedBlock", "ZambaAttentionDecoderLayer")
        shared = {id(m): m for m in built.modules() if type(m).__name__ in kinds}
        for module in shared.values():  # one module shared by the entries (transformers 4.x), or one each (5.x)
            module.register_forward_pre_hook(lambda *args, key=key: calls[key].append(1))
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    assert [p.name for p in cm.checkpoint_map] == [f"{stack}.{i}" for i in range(len(model.get_submodule(stack)))]
    data = {"x": torch.randn(2, 8)} if build is HybridStack else {"input_ids": torch.arange(24).view(2, 12) % 64}
    data["labels"] = data.get("input_ids")
    _, expected = step_grads(reference, list(reference.named_parameters()), data)
    _, actual = step_grads(cm, list(model.named_parameters()), data)
    assert len(calls["reference"]) == 2 and len(calls["model"]) == 4, "two hybrid entries, each recomputed"
    assert expected.keys() == actual.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=1e-5, atol=0)


def test_a_map_saved_when_a_hybrid_entry_was_found_as_its_inner_block_loads_as_it_was(tmp_path):
    import json

    # (the map is this test's, not the weights: transformers' own save refuses the untied shared block's)
    CheckpointedModel(HybridStack(), layer_policies={2: "none"}).save_pretrained(tmp_path, state_dict={})
    file = tmp_path / "checkpoint_config.json"
    saved = json.loads(file.read_text())
    saved["layers"] = [f"{name}.own" if name in ("layers.2", "layers.4") else name for name in saved["layers"]]
    file.write_text(json.dumps(saved))  # as remat wrote it before hybrid entries were the layers
    loaded = CheckpointedModel.from_pretrained(HybridStack(), tmp_path)
    assert loaded.checkpoint_config.layer_policies == {2: "none"}
    assert [p.policy for p in loaded.checkpoint_map] == ["recompute", "recompute", "none", "recompute", "recompute"]
    saved["layers"][1] = "layers.1.elsewhere.own"
    saved["layers"][2] = "layers.3.own"
    file.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="planned for 5 layers"):
        CheckpointedModel.from_pretrained(HybridStack(), tmp_path)
    saved["layers"] = [f"layers.{i}.proj" for i in range(5)]  # other layers altogether (layer_class= a block's part)
    file.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="planned for 5 layers"):
        CheckpointedModel.from_pretrained(HybridStack(), tmp_path)


class PairedStack(transformers.PreTrainedModel):
    """Blocks kept in pairs, a list of lists the forward loops over (`for first, second in self.layers`)."""

    config_class = transformers.PretrainedConfig

    def __init__(self):
        super().__init__(transformers.PretrainedConfig())
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.ModuleList([Block(), Block()]) for _ in range(3)])

    def forward(self, x, labels=None):
        for first, second in self.layers:
            x = second(first(x))
        return transformers.modeling_outputs.CausalLMOutput(loss=x.pow(2).mean())


def test_a_list_of_lists_is_not_the_layers_the_blocks_the_loop_calls_are():
    """The inner lists (no forward: never called) were taken as the layers: the map said "recompute" and nothing
    was checkpointed (and a swapped layer's weights stayed placeholders: wrong gradients)."""
    model = PairedStack()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    assert [p.name for p in cm.checkpoint_map] == [f"layers.{i}.{j}" for i in range(3) for j in range(2)]
    counter = RecomputeCounter([block for pair in model.layers for block in pair])
    reference = PairedStack()
    x = torch.randn(2, 8)
    _, expected = step_grads(reference, list(reference.named_parameters()), {"x": x})
    _, actual = step_grads(cm, list(model.named_parameters()), {"x": x})
    assert counter.counts == [2] * 6
    assert expected.keys() == actual.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match=r"layer_class names \['ModuleList'\], a container with no forward"):
        CheckpointedModel(PairedStack(), layer_class="ModuleList")


def test_with_no_layer_checkpointed_the_holders_leave_the_cache_as_an_unwrapped_model_has_it(caplog):
    """Holders turn `use_cache` off while layers checkpoint (as transformers does); with every layer "none" the cache
    is the model's again, with no warning that it is incompatible with checkpointing."""
    data = {"input_ids": torch.randint(3, 90, (1, 6)), "use_cache": True}
    expected = tiny_model()(**data).past_key_values.get_seq_length()
    cm = CheckpointedModel(tiny_model(), CheckpointConfig(layer_policies={i: "none" for i in range(4)}))
    with caplog.at_level("WARNING"):
        out = cm(**data)
    assert expected == 6 and out.past_key_values.get_seq_length() == expected
    assert not [r for r in caplog.records if "incompatible with gradient checkpointing" in r.getMessage()]


class MixedStack(transformers.PreTrainedModel):
    """Blocks and, among them, a list of blocks the loop runs one by one (no forward of its own)."""

    config_class = transformers.PretrainedConfig
    _no_split_modules = ("Block",)

    def __init__(self):
        super().__init__(transformers.PretrainedConfig())
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), nn.ModuleList([Block(), Block()]), Block()])

    def forward(self, x, labels=None):
        for entry in self.layers:
            for block in entry if isinstance(entry, nn.ModuleList) else [entry]:
                x = block(x)
        return transformers.modeling_outputs.CausalLMOutput(loss=x.pow(2).mean())


def test_a_list_entry_with_no_forward_is_never_taken_for_the_layer_of_the_blocks_in_it():
    model = MixedStack()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    assert [p.name for p in cm.checkpoint_map] == ["layers.0", "layers.1.0", "layers.1.1", "layers.2"]
    counter = RecomputeCounter(cm.layers)
    step_grads(cm, list(model.named_parameters()), {"x": torch.randn(2, 8)})
    assert counter.counts == [2, 2, 2, 2]


def tiny_swin():
    config = transformers.SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4, num_labels=3
    )
    torch.manual_seed(0)
    return transformers.SwinForImageClassification(config).train()


def test_a_stage_holding_a_list_of_layers_gives_way_to_them_and_layer_class_wins_over_a_layer_around_it():
    """Swin's stages hold its blocks; on transformers 5.2x both are checkpointing layers, and the map took the stages:
    recomputed whole, a stage held 2.4x what its blocks do, and `layer_class="SwinLayer"` was ignored silently."""
    blocks = [f"swin.encoder.layers.{s}.blocks.{b}" for s in range(2) for b in range(2)]
    first_block = tiny_swin().swin.encoder.layers[0].blocks[0]
    stages_are_the_only_layers = not isinstance(first_block, GradientCheckpointingLayer)
    default = CheckpointedModel(tiny_swin(), CheckpointConfig(every_n_layers=1))
    assert [p.name for p in default.checkpoint_map] == (
        ["swin.encoder.layers.0", "swin.encoder.layers.1"] if stages_are_the_only_layers else blocks
    )
    stages = CheckpointedModel(tiny_swin(), layer_class="SwinStage")  # named: the stages, whatever holds them
    assert [p.name for p in stages.checkpoint_map] == ["swin.encoder.layers.0", "swin.encoder.layers.1"]
    model, reference = tiny_swin(), tiny_swin()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1), layer_class="SwinLayer")
    assert [p.name for p in cm.checkpoint_map] == blocks
    counter = RecomputeCounter(cm.layers)
    data = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 2])}
    _, expected = step_grads(reference, list(reference.named_parameters()), data)
    _, got = step_grads(cm, list(model.named_parameters()), data)
    assert counter.counts == [2, 2, 2, 2]
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class _Outer(nn.Module):
    """A block that runs a stack of its own beside its attention-like projection (MobileBERT's FFN stack)."""

    def __init__(self):
        super().__init__()
        self.attention, self.ffn = nn.Linear(8, 8), nn.ModuleList([_Inner(), _Inner()])

    def forward(self, x):
        x = x + self.attention(x)
        for inner in self.ffn:
            x = inner(x)
        return x


class _OuterStack(transformers.PreTrainedModel):
    config_class = transformers.PretrainedConfig

    def __init__(self):
        super().__init__(transformers.PretrainedConfig())
        self.layers = nn.ModuleList([_Outer() for _ in range(3)])

    def forward(self, x, labels=None):
        for layer in self.layers:
            x = layer(x)
        return transformers.modeling_outputs.CausalLMOutput(loss=x.pow(2).mean())


def test_a_block_found_by_structure_keeps_its_own_inner_stack():
    """Giving way to a list of layers inside is for transformers' layers (Swin's stage) only: blocks found by their
    structure gave way to their inner stacks, leaving out what the block does around them (MobileBERT on 4.57: its
    attention and bottleneck kept; UnivNet: 5.4x the held bytes)."""
    assert [p.name for p in CheckpointedModel(_OuterStack()).checkpoint_map] == [f"layers.{i}" for i in range(3)]
