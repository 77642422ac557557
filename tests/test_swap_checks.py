"""Which layers block swap may take: sharded weights refused by their type (real FSDP1, FSDP2
and DTensor, in a one-process gloo group on the CPU), adapters recognised by PEFT's tuner
layers (any PEFT method, not a name), and everything refused before anything moves."""

import pytest
import torch
import torch.distributed as dist
from conftest import add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model
from torch import nn

from remat import BlockSwapError, CheckpointConfig, CheckpointedModel


@pytest.fixture(scope="module")
def one_process_group():
    """A real process group of one rank (gloo, CPU): FSDP and DTensor need one to exist."""
    if dist.is_initialized():  # pragma: no cover - another test left one
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _storages(model):
    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p  # a DTensor's own shard

    return {n: (id(p), type(p), local(p).data_ptr(), local(p).shape) for n, p in model.named_parameters()}


def _refused(model, config, match):
    before = _storages(model)
    with pytest.raises(BlockSwapError, match=match):
        CheckpointedModel(model, config)
    assert _storages(model) == before, "a refused swap moves nothing"


def test_a_layer_sharded_by_fsdp2_fully_shard_is_refused(one_process_group):
    from torch.distributed.fsdp import fully_shard

    model = add_lora(tiny_model())
    fully_shard(decoder_layers(model)[1])
    _refused(model, CheckpointConfig(swap_layers=[1]), r"layer 1 .* sharded by FSDP \(FSDPLlamaDecoderLayer")
    CheckpointedModel(model, CheckpointConfig(swap_layers=[3])).disable()  # an unsharded layer still swaps


def test_layers_under_a_model_wide_fsdp2_unit_are_refused(one_process_group):
    from torch.distributed.fsdp import fully_shard

    model = add_lora(tiny_model())
    fully_shard(model)
    _refused(model, CheckpointConfig(swap_layers=[2]), r"layer 2 .* sharded by FSDP .* on the whole model")


def test_a_layer_wrapped_by_fsdp1_is_refused(one_process_group):
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = add_lora(tiny_model())
    layers = model.base_model.model.model.layers
    layers[1] = FullyShardedDataParallel(layers[1], device_id=torch.device("cpu"), use_orig_params=True)
    _refused(model, CheckpointConfig(swap_layers=[1]), r"layer 1 .* sharded by FSDP \(FullyShardedDataParallel")


def test_a_dtensor_weight_is_refused(one_process_group):
    """Tensor parallel leaves a plain module holding DTensor parameters: recognised by type."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = add_lora(tiny_model())
    proj = decoder_layers(model)[1].mlp.up_proj
    mesh = init_device_mesh("cpu", (1,))
    proj.weight = nn.Parameter(distribute_tensor(proj.weight.detach(), mesh, [Replicate()]), requires_grad=False)
    _refused(model, CheckpointConfig(swap_layers=[1]), r"managed by torch.distributed \(a DTensor.*mlp.up_proj.weight")


def test_a_deepspeed_zero3_parameter_is_refused_imitated_because_deepspeed_is_not_installed():
    """DeepSpeed is not installed here (it needs a GPU build). ZeRO-3 marks each partitioned
    parameter with `ds_id` (and `ds_status`, `ds_numel`, ...) in `_convert_to_deepspeed_param`,
    and its own test `is_zero_param(p)` is `hasattr(p, "ds_id")`: the imitation sets those."""
    model = add_lora(tiny_model())
    weight = decoder_layers(model)[1].mlp.up_proj.weight
    weight.ds_id, weight.ds_status, weight.ds_numel = 7, "NOT_AVAILABLE", weight.numel()
    _refused(model, CheckpointConfig(swap_layers=[1]), r"DeepSpeed ZeRO-3 .*up_proj.weight")


def test_adapters_of_any_peft_method_stay_resident_and_the_swap_is_exact():
    """IA3's trainable `ia3_l` vectors are 2-d and named without "lora_": recognised as adapter
    weights by PEFT's tuner layer, so the frozen base weights around them swap."""
    from peft import IA3Config, get_peft_model

    def ia3_model():
        config = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
        model = get_peft_model(tiny_model(attention_dropout=0.0), config)
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "ia3_l" in name:
                nn.init.normal_(param, mean=1.0, std=0.1)
        return model

    reference = ia3_model()
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    assert any(p.dim() >= 2 for _, p in named)
    _, expected = step_grads(reference, named, batch())
    model = ia3_model()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[1, 3]))
    assert sorted(cm.swap_stats) == [1, 3]
    assert_same_grads(expected, step_grads(cm, named, batch())[1])
    assert all(cm.swap_stats[i].fetches == 2 for i in (1, 3))


def test_a_trainable_base_module_named_like_an_adapter_is_refused():
    """A name is not an adapter: a trainable linear the user called `lora_gate` is a base
    weight that trains (full fine-tuning of that module), and would stay resident unannounced."""
    model = add_lora(tiny_model())
    decoder_layers(model)[1].lora_gate = nn.Linear(32, 32)  # trainable, not a PEFT adapter
    _refused(model, CheckpointConfig(swap_layers=[1]), "its weight lora_gate.weight trains and is no PEFT adapter")


def test_a_layer_run_at_two_places_of_the_stack_is_refused_naming_the_other_place():
    """Its weights are held by both places, so none is its own: the refusal said only "no frozen weights of its own"."""
    model = tiny_model()
    model.requires_grad_(False)
    model.model.layers[2] = model.model.layers[0]  # one block run twice, as ALBERT's is
    _refused(model, CheckpointConfig(swap_layers=[0]), r"layer 0 .* also held by model\.layers\.2\.")
