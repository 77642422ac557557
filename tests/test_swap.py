"""Block swap: frozen weights in host memory between uses, exact, bounded by the slot pool."""

import collections
import copy
import weakref

import pytest
import torch
from conftest import (
    RecomputeCounter,
    add_lora,
    assert_same_grads,
    batch,
    decoder_layers,
    hook_snapshot,
    step_grads,
    tiny_model,
)

from remat import BlockSwapError, CheckpointConfig, CheckpointedModel
from remat.model import controller_of
from remat.testing import SimulatedTransport


def _lora_model(lora_dropout=0.1, **kwargs):
    model = add_lora(tiny_model(**kwargs), dropout=lora_dropout)
    return model, [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _swapped_weight_bytes(model, layers):
    """Bytes actually resident in the frozen weights of `layers`, read from their storages."""
    seen = {}
    for layer in layers:
        for p in layer.parameters():
            if not p.requires_grad:
                storage = p.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("every_n", [1, 2, 3])
@pytest.mark.parametrize("policy", ["recompute", "offload"])
def test_swap_gradients_equal_no_checkpointing(every_n, policy):
    model, named = _lora_model()
    ref_loss, ref = step_grads(model, named, batch())
    config = CheckpointConfig(every_n_layers=every_n, swap_layers=2, checkpoint_policy=policy, offload_min_bytes=0)
    cm = CheckpointedModel(model, config, offload_transport=SimulatedTransport())
    counter = RecomputeCounter(decoder_layers(model))
    loss, got = step_grads(cm, named, batch())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)
    swapped = [p.index for p in cm.checkpoint_map if p.swapped]
    assert swapped == [1, 3]
    assert set(swapped) <= set(counter.recomputed()), "a swapped layer is always recomputed"
    assert max(counter.counts) == 2, "no nested checkpoint"
    assert all(cm.swap_stats[i].fetches == 2 for i in swapped)  # forward, then the recompute


def test_spread_swap_with_every_n_2_checkpoints_the_swapped_odd_layers():
    """Unsloth's defect: spread puts swapped layers at odd indices, every_n=2 checkpoints even ones."""
    model, named = _lora_model()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2, swap_layers=2, swap_placement="spread"))
    counter = RecomputeCounter(decoder_layers(model))
    step_grads(cm, named, batch())
    assert counter.recomputed() == [0, 1, 2, 3]
    assert "always checkpointed" in cm.checkpoint_map[1].reason


def test_resident_swapped_weights_never_exceed_the_slot_pool():
    model, named = _lora_model(num_hidden_layers=6)
    layers = decoder_layers(model)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=6))
    swapper = controller_of(cm).swapper
    observed = []
    for layer in layers:
        first = next(iter(layer.children()))
        first.register_forward_pre_hook(lambda m, a: observed.append(_swapped_weight_bytes(model, layers)))
    at_rest = _swapped_weight_bytes(model, layers)
    for _ in range(2):
        step_grads(cm, named, batch())
    per_layer = swapper.layers[0].nbytes
    assert swapper.pool_bytes == 3 * per_layer  # prefetch depth 2, plus the layer running
    assert len(observed) == 24 and max(observed) <= swapper.pool_bytes + at_rest
    assert min(observed) >= per_layer, "the running layer's weights are resident"
    assert at_rest < per_layer / 100, "at rest the swapped weights occupy (almost) nothing"
    assert _swapped_weight_bytes(model, layers) == at_rest, "everything is released after backward"
    assert swapper.peak_resident_bytes == swapper.pool_bytes


def test_optimizer_steps_with_lora_leave_frozen_weights_bit_identical_and_train_lora():
    model, named = _lora_model()
    frozen_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    lora_before = {n: p.detach().clone() for n, p in named}
    params_before = list(model.parameters())
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[0, 2], every_n_layers=3))
    optimizer = torch.optim.AdamW([p for _, p in named], lr=1e-2)
    for seed in range(3):
        loss = cm(**batch(seed=seed)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()  # read while swapped: the true values
    assert all(torch.equal(state[k], v) for k, v in frozen_before.items())
    assert any(not torch.equal(p.detach(), lora_before[n]) for n, p in named)
    cm.disable()
    assert list(model.parameters()) == params_before and all(
        a is b for a, b in zip(model.parameters(), params_before, strict=True)
    )
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in frozen_before.items())


def test_disable_restores_state_dict_identity_and_hooks_exactly():
    model, named = _lora_model()
    hooks = hook_snapshot(model)
    data = batch()
    model.eval()
    with torch.no_grad():
        expected = model(**data).logits
    model.train()
    params = list(model.parameters())
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=3, swap_placement="tail"))
    step_grads(cm, named, data)
    cm.disable()
    assert hook_snapshot(model) == hooks
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert all(
        p.is_contiguous() and p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters()
    )
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**data).logits, expected)


def test_generation_with_swapped_layers_matches_the_bare_model():
    bare = tiny_model(seed=4).eval()
    prompt = batch(seed=2)["input_ids"][:, :4]
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        expected = bare.generate(prompt, **kwargs)
    model = tiny_model(seed=4).requires_grad_(False)  # a frozen model, as for inference
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=2))
    with torch.no_grad(), cm.for_inference():
        got = cm.generate(prompt, **kwargs)
    assert torch.equal(got, expected)
    assert controller_of(cm).swapper.resident_bytes == 0


def test_memory_report_shows_resident_weights_falling_for_swapped_layers():
    model, named = _lora_model(attention_dropout=0.0)
    frozen = sum(p.numel() * p.element_size() for p in decoder_layers(model)[1].parameters() if not p.requires_grad)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[1]))
    report = cm.memory_report(batch())
    weights = [layer.weight_bytes for layer in report.layers]
    assert weights[1] < weights[0] / 10
    assert report.layers[1].swapped and not report.layers[0].swapped
    assert report.layers[1].weight_fetches == 2 and report.layers[0].weight_fetches == 0  # forward, recompute
    assert report.layers[1].weight_bytes_fetched == 2 * frozen  # the layer's frozen weights, counted before wrapping
    assert report.swapped_weight_peak_bytes == frozen and report.swap_pool_bytes == 3 * frozen
    assert "block swap: swapped weights resident at peak" in str(report)
    assert cm.swap_stats[1].fetches == 0, "the report's step is not counted in the wrapper's sums"
    cm(**batch()).loss.backward()
    assert "2 (" in cm.summary()


def test_changing_the_swapped_layers_between_steps_moves_weights_home_first():
    model, named = _lora_model()
    ref_loss, ref = step_grads(model, named, batch())
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[0]))
    step_grads(cm, named, batch())
    cm.enable(cm.checkpoint_config.replace(swap_layers=[2, 3]))
    _, got = step_grads(cm, named, batch())
    assert_same_grads(ref, got)
    assert sorted(cm.swap_stats) == [2, 3]
    assert model.base_model.model.model.layers[0].mlp.up_proj.weight.untyped_storage().nbytes() > 4


@pytest.mark.parametrize(
    "config, message",
    [
        (CheckpointConfig(swap_layers=5), "more layers than the model has"),
        (CheckpointConfig(swap_layers=[1, 4]), "swap_layers names layer"),
    ],
)
def test_bad_swap_requests_are_clear_errors(config, message):
    model, _ = _lora_model()
    with pytest.raises(ValueError, match=message):
        CheckpointedModel(model, config)


def test_swapping_trainable_base_weights_is_refused_before_anything_moves():
    model = tiny_model()  # full fine-tuning: every weight trains
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    with pytest.raises(BlockSwapError, match=r"full fine-tuning.*swap_layers \(a list of the indices to swap, where"):
        CheckpointedModel(model, CheckpointConfig(swap_layers=1))  # a count: the way to leave a layer out is a list
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    cm = CheckpointedModel(model)
    with pytest.raises(BlockSwapError, match="full fine-tuning"):
        cm.enable(CheckpointConfig(swap_layers=1))
    assert (
        cm.checkpoint_config == CheckpointConfig()
        and [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    )


@pytest.mark.parametrize("how", ["torch.compile(cm.model)", "cm.model.compile()"])
def test_torch_compile_with_block_swap_trains_exactly_and_still_swaps(how):
    """torch.compile does not trace the swap's hooks (traced, pointing a parameter at a slot is
    a `set_` on a graph input, which inductor refused with an error that never named block
    swap): the compiled model trains exactly, step after step, and the swapped weights are still
    fetched before each use and back at rest after the step (read from their storages). Inductor
    compiles the layers not swapped (1 and 3), drawing dropout masks of its own: dropout is off."""
    model, named = _lora_model(attention_dropout=0.0, lora_dropout=0.0)  # inductor draws its own dropout masks
    reference, reference_named = _lora_model(attention_dropout=0.0, lora_dropout=0.0)
    layers = decoder_layers(model)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[0, 2]))
    at_rest = _swapped_weight_bytes(model, [layers[0], layers[2]])
    if how == "cm.model.compile()":
        cm.model.compile()
        compiled = cm.model
    else:
        compiled = torch.compile(cm.model)
    try:
        for seed in range(3):
            _, expected = step_grads(reference, reference_named, batch(seed=seed))
            assert_same_grads(expected, step_grads(compiled, named, batch(seed=seed))[1])
            assert _swapped_weight_bytes(model, [layers[0], layers[2]]) == at_rest
        assert {i: s.fetches for i, s in cm.swap_stats.items()} == {0: 6, 2: 6}  # forward and recompute, 3 steps
    finally:
        model.__dict__.pop("_compiled_call_impl", None)  # cm.model.compile() is undone here, by hand
        torch._dynamo.reset()


def _container_sizes(root, path="", seen=None, out=None, kinds=None):
    """len() of every list, dict, set and deque reachable from `root` through remat's own objects
    (not into tensors, modules or test doubles), keyed by path; `kinds` collects the types visited."""
    seen = set() if seen is None else seen
    out = {} if out is None else out
    if id(root) in seen or isinstance(root, (torch.Tensor, torch.nn.Module)):
        return out
    seen.add(id(root))
    if kinds is not None:
        kinds.add(type(root).__name__)
    if isinstance(root, (list, tuple, set, frozenset, collections.deque)):
        out[path] = len(root)
        for i, value in enumerate(list(root)):
            _container_sizes(value, f"{path}[{i}]", seen, out, kinds)
    elif isinstance(root, (dict, weakref.WeakValueDictionary)):
        out[path] = len(root)
        for key, value in list(root.items()):
            _container_sizes(value, f"{path}[{key!r}]", seen, out, kinds)
    elif type(root).__module__.startswith("remat.") and type(root).__module__ != "remat.testing":
        for name, value in getattr(root, "__dict__", {}).items():
            _container_sizes(value, f"{path}.{name}", seen, out, kinds)
    return out


def test_nothing_in_the_swapper_the_offloader_or_their_transports_grows_with_the_steps():
    model, named = _lora_model()
    config = CheckpointConfig(every_n_layers=2, swap_layers=[1, 3], checkpoint_policy="offload", offload_min_bytes=0)
    cm = CheckpointedModel(model, config, offload_transport=SimulatedTransport())
    controller = controller_of(cm)
    roots = {"swapper": controller.swapper, "offloader": controller.offloader}
    for _ in range(2):
        step_grads(cm, named, batch())
    kinds = set()
    before = _container_sizes(roots, kinds=kinds)
    assert {"CpuTransport", "SlotPool", "Schedule", "HostBuffers", "SwappedLayer"} <= kinds, "the walk reaches them all"
    for seed in range(6):
        step_grads(cm, named, batch(seed=seed))
    assert _container_sizes(roots) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_swap_is_exact_and_bounded():
    model = add_lora(tiny_model(attention_dropout=0.0)).cuda()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    data = {k: v.cuda() for k, v in batch().items()}
    _, ref = step_grads(model, named, data)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=3))
    for _ in range(2):
        _, got = step_grads(cm, named, data)
        assert_same_grads(ref, got)
    assert controller_of(cm).swapper.peak_resident_bytes <= controller_of(cm).swapper.pool_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_torch_compile_with_block_swap_trains_exactly():
    model = add_lora(tiny_model(attention_dropout=0.0), dropout=0.0).cuda()  # inductor draws its own dropout masks
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    data = {k: v.cuda() for k, v in batch().items()}
    _, expected = step_grads(model, named, data)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[0, 2]))
    compiled = torch.compile(cm.model)
    try:
        for _ in range(3):
            assert_same_grads(expected, step_grads(compiled, named, data)[1])
        assert controller_of(cm).swapper.resident_bytes == 0
    finally:
        torch._dynamo.reset()


def test_hooks_on_a_swapped_layer_read_its_weights_whenever_they_were_added():
    """The fetch was a pre-hook after the ones added before wrapping, the release a forward hook before the ones added
    after: those hooks read placeholder zeros (an activation-norm logger, a probe reading a weight)."""
    model, named = _lora_model()
    layer = decoder_layers(model)[1]
    weight = layer.mlp.down_proj.base_layer.weight
    true_norm = weight.norm().item()
    read = collections.defaultdict(list)

    def reader(when):
        return lambda module, *args: read[when].append(weight.norm().item())

    layer.register_forward_pre_hook(reader("pre, before wrapping"))
    layer.register_forward_hook(reader("post, before wrapping"))
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=2))
    assert cm.checkpoint_map[1].swapped
    layer.register_forward_pre_hook(reader("pre, after wrapping"))
    layer.register_forward_hook(reader("post, after wrapping"))
    step_grads(cm, named, batch())
    assert weight.norm().item() == 0, "the weight is swapped out between uses"
    assert len(read) == 4 and all(norms and set(norms) == {true_norm} for norms in read.values()), dict(read)


def test_a_swapped_weight_replaced_by_a_parametrization_after_wrapping_is_refused_not_trained_as_nan():
    """weight_norm added on a swapped layer's frozen weight made its parametrization from the placeholder zeros: the
    loss was nan from then on, with no error. The next forward is refused; disable() brings the weight home."""
    model, named = _lora_model()
    proj = decoder_layers(model)[1].mlp.down_proj.base_layer
    weight, kept = proj.weight, proj.weight.detach().clone()
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=2))
    losses = []  # functional_call's plain tensors in the weights' places, for one call, are no replacement
    for call in (cm, lambda **data: torch.func.functional_call(model, values, kwargs=data)):
        torch.manual_seed(0)
        losses.append(call(**batch()).loss)
    torch.testing.assert_close(*losses)
    torch.nn.utils.parametrizations.weight_norm(proj)
    with pytest.raises(BlockSwapError, match=r"parametrized or replaced.*weight_norm"):
        cm(**batch())
    cm.disable()
    assert torch.equal(weight, kept), "the swapped weight came home into its own Parameter"
    # spectral_norm keeps the Parameter object (set_ from its right_inverse of the placeholder): nan, silently
    proj = decoder_layers(model)[3].mlp.down_proj.base_layer
    cm.enable()
    torch.nn.utils.parametrizations.spectral_norm(proj)
    with pytest.raises(BlockSwapError, match="1 of its swapped weights were parametrized"):
        cm(**batch())


def test_a_cast_of_swapped_weights_data_after_wrapping_casts_their_host_copies():
    """`p.data = p.data.to(dtype)` on every weight (PEFT's prepare_model_for_kbit_training casts so) reached only the
    placeholders of swapped weights: the next forward failed in a matmul on mixed dtypes, state_dict kept the old."""
    model, _ = _lora_model(lora_dropout=0.0)
    reference = copy.deepcopy(model)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=2))
    for m in (model, reference):
        for param in m.parameters():
            param.data = param.data.to(torch.float64)
    name = "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight"
    assert model.state_dict()[name].dtype == torch.float64
    torch.testing.assert_close(model.state_dict()[name], reference.state_dict()[name], rtol=0, atol=0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ref_named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    for _ in range(2):
        loss, got = step_grads(cm, named, batch())
        ref_loss, ref = step_grads(reference, ref_named, batch())
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        assert_same_grads(ref, got)


@pytest.mark.parametrize("swap_tensors", [False, True], ids=["data", "swap_tensors"])
def test_to_on_a_swapped_layer_whose_module_holds_weights_beside_its_children_converts_them_all(swap_tensors):
    """A module holding a frozen weight of its own and children holding theirs (Qwen3-Next's GatedDeltaNet, Mamba's
    mixer, nn.MultiheadAttention): `.to()` hides the parent's weights while torch converts the children, whose check
    of the layer's weights then refused it (and `RematTrainer` with it, which moves the model). torch's
    swap_module_params_on_conversion swaps tensors, which bumps their versions: not a write either."""
    model, _ = _lora_model(lora_dropout=0.0)
    mlp = decoder_layers(model)[1].mlp
    mlp.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, mlp.down_proj.base_layer.out_features), requires_grad=False)
    mlp.register_forward_hook(lambda module, args, out: out * module.scale)
    reference = copy.deepcopy(model)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[1]))
    cm(**batch()).loss.backward()
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap_tensors)
    try:
        for m in (model, reference):
            m.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert mlp.scale.dtype == mlp.down_proj.base_layer.weight.dtype == torch.float64
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss, got = step_grads(cm, named, batch())
    ref_loss, ref = step_grads(reference, [(n, p) for n, p in reference.named_parameters() if p.requires_grad], batch())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert_same_grads(ref, got)


@pytest.mark.parametrize(
    "write",
    [
        lambda w: setattr(w, "data", torch.ones(w.shape, dtype=w.dtype)),
        lambda w: w.fill_(1.0),  # under no_grad: into the placeholder's one element
        lambda w: torch.nn.init.zeros_(w),
    ],
    ids=["new data", "fill_", "nn.init"],
)
def test_a_write_to_a_swapped_weight_at_rest_is_refused_not_lost(write):
    """Written between steps, the new values were overwritten by the next fetch of the host copy (the loss as if
    nothing was written; without remat it changes). Refused at the next forward and state_dict, and disable() then
    brings the true weights home."""
    model, _ = _lora_model()
    weight = decoder_layers(model)[1].mlp.down_proj.base_layer.weight
    kept = weight.detach().clone()
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=2))
    cm(**batch()).loss.backward()
    with torch.no_grad():
        write(weight)
    for refused in (lambda: cm(**batch()), model.state_dict):
        with pytest.raises(BlockSwapError, match=r"layer 1 .*1 of its swapped weights were written while at rest"):
            refused()
    cm.disable()
    assert torch.equal(weight, kept)


def test_a_swapped_layer_with_gradients_in_eval_mode_is_refused_not_silently_wrong():
    model, named = _lora_model()
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[1]))
    cm.for_inference()
    with pytest.raises(RuntimeError, match="eval mode with gradients enabled"):
        cm(**batch())
    with torch.no_grad():
        assert torch.isfinite(cm(**batch()).logits).all()
    cm.for_training()
    step_grads(cm, named, batch())


def test_disable_between_forward_and_backward_brings_weights_home_and_backward_still_works():
    model, named = _lora_model()
    ref_loss, ref = step_grads(model, named, batch())
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=2))
    for _, p in named:
        p.grad = None
    torch.manual_seed(123)
    loss = cm(**batch()).loss
    cm.disable()
    loss.backward()
    assert_same_grads(ref, {n: p.grad for n, p in named})


@pytest.mark.parametrize("evaluate", ["forward", "generate"])
def test_an_evaluation_under_inference_mode_leaves_the_next_training_step_exact(evaluate):
    """The slots an inference_mode forward made were inference tensors, kept in the pool: the next training steps
    failed ("Inplace update to inference tensor outside InferenceMode"), one per poisoned slot."""
    model, named = _lora_model()
    reference = copy.deepcopy(model)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[1, 2]), swap_mover=SimulatedTransport())
    with cm.for_inference(), torch.inference_mode():
        if evaluate == "forward":
            cm(**batch())
        else:
            prompt = batch()["input_ids"][:, :4]
            cm.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    for seed in (1, 2):
        _, expected = step_grads(
            reference, [(n, p) for n, p in reference.named_parameters() if p.requires_grad], batch(seed=seed)
        )
        assert_same_grads(expected, step_grads(cm, named, batch(seed=seed))[1])


def test_a_swapped_weight_made_trainable_is_refused_at_the_next_plan_and_forward_and_can_leave_the_swap():
    """Accepted, then trained: the optimizer's step failed in torch (the weight's data a placeholder), naming none."""
    model, _ = _lora_model()
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[1]))
    weight = decoder_layers(model)[1].mlp.gate_proj.weight
    weight.requires_grad_(True)
    with pytest.raises(BlockSwapError, match="made trainable after it was swapped"):
        cm.enable(every_n_layers=1)
    with pytest.raises(BlockSwapError, match="made trainable after it was swapped"):
        cm.enable(head="chunked")  # refused: the head it would plan is not kept either
    with pytest.raises(BlockSwapError, match="made trainable after it was swapped"):
        cm(**batch())
    weight.requires_grad_(False)
    cm.for_inference()
    cm.for_training()
    assert cm.checkpoint_map.head.policy == "plain" and cm(**batch()).logits is not None
    weight.requires_grad_(True)
    cm.enable(swap_layers=0)  # what the error says: leave the swap, then train it
    before = weight.detach().clone()
    cm(**batch()).loss.backward()
    torch.optim.SGD([weight], lr=1.0).step()
    assert weight.stride() == (weight.shape[1], 1) and not torch.equal(weight, before)


def _penalty_grads(call, named, data, create_graph):
    """A gradient penalty: the loss's gradients, then a backward through the loss plus their squares."""
    params = [p for _, p in named]
    for p in params:
        p.grad = None
    torch.manual_seed(123)  # the same dropout masks in every run
    loss = call(**data).loss
    grads = torch.autograd.grad(loss, params, create_graph=create_graph)
    if create_graph:
        (loss + 0.1 * sum((g**2).sum() for g in grads)).backward()
        return {n: p.grad.clone() for n, p in named}
    return dict(zip([n for n, _ in named], grads, strict=True))


def test_a_double_backward_through_a_swapped_layer_is_refused_and_the_next_steps_are_exact():
    """create_graph=True makes a graph that holds the fetched weights; the end of backward puts them back to host
    placeholders, so the second backward was silently wrong (8 of 16 LoRA gradients off). Refused instead; a
    first-order `autograd.grad` stays exact, and so does the next step."""
    model, named = _lora_model()
    reference = copy.deepcopy(model)
    ref_named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    data = batch()
    ref_first = _penalty_grads(reference, ref_named, data, create_graph=False)
    ref_loss, ref = step_grads(reference, ref_named, data)
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=2))
    with pytest.raises(BlockSwapError, match="create_graph=True"):
        _penalty_grads(cm, named, data, create_graph=True)
    assert_same_grads(ref_first, _penalty_grads(cm, named, data, create_graph=False))
    loss, got = step_grads(cm, named, data)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)
    assert _swapped_weight_bytes(model, decoder_layers(model)[1::2]) < 1024  # back at rest


def _repacking(linear):
    """A layer that replaces its weight's data on its first forward and reads it in the new layout from then on, as
    bitsandbytes' 4-bit Linear does on CPUs with avx512bf16 (`weight.data = packed`, its quant state marked)."""

    def forward(x):
        if not getattr(linear, "packed", False):
            linear.weight.data = linear.weight.data.t().contiguous()
            linear.packed = True
        return x @ linear.weight

    linear.forward = forward


def test_a_forward_that_replaces_a_swapped_weights_data_keeps_it_as_the_weight():
    """Put back to rest, the replaced data was lost: the next fetch brought the old layout back under the new
    state (0.57 off in the logits of bitsandbytes' 4-bit layers, for good, even after disable())."""
    model, named = _lora_model()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        for layer in decoder_layers(m):
            _repacking(layer.mlp.gate_proj)
    data = batch()
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=2))
    with torch.no_grad(), cm.for_inference():
        for _ in range(3):
            torch.testing.assert_close(cm(**data).logits, reference.eval()(**data).logits, rtol=1e-5, atol=1e-6)
    reference.train()
    ref_loss, ref = step_grads(reference, [(n, p) for n, p in reference.named_parameters() if p.requires_grad], data)
    loss, got = step_grads(cm, named, data)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_grads(ref, got)
    assert _swapped_weight_bytes(model, decoder_layers(model)[1::2]) < 1024  # the new data rests in host memory too
    pool = controller_of(cm).swapper.pool  # the old layout's slots are freed, not kept beside the new ones for good
    assert set(pool._free) == {layer.layout for layer in controller_of(cm).swapper.layers.values()}
    cm.disable()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(**data).logits, reference.eval()(**data).logits, rtol=1e-5, atol=1e-6)


def test_a_frozen_adapter_on_a_swapped_layer_stays_in_place_to_train_again_and_be_read():
    """An adapter frozen by `set_adapter` was swapped as if it were a base weight: setting it back failed the next
    step ("made trainable"), and `add_weighted_adapter` read its placeholders (zeros) into the new adapter."""
    from peft import LoraConfig, get_peft_model

    def build(copies=()):  # modules_to_save: a copy of down_proj, by a PEFT wrapper that is no tuner layer
        torch.manual_seed(0)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, modules_to_save=list(copies))
        model = get_peft_model(tiny_model(attention_dropout=0.0), lora)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name or "modules_to_save.default" in name:
                    param.add_(0.1)  # zeros read from placeholders would show
        torch.manual_seed(11)
        model.add_adapter("b", LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        model.set_adapter("b")  # "default" and its copy are frozen now
        return model

    reference, model = build(), build()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2, swap_layers=[1]))
    for each in (model, reference):
        each.add_weighted_adapter(["default", "b"], [1.0, 1.0], "w", combination_type="cat")
    for name, param in reference.named_parameters():
        if ".w." in name:
            assert torch.equal(model.get_parameter(name), param), name
    cm.disable()
    reference, model = build(["down_proj"]), build(["down_proj"])
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2, swap_layers=[1]))
    for adapter in ("default", "b"):  # each trains again, exactly, with layer 1's base weights still swapped
        for each in (model, reference):
            each.set_adapter(adapter)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        expected = step_grads(reference, [(n, p) for n, p in reference.named_parameters() if p.requires_grad], batch())
        assert_same_grads(expected[1], step_grads(cm, named, batch())[1])
    assert 1 in cm.swap_stats


def test_a_trainable_modules_to_save_copy_on_a_swapped_layer_is_an_adapter_not_a_trained_base_weight():
    """The trainable-weight check exempted tuner layers only: a `modules_to_save` copy that trains (its adapter
    active) refused construction as "full fine-tuning", though the swap itself leaves such copies in place."""
    from peft import LoraConfig, get_peft_model

    def build():
        torch.manual_seed(0)
        lora = LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0, modules_to_save=["down_proj"])
        return get_peft_model(tiny_model(attention_dropout=0.0), lora)

    reference, model = build(), build()
    assert any("modules_to_save.default" in n and p.requires_grad for n, p in model.named_parameters())
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2, swap_layers=[1]))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    expected = step_grads(reference, [(n, p) for n, p in reference.named_parameters() if p.requires_grad], batch())
    assert_same_grads(expected[1], step_grads(cm, named, batch())[1])
    assert 1 in cm.swap_stats
