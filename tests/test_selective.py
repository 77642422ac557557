"""The "selective" policy: projection and fused-attention outputs kept, the rest recomputed.

Exact fp32 gradients on every model family of the suite (MoE, VLM and remote code included),
alone, mixed with other policies (offload among them) and with block swap; what it
holds, measured against bytes counted by hand; and every route that asks for it."""

import pytest
import torch
from conftest import ARCHS, RecomputeCounter, add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model
from test_discovery import tiny_llava
from test_remote_code import _llava_batch, blocks, load_remote

from remat import CheckpointConfig, CheckpointedModel
from remat.testing import SimulatedTransport, trainer_checkpointing_args

SELECTIVE = CheckpointConfig(checkpoint_policy="selective")


def _exact(model, config, data=None, **wrapper):
    """One step wrapped, checked against one step of the same model unwrapped."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    data = data or batch()
    ref_loss, ref = step_grads(model, named, data)
    cm = CheckpointedModel(model, config, **wrapper)
    counter = RecomputeCounter(cm.layers)
    loss, got = step_grads(cm, named, data)
    counter.remove()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)
    return cm, counter


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_selective_gradients_equal_no_checkpointing_on_every_family(arch, lora):
    model = tiny_model(arch)  # attention and LoRA dropout on: the RNG is replayed
    model = add_lora(model) if lora else model
    cm, counter = _exact(model, SELECTIVE)
    assert counter.recomputed() == [0, 1, 2, 3]
    assert {p.policy for p in cm.checkpoint_map} == {"selective"}


def test_selective_mixes_with_the_other_policies_per_layer():
    config = CheckpointConfig(layer_policies={0: "selective", 1: "none", 2: "recompute", 3: "selective"})
    cm, counter = _exact(add_lora(tiny_model()), config)
    assert counter.recomputed() == [0, 2, 3]
    assert [p.policy for p in cm.checkpoint_map] == ["selective", "none", "recompute", "selective"]


@pytest.mark.parametrize("vision", ["selective", "recompute"])
def test_selective_on_a_vlm_covers_both_towers(vision):
    model = tiny_llava()
    model.train()
    config = CheckpointConfig(checkpoint_policy="selective", layer_policies={0: vision, 1: vision})
    cm, counter = _exact(model, config, _llava_batch())
    assert counter.recomputed() == [0, 1, 2, 3, 4]
    assert [p.policy for p in cm.checkpoint_map] == [vision, vision, "selective", "selective", "selective"]


@pytest.mark.parametrize("cls", ["RemoteForCausalLM", "RemoteOldForCausalLM"])
def test_selective_on_remote_code_blocks(tmp_path, cls):
    model = load_remote(tmp_path, cls)
    _, counter = _exact(model, CheckpointConfig(every_n_layers=2, checkpoint_policy="selective"))
    assert counter.recomputed() == [0, 2]


def test_selective_on_remote_moe_blocks_counts_the_router_once(tmp_path):
    plain = load_remote(tmp_path, num_experts=4, dropout=0.0)
    step_grads(plain, list(plain.named_parameters()), batch())
    expected = [b.mlp.tokens_per_expert.clone() for b in blocks(plain)]
    model = load_remote(tmp_path, num_experts=4, dropout=0.0)
    _, counter = _exact(model, SELECTIVE)  # a step without the wrapper, then one with it
    assert counter.recomputed() == [0, 1, 2, 3]
    assert all(torch.equal(b.mlp.tokens_per_expert, 2 * t) for b, t in zip(blocks(model), expected, strict=True))


def test_selective_beside_offloaded_layers_and_with_block_swap():
    offloaded = {0: "offload", 2: "offload"}
    config = CheckpointConfig(
        checkpoint_policy="selective", layer_policies=offloaded, offload_min_bytes=0, swap_layers=[1, 3]
    )
    transport = SimulatedTransport()
    cm, counter = _exact(add_lora(tiny_model()), config, offload_transport=transport)
    assert counter.recomputed() == [0, 1, 2, 3]
    assert [p.policy for p in cm.checkpoint_map] == ["offload", "selective", "offload", "selective"]
    assert [layer for op, layer in transport.log if op == "to_host"] == [0, 2], "selective inputs stay on the device"


def _held(policy):
    model = tiny_model(attention_dropout=0.0)
    cm = CheckpointedModel(model, CheckpointConfig(layer_policies={i: policy for i in range(4)}))
    return cm.memory_report(batch(size=2, seq=16))


def test_selective_holds_the_layer_input_and_the_outputs_of_its_projections():
    """Counted by hand for the tiny Llama (batch 2, 16 tokens, hidden 32, 4 heads of 8, 2 KV
    heads, MLP 48, fp32): the input and the outputs of q/k/v/o and of the three MLP projections.
    Norms, rotary, the attention core (scores, softmax, weighted values) and SiLU are recomputed."""
    b, s, h, kv, d, mlp = 2, 16, 32, 2, 8, 48
    projections = b * s * (h + 2 * kv * d + h) + b * s * (2 * mlp + h)
    expected = 4 * (b * s * h + projections)
    selective, recompute, none = _held("selective"), _held("recompute"), _held("none")
    assert [layer.device_bytes for layer in selective.layers] == [expected] * 4
    assert [layer.device_bytes for layer in recompute.layers] == [4 * b * s * h] * 4
    assert all(n.device_bytes > 2 * expected for n in none.layers)
    assert [layer.runs for layer in selective.layers] == [2, 2, 2, 2]


# -- routes and configuration ----------------------------------------------------------------------


def test_the_route_option_selective_chooses_the_policy():
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"selective": True})
    assert cm.checkpoint_config.checkpoint_policy == "selective" and cm.checkpoint_config.every_n_layers == 2
    assert [p.policy for p in cm.checkpoint_map] == ["selective", "none", "selective", "none"]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"selective": False})  # no wish
    assert cm.checkpoint_config.checkpoint_policy == "selective"


def test_a_foreign_context_fn_is_refused():
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    model = tiny_model()
    cm = CheckpointedModel(model)
    own = functools.partial(create_selective_checkpoint_contexts, lambda *a, **k: CheckpointPolicy.MUST_SAVE)
    for context_fn in (lambda: None, own):
        with pytest.raises(ValueError, match="does not take a context_fn"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"context_fn": context_fn})
    assert cm.checkpoint_config == CheckpointConfig()


@pytest.mark.parametrize("reentrant", [False, True])
def test_trls_selective_wrapper_selects_the_policy_even_from_a_reentrant_config(reentrant, remat_logs):
    """TRL's SFTTrainer wraps the model's enable method to pass its selective context with
    use_reentrant=False: that is remat's selective policy, non-reentrant."""
    trl_models = pytest.importorskip("trl.models")
    model = add_lora(tiny_model())
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2, use_reentrant=reentrant))
    trl_models.enable_selective_activation_checkpointing(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"selective": True})
    assert cm.checkpoint_config.checkpoint_policy == "selective" and not cm.checkpoint_config.use_reentrant
    assert "TRL's own policy keeps attention only" in remat_logs.text
    counter = RecomputeCounter(decoder_layers(model))
    step_grads(cm, [(n, p) for n, p in model.named_parameters() if p.requires_grad], batch())
    assert counter.recomputed() == [0, 2]


def test_trainer_gradient_checkpointing_kwargs_selective_reaches_the_map(tmp_path):
    from test_trainer import _dataset
    from transformers import TrainingArguments

    from remat import RematTrainer

    cm = CheckpointedModel(add_lora(tiny_model()))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        **trainer_checkpointing_args(True, {"selective": True, "every_n_layers": 2}),
    )
    counter = RecomputeCounter(decoder_layers(cm.model))
    RematTrainer(model=cm, args=args, train_dataset=_dataset()).train()
    assert cm.checkpoint_config.checkpoint_policy == "selective" and counter.recomputed() == [0, 2]


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(checkpoint_policy="selective", use_reentrant=True), "non-reentrant"),
        (dict(layer_policies={1: "selective"}, use_reentrant=True), "non-reentrant"),
        (dict(checkpoint_policy="none"), "checkpoint_policy must be one of"),
    ],
)
def test_configs_selective_cannot_run_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**config)


def test_the_policy_keeps_projections_and_fused_attention_and_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    from remat.policies._selective_ops import _keep_projections_and_attention

    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten._scaled_dot_product_efficient_attention):
        assert _keep_projections_and_attention(None, op) == CheckpointPolicy.MUST_SAVE
    for op in (aten.bmm.default, aten.silu.default, aten.mul.Tensor, aten.softmax.int, aten.native_dropout.default):
        assert _keep_projections_and_attention(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("through", ["a tensor sharing the storage", "a view"])
def test_a_layer_that_changes_a_kept_output_in_place_is_refused_naming_it(through):
    """In-place changes of a projection's output (some PEFT variants, some remote code): backward
    would get the changed value (torch's own check sees only changes through views; through the
    3-d output of a linear it would silently give wrong gradients). The forward refuses."""

    def change(module, args, out):
        (out if through == "a tensor sharing the storage" else out[..., :1]).add_(1.0)

    model = tiny_model(attention_dropout=0.0)
    decoder_layers(model)[2].mlp.down_proj.register_forward_hook(change)
    cm = CheckpointedModel(model, CheckpointConfig(layer_policies={2: "selective"}))
    with pytest.raises(RuntimeError, match=r"layer 2 changes in place .*layer_policies=\{2: 'recompute'\}"):
        cm(**batch())
    cm.enable(CheckpointConfig(layer_policies={2: "recompute"}))
    reference = tiny_model(attention_dropout=0.0)
    decoder_layers(reference)[2].mlp.down_proj.register_forward_hook(change)
    expected = step_grads(reference, list(reference.named_parameters()), batch())[1]
    assert_same_grads(expected, step_grads(cm, list(model.named_parameters()), batch())[1])


def test_a_policy_that_only_looks_like_trls_is_refused_trls_own_wrapper_is_recognised():
    """TRL is recognised by the mark it puts on the enable method it wraps, not by a module name."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    from trl.models.selective_activation_checkpointing import enable_selective_activation_checkpointing

    def policy_fn(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy_fn.__module__ = "trl.models.selective_activation_checkpointing"  # a name is not TRL
    model = tiny_model()
    cm = CheckpointedModel(model)
    lookalike = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    with pytest.raises(ValueError, match="does not take a context_fn"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"context_fn": lookalike})
    enable_selective_activation_checkpointing(model)
    model.gradient_checkpointing_enable()
    assert cm.checkpoint_config.checkpoint_policy == "selective"


def test_torchs_own_mutation_error_is_explained_by_the_selective_policy():
    """torch's check for a kept tensor changed in place has no attribute of its own; the message
    remat recognises (`transformers_compat.TORCH_SAC_MUTATED`) is checked against the error this
    torch really raises."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from remat.policies import policy

    def keep_mm(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def run(x, w):
        kept = torch.mm(x, w)
        return kept, kept.sin()

    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    context_fn = functools.partial(create_selective_checkpoint_contexts, keep_mm)
    kept, out = checkpoint(run, x, w, use_reentrant=False, context_fn=context_fn)
    with torch.no_grad():
        kept.add_(1.0)
    with pytest.raises(RuntimeError) as raised:
        out.sum().backward()
    explained = policy("selective").explain_recompute_error(raised.value, 3)
    assert explained is not None and "layer_policies={3: 'recompute'}" in str(explained)
    assert policy("selective").explain_recompute_error(RuntimeError("something else was mutated"), 3) is None


def test_on_a_torch_that_gives_the_policy_no_op_outputs_selective_is_refused_not_run_unguarded():
    """torch before 2.12 passes the policy no `op_output`: the in-place guard saw no kept output and never fired,
    so a layer changing one in place got wrong gradients without a word. Asked directly, through the seam torch
    calls (a context without the field, as those releases pass)."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from remat.errors import PolicyError
    from remat.policies._selective_ops import _KeptOutputs

    kept, a, b = _KeptOutputs(3), torch.ones(4, 4), torch.ones(4, 4)
    older = SimpleNamespace(is_recompute=False)
    with pytest.raises(PolicyError, match=r"needs torch >= 2.12.*give layer 3 another policy") as refused:
        kept(older, torch.ops.aten.mm.default, a, b)
    assert refused.value.layer == 3
    assert kept(older, torch.ops.aten.add.Tensor, a, b) is CheckpointPolicy.PREFER_RECOMPUTE  # nothing kept: runs
    newer = SimpleNamespace(is_recompute=False, op_output=a @ b)
    assert kept(newer, torch.ops.aten.mm.default, a, b) is CheckpointPolicy.MUST_SAVE and kept.kept
