"""fp32 gradients with checkpointing equal a run without it (rtol 1e-5), for every policy mix.

Dropout is on in every model (attention dropout and LoRA dropout), so these tests also prove the
RNG is replayed: a recompute that drew different dropout masks would give different gradients.
"""

import pytest
import torch
import transformers
from conftest import ARCHS, RecomputeCounter, add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model

from remat import CheckpointConfig, CheckpointedModel


def _reference_and_wrapped(arch, lora, config, **overrides):
    model = tiny_model(arch, **overrides)
    if lora:
        model = add_lora(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    data = batch()
    ref_loss, ref = step_grads(model, named, data)
    cm = CheckpointedModel(model, config)
    counter = RecomputeCounter(decoder_layers(model))
    loss, got = step_grads(cm, named, data)
    counter.remove()
    return ref_loss, ref, loss, got, counter, cm


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("every_n", [1, 2, 3])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradients_equal_no_checkpointing(arch, every_n, lora):
    ref_loss, ref, loss, got, counter, cm = _reference_and_wrapped(arch, lora, CheckpointConfig(every_n_layers=every_n))
    expected = [i for i in range(4) if i % every_n == 0]
    assert counter.recomputed() == expected == cm.checkpoint_map.checkpointed
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reentrant_gradients_equal_no_checkpointing(arch, lora):
    ref_loss, ref, loss, got, counter, _ = _reference_and_wrapped(
        arch, lora, CheckpointConfig(every_n_layers=2, use_reentrant=True)
    )
    assert counter.recomputed() == [0, 2]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)


@pytest.mark.parametrize("asked_by", ["config", "keyword"])
def test_reentrant_refuses_where_it_would_lose_the_routers_aux_loss_gradient_and_is_exact_elsewhere(asked_by):
    """transformers 5 (not 4.57's Qwen2-MoE) records an MoE's router logits by hooks inside the layers, which a
    reentrant checkpoint runs without gradients: the aux loss then trains no router. Where transformers' own
    reentrant checkpointing shows that loss, remat refuses before the forward, and the step after works; elsewhere
    its reentrant gradients, the aux loss's included, are exact."""
    config_flag = asked_by == "config"
    model = tiny_model("qwen2_moe", output_router_logits=config_flag, router_aux_loss_coef=0.5)
    data = batch() | ({} if config_flag else {"output_router_logits": True})
    named = list(model.named_parameters())
    native = tiny_model("qwen2_moe", output_router_logits=config_flag, router_aux_loss_coef=0.5)
    native.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    _, native_grads = step_grads(native, list(native.named_parameters()), data)
    ref_loss, ref = step_grads(model, named, data)
    assert model(**data).aux_loss is not None  # the aux loss is in the loss
    loses = any(not torch.allclose(native_grads[n], ref[n], rtol=1e-5, atol=1e-7) for n in ref)

    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=True))
    if not loses:
        loss, got = step_grads(cm, named, data)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        assert_same_grads(ref, got)
        return
    counter = RecomputeCounter(decoder_layers(model))
    with pytest.raises(ValueError, match="use_reentrant=True would lose the gradient of the router_logits"):
        step_grads(cm, named, data)
    assert sum(counter.counts) == 0 and all(p.grad is None for _, p in named)  # refused before anything ran
    _, got = step_grads(cm, named, data | {"output_router_logits": False})  # not asked: reentrant runs
    assert counter.recomputed() == [0, 1, 2, 3] and got
    counter.remove()
    cm.enable(cm.checkpoint_config.replace(use_reentrant=False))
    loss, got = step_grads(cm, named, data)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)


def test_reentrant_runs_where_outputs_recorded_inside_layers_are_not_the_models_loss():
    """Attentions are recorded by hooks inside the layers too, but the model's loss is not made of them (and with
    sdpa none are recorded): `output_attentions=True` in the config does not refuse a reentrant step."""
    ref_loss, ref, loss, got, counter, _ = _reference_and_wrapped(
        "llama", True, CheckpointConfig(use_reentrant=True), output_attentions=True
    )
    assert counter.recomputed() == [0, 1, 2, 3]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)


def test_reentrant_lora_learns_with_frozen_embeddings():
    """Reentrant checkpointing of a layer whose input does not require grad must still give LoRA
    weights inside it a gradient (the inputs are made to require grad)."""
    model = add_lora(tiny_model("llama"))
    assert not model.get_input_embeddings().weight.requires_grad
    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=True))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    _, grads = step_grads(cm, named, batch())
    layer0 = [n for n in grads if ".layers.0." in n and "lora_" in n]
    assert layer0 and all(grads[n].abs().sum() > 0 for n in layer0)


def test_layer_policies_override_every_n():
    config = CheckpointConfig(every_n_layers=2, layer_policies={0: "none", 1: "recompute", 3: "recompute"})
    _ref_loss, ref, _loss, got, counter, cm = _reference_and_wrapped("llama", True, config)
    assert counter.recomputed() == [1, 2, 3]
    assert [p.reason for p in cm.checkpoint_map][:2] == ["layer_policies[0]", "layer_policies[1]"]
    assert_same_grads(ref, got)


def test_preserve_rng_state_is_what_makes_dropout_exact():
    """Without RNG replay the recompute draws new dropout masks: gradients differ. This proves the
    exactness tests above would catch a shim that forgot the RNG."""
    model = tiny_model("llama", attention_dropout=0.5)
    named = list(model.named_parameters())
    data = batch()
    _, ref = step_grads(model, named, data)
    cm = CheckpointedModel(model, CheckpointConfig(preserve_rng_state=False))
    _, got = step_grads(cm, named, data)
    with pytest.raises(AssertionError):
        assert_same_grads(ref, got)


def _gemma3n_text(kv_shared: int):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "gemma3n_text",
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=4,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
        laurel_rank=4,
        num_kv_shared_layers=kv_shared,
        sliding_window=4,
        activation_sparsity_pattern=[0.0] * 4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def test_reentrant_checkpointing_of_layers_that_share_keys_and_values_is_refused_and_non_reentrant_is_exact():
    """Gemma 3n's later layers read the keys and values earlier ones made (`num_kv_shared_layers`): reentrant
    checkpointing runs those without gradients, and 32 of 101 gradients were wrong with the loss right (helper-93;
    transformers' own reentrant checkpointing too). Refused before the forward; the default is exact."""
    from remat import ConfigError

    data = batch()
    reference = _gemma3n_text(2)
    expected_loss, expected = step_grads(reference, list(reference.named_parameters()), data)
    model = _gemma3n_text(2)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1, use_reentrant=True))
    with pytest.raises(ConfigError, match=r"use_reentrant=True would lose gradients of this model's shared keys"):
        cm(**data)
    cm.enable(use_reentrant=False)
    loss, grads = step_grads(cm, list(model.named_parameters()), data)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert_same_grads(expected, grads)


class _Block(torch.nn.Module):
    def __init__(self, returns: str):
        super().__init__()
        self.proj, self.returns, self.debug_seen = torch.nn.Linear(8, 8), returns, []

    def forward(self, x, bias=None, debug=False):
        self.debug_seen.append(debug)
        out = x + torch.tanh(self.proj(x + bias))
        return {"dict": {"hidden": out}, "list": [out]}.get(self.returns, out)


class _BiasedStack(transformers.PreTrainedModel):
    """Plain blocks given a learned bias by keyword (a tensor with a graph before the blocks, as cross-attention's
    encoder states are), returning a tensor or a dict."""

    config_class = transformers.PretrainedConfig

    def __init__(self, returns: str = "tensor"):
        super().__init__(transformers.PretrainedConfig())
        torch.manual_seed(0)
        self.bias = torch.nn.Parameter(torch.randn(8))
        self.layers = torch.nn.ModuleList([_Block(returns) for _ in range(3)])

    def forward(self, x, labels=None, debug=False):
        bias = self.bias * 2
        for layer in self.layers:
            x = layer(x, bias=bias, debug=debug)
            x = x["hidden"] if isinstance(x, dict) else x[0] if isinstance(x, list) else x
        return transformers.modeling_outputs.CausalLMOutput(loss=x.pow(2).mean())


def test_reentrant_plain_blocks_given_a_tensor_with_a_graph_by_keyword_are_exact():
    """The keyword went into a closure: torch's reentrant recompute backpropagated through it into the graph before
    the blocks at each layer, and the second layer's failed ("backward through the graph a second time")."""
    reference, model = _BiasedStack(), _BiasedStack()
    x = torch.randn(2, 8)
    _, expected = step_grads(reference, list(reference.named_parameters()), {"x": x})
    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=True))
    counter = RecomputeCounter(list(model.layers))
    _, got = step_grads(cm, list(model.named_parameters()), {"x": x})
    assert counter.counts == [2, 2, 2]
    assert_same_grads(expected, got, atol=0)


@pytest.mark.parametrize("returns", ["dict", "list"])
def test_reentrant_refuses_a_block_returning_a_dict_whose_weights_would_get_no_gradient(returns):
    """torch's reentrant checkpoint carries a graph only out of tensors returned directly or in a tuple: a dict's
    came out without one, and the blocks' weights silently got no gradient (a list's: torch's own error)."""
    model = _BiasedStack(returns=returns)
    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=True))
    with pytest.raises(ValueError, match=rf"layer 0 returns a {returns}.*Leave use_reentrant at its default"):
        cm(x=torch.randn(2, 8))
    reference = _BiasedStack(returns=returns)
    _, expected = step_grads(reference, list(reference.named_parameters()), {"x": torch.ones(2, 8)})
    cm.enable(CheckpointConfig())  # the default, non-reentrant: exact
    _, got = step_grads(cm, list(model.named_parameters()), {"x": torch.ones(2, 8)})
    assert_same_grads(expected, got, atol=0)


class _NormedStack(transformers.PreTrainedModel):
    config_class = transformers.PretrainedConfig

    def __init__(self):
        super().__init__(transformers.PretrainedConfig())
        torch.manual_seed(0)
        block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh())
        self.layers = torch.nn.ModuleList([block() for _ in range(3)])

    def forward(self, x, labels=None):
        for layer in self.layers:
            x = x + layer(x)
        return transformers.modeling_outputs.CausalLMOutput(loss=x.pow(2).mean())


@pytest.mark.parametrize("reentrant", [False, True])
def test_batch_norms_running_statistics_are_updated_once_a_step_and_left_as_they_were_by_measuring(reentrant):
    """torch's batch norm updates its running statistics without bumping their version, so a recompute went unseen
    and updated them a second time (the eval model then differed), and measuring steps left them changed. Put back
    after a recompute, they keep their version (torch's reentrant backward checks it: batch norm saves them)."""
    reference, model = _NormedStack(), _NormedStack()
    x = torch.randn(6, 8)
    _, expected = step_grads(reference, list(reference.named_parameters()), {"x": x})
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1, use_reentrant=reentrant))
    _, got = step_grads(cm, list(model.named_parameters()), {"x": x})
    assert_same_grads(expected, got, atol=0)
    buffers = lambda m: {n: b.clone() for n, b in m.named_buffers()}
    after_one_step = buffers(reference)
    assert after_one_step.keys() == buffers(model).keys()
    for name, value in buffers(model).items():
        torch.testing.assert_close(value, after_one_step[name], rtol=0, atol=0, msg=name)
    loss = lambda outputs, batch: outputs.loss
    cm.memory_report({"x": x * 3}, loss_fn=loss)
    cm.profile({"x": x * 3}, loss_fn=loss)
    for name, value in buffers(model).items():
        torch.testing.assert_close(value, after_one_step[name], rtol=0, atol=0, msg=name)
    for module in model.modules():  # frozen batch norm (as vision fine-tuning runs it): read only
        if isinstance(module, torch.nn.BatchNorm1d):
            module.eval()
    step_grads(cm, list(model.named_parameters()), {"x": x})
    for name, value in buffers(model).items():
        torch.testing.assert_close(value, after_one_step[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_blocks_keyword_named_as_an_option_of_torchs_checkpoint_reaches_the_block(reentrant):
    """Passed through torch's `checkpoint(**kwargs)`, a block's `debug=` was taken by torch as its own option (and
    `early_stop=` raised "got multiple values")."""
    model = _BiasedStack()
    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=reentrant))
    cm(x=torch.randn(2, 8), debug="the block's").loss.backward()
    assert [seen for layer in model.layers for seen in layer.debug_seen] == ["the block's"] * 6  # forward, recompute


def test_reentrant_transformers_layers_given_position_embeddings_with_a_graph_are_exact():
    """transformers passes its layers' keywords in a partial (on 5.2x with the layer as its first argument): a tuple
    of tensors with a graph (position embeddings scaled by a trained factor) was backpropagated through at each
    layer's recompute ("Trying to backward through the graph a second time")."""

    def scaled(model):
        model.rope_scale = torch.nn.Parameter(torch.tensor(1.5))
        model.model.rotary_emb.register_forward_hook(lambda m, a, out: tuple(t * model.rope_scale for t in out))
        return model

    reference, model = scaled(tiny_model()), scaled(tiny_model())
    _, expected = step_grads(reference, list(reference.named_parameters()), batch())
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1, use_reentrant=True))
    counter = RecomputeCounter(decoder_layers(model))
    _, got = step_grads(cm, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 1, 2, 3]
    assert "rope_scale" in got
    assert_same_grads(expected, got)
