"""Block swap survives faults: exceptions in forward and in recompute, swap-set changes between
forward and backward, dtype moves, load_state_dict and PEFT merges (on the model and on a module
inside a swapped layer); and a long run keeps host memory flat. Every fault is followed by
training that is checked against an unwrapped model."""

import copy
import gc
import io
import os

import pytest
import torch
from conftest import RecomputeCounter, add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model

from remat import BlockSwapError, CheckpointConfig, CheckpointedModel
from remat.model import controller_of
from remat.testing import SimulatedTransport
from remat.transport import CpuTransport

SWAP = CheckpointConfig(every_n_layers=2, swap_layers=[1, 3], checkpoint_policy="offload", offload_min_bytes=0)


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _wrapped(config=SWAP, **kwargs):
    model = add_lora(tiny_model())
    return CheckpointedModel(model, config, offload_transport=SimulatedTransport(), **kwargs), model


def _reference_grads(data=None, prepare=None):
    model = add_lora(tiny_model())
    if prepare is not None:
        prepare(model)
    return step_grads(model, _trainable(model), data or batch())[1]


def _raise_on_call(module, calls):
    """A forward pre-hook on `module` that raises on its `calls`-th call (1-based)."""
    seen = [0]

    def hook(mod, args):
        seen[0] += 1
        if seen[0] == calls:
            raise RuntimeError("injected fault")

    return module.register_forward_pre_hook(hook)


@pytest.mark.parametrize(
    "where, calls",
    [("forward of layer 2", 1), ("recompute of layer 3", 2), ("recompute of layer 1", 2)],
)
def test_an_exception_in_forward_or_recompute_leaves_the_next_steps_exact(where, calls):
    """Every layer swapped, so the slots a failed step leaves held are all the pool has."""
    cm, model = _wrapped(SWAP.replace(swap_layers=4))
    layer = int(where.split()[-1])
    handle = _raise_on_call(next(iter(decoder_layers(model)[layer].children())), calls)
    with pytest.raises(RuntimeError, match="injected fault"):
        step_grads(cm, _trainable(model), batch())
    handle.remove()
    counter = RecomputeCounter(decoder_layers(model))
    for seed in (0, 1):
        counter.reset()
        _, got = step_grads(cm, _trainable(model), batch(seed=seed))
        assert_same_grads(_reference_grads(batch(seed=seed)), got)
        assert counter.recomputed() == [0, 1, 2, 3]
    assert controller_of(cm).swapper.resident_bytes == 0, "every slot went back after the step"


def test_a_failure_entering_the_recompute_bookkeeping_leaves_the_swap_ready(monkeypatch):
    """Saving a layer's buffers before its recompute can itself fail (out of memory in the
    copy): the swap's recompute state entered just before is left again, so later steps fetch
    their weights. The failed step's traceback is kept alive on purpose: nothing waits for a GC."""
    from remat.recompute import _LayerState

    cm, model = _wrapped(SWAP.replace(swap_layers=4))
    original, failures = _LayerState.kept, [0]

    def kept_failing_once(self):
        if failures[0] == 0:
            failures[0] += 1
            raise RuntimeError("injected: out of memory copying the layer's buffers")
        return original(self)

    monkeypatch.setattr(_LayerState, "kept", kept_failing_once)
    with pytest.raises(RuntimeError, match="injected") as failed:
        step_grads(cm, _trainable(model), batch())
    for seed in (0, 1):
        _, got = step_grads(cm, _trainable(model), batch(seed=seed))
        assert_same_grads(_reference_grads(batch(seed=seed)), got)
    assert failed.value is not None and failures == [1]


def _forward(cm, model):
    for _, p in _trainable(model):
        p.grad = None
    torch.manual_seed(123)
    return cm(**batch()).loss


def _grads(model):
    return {n: p.grad for n, p in _trainable(model)}


def test_a_checkpointed_layer_may_join_the_swap_between_forward_and_backward_exactly():
    cm, model = _wrapped()  # layer 2 is checkpointed: its recompute fetches whatever it needs
    loss = _forward(cm, model)
    cm.enable(cm.checkpoint_config.replace(swap_layers=[1, 2, 3]))
    loss.backward()
    assert_same_grads(_reference_grads(), _grads(model))


@pytest.mark.parametrize("forward_while", ["layer 2 not checkpointed", "the wrapper disabled"])
def test_a_layer_whose_weights_a_pending_backward_holds_cannot_join_the_swap(forward_while):
    config = SWAP.replace(layer_policies={2: "none"})
    cm, model = _wrapped(config)
    if forward_while == "the wrapper disabled":
        cm.disable()
    loss = _forward(cm, model)
    wanted = config.replace(swap_layers=[1, 2, 3])
    with pytest.raises(RuntimeError, match=r"cannot start swapping layers \[.*2.*\].*held by an autograd graph"):
        cm.enable(wanted)
    assert cm.checkpoint_config == config and cm.is_enabled == (forward_while != "the wrapper disabled")
    if cm.is_enabled:
        cm.enable(config.replace(swap_layers=[3]))  # bringing weights home is always safe
    loss.backward()
    assert_same_grads(_reference_grads(), _grads(model))
    del loss
    cm.enable(wanted)  # once the graph is gone, the layer may join
    assert_same_grads(_reference_grads(), step_grads(cm, _trainable(model), batch())[1])


def _state(model, *controllers):
    """What a refused swap must leave as it was: where every weight's data lives, each wrapper's map and config."""
    storages = {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()}
    return storages, [(repr(c.checkpoint_map), c.config, c.is_enabled, list(c.swapper.layers)) for c in controllers]


@pytest.mark.parametrize("first", ["disabled", "dropped"])
@pytest.mark.parametrize("swap_from", ["a new wrapper", "its enable()"])
def test_a_forward_owed_by_an_earlier_wrapper_keeps_another_from_swapping_its_layers(first, swap_from):
    """A forward under the first wrapper recomputes its layers in backward with that wrapper's swapper, which does
    not fetch weights another wrapper moved out (its recompute read placeholders, 0.1 off, silently): the swap is
    refused, changing nothing, until that backward has run. A second wrapper without swap meanwhile is exact."""
    cm1, model = _wrapped(CheckpointConfig())  # every layer recomputed, nothing swapped
    first_controller = controller_of(cm1)
    loss = _forward(cm1, model)
    if first == "disabled":
        cm1.disable()
    del cm1  # dropped: its controller, still installed, is taken over by the next wrapper
    wrap = lambda config: CheckpointedModel(model, config, offload_transport=SimulatedTransport())
    cm2 = wrap(CheckpointConfig()) if swap_from == "its enable()" else None
    controllers = [first_controller] + ([controller_of(cm2)] if cm2 is not None else [])
    before = _state(model, *controllers)
    with pytest.raises(BlockSwapError, match=r"swapping layers \[1, 3\].*Run that backward first"):
        wrap(SWAP) if cm2 is None else cm2.enable(SWAP)
    assert _state(model, *controllers) == before
    loss.backward()
    assert_same_grads(_reference_grads(), _grads(model))
    del loss
    cm2 = wrap(SWAP) if cm2 is None else cm2.enable(SWAP)  # that backward ran: the layers may join
    assert list(controller_of(cm2).swapper.layers) == [1, 3]
    assert_same_grads(_reference_grads(), step_grads(cm2, _trainable(model), batch())[1])


class CountingMover(CpuTransport):
    def __init__(self):
        super().__init__()
        self.copied = 0

    def host_copy(self, tensor):
        self.copied += tensor.numel()
        return super().host_copy(tensor)


def test_a_changed_swap_set_moves_only_the_layers_that_change():
    mover = CountingMover()
    cm, model = _wrapped(CheckpointConfig(swap_layers=[1]), swap_mover=mover)
    layers = decoder_layers(model)
    step_grads(cm, _trainable(model), batch())
    kept = [p.untyped_storage().data_ptr() for p in layers[1].parameters() if not p.requires_grad]
    per_layer = mover.copied
    cm.enable(cm.checkpoint_config.replace(swap_layers=[1, 2]))
    assert mover.copied == 2 * per_layer, "only layer 2's weights were copied to the host"
    assert [p.untyped_storage().data_ptr() for p in layers[1].parameters() if not p.requires_grad] == kept
    cm.enable(cm.checkpoint_config.replace(swap_layers=[2]))
    assert mover.copied == 2 * per_layer
    assert_same_grads(_reference_grads(), step_grads(cm, _trainable(model), batch())[1])


def test_to_bfloat16_and_back_converts_swapped_weights_too_and_stays_exact():
    cm, model = _wrapped()
    cm.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {v.dtype for v in model.state_dict().values() if v.is_floating_point()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.isfinite(cm(**batch()).logits).all()
    cm.to(torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    got = step_grads(cm, _trainable(model), batch())[1]
    assert_same_grads(_reference_grads(prepare=lambda m: m.to(torch.bfloat16).to(torch.float32)), got)
    cm.disable()
    assert {p.dtype for p in model.parameters()} == {torch.float32}, "no weight is left in another dtype"


def test_load_state_dict_writes_swapped_weights_and_assign_is_refused():
    cm, model = _wrapped()
    other = add_lora(tiny_model(seed=5))
    state = other.state_dict()
    model.load_state_dict(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    got = step_grads(cm, _trainable(model), batch())[1]
    assert_same_grads(step_grads(other, _trainable(other), batch())[1], got)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"assign=True\) would replace the parameters of layers \[1, 3\]"):
        model.load_state_dict(add_lora(tiny_model(seed=6)).state_dict(), assign=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


# Modules inside a swapped layer: layers[1].mlp is called without layers[1], and behaves as it does.
INSIDE = ("mlp", "self_attn", "mlp.down_proj", "mlp.down_proj.base_layer", "self_attn.k_proj", "input_layernorm")


def _modules_as_they_are(model):
    """Each module's attributes (by identity) and the keys of its hook dicts: what remat set on any of them."""
    return {
        name: (
            {k: id(v) for k, v in vars(module).items()},
            {k: tuple(v) for k, v in vars(module).items() if k.endswith("hooks") and isinstance(v, dict)},
        )
        for name, module in model.named_modules()
    }


def test_a_module_inside_a_swapped_layer_reads_its_true_weights_and_refuses_copies():
    cm, model = _wrapped()
    twin = add_lora(tiny_model())
    layer, twin_layer = decoder_layers(model)[1], decoder_layers(twin)[1]
    for name in INSIDE:
        state, expected = layer.get_submodule(name).state_dict(), twin_layer.get_submodule(name).state_dict()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected), name
        for copies in (copy.deepcopy, lambda m: torch.save(m, io.BytesIO())):
            with pytest.raises(TypeError, match=r"block swap keeps the frozen weights of layer 1"):
                copies(layer.get_submodule(name))
    adapter = copy.deepcopy(layer.self_attn.q_proj.lora_A)  # holds no swapped weight: copied as usual
    assert torch.equal(adapter.default.weight, twin_layer.self_attn.q_proj.lora_A.default.weight)
    whole = dict(model.named_parameters())
    name = next(n for n in whole if ".layers.1.mlp.up_proj." in n)
    # keep_vars too reads the true values (the Parameter holds a placeholder at rest: a save of it would be zeros)
    assert torch.equal(model.state_dict(keep_vars=True)[name], twin.state_dict()[name])
    assert torch.equal(model.state_dict()[name], twin.state_dict()[name])
    assert_same_grads(_reference_grads(), step_grads(cm, _trainable(model), batch())[1])


def test_load_state_dict_into_a_module_inside_a_swapped_layer_loads_exactly_and_assign_is_refused():
    model = add_lora(tiny_model())
    before = _modules_as_they_are(model)
    cm = CheckpointedModel(model, SWAP, offload_transport=SimulatedTransport())
    other = decoder_layers(add_lora(tiny_model(seed=5)))
    loads = [(1, "mlp"), (1, "self_attn.q_proj"), (3, "mlp.down_proj.base_layer"), (3, "post_attention_layernorm")]

    def load(m):
        for index, name in loads:
            decoder_layers(m)[index].get_submodule(name).load_state_dict(other[index].get_submodule(name).state_dict())

    load(model)
    for index, name in loads:
        state, expected = (layers[index].get_submodule(name).state_dict() for layers in (decoder_layers(model), other))
        assert all(torch.equal(state[k], v) for k, v in expected.items()), name
    assert_same_grads(_reference_grads(prepare=load), step_grads(cm, _trainable(model), batch())[1])
    mlp = decoder_layers(model)[1].mlp
    params, state = list(mlp.parameters()), {k: v.clone() for k, v in mlp.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"assign=True\) would replace the parameters of layers \[1\]"):
        mlp.load_state_dict(other[2].mlp.state_dict(), assign=True)
    assert all(a is b for a, b in zip(mlp.parameters(), params, strict=True))
    assert all(torch.equal(mlp.state_dict()[k], v) for k, v in state.items())
    cm.disable()
    assert _modules_as_they_are(model) == before


def test_to_dtype_on_a_module_inside_a_swapped_layer_converts_its_host_copies():
    model = add_lora(tiny_model())
    before = _modules_as_they_are(model)
    cm = CheckpointedModel(model, SWAP, offload_transport=SimulatedTransport())
    mlp = decoder_layers(model)[1].mlp
    mlp.to(torch.float64)
    dtypes = {k: v.dtype for k, v in model.state_dict().items() if ".layers.1." in k}
    assert {d for k, d in dtypes.items() if ".mlp." in k} == {torch.float64}
    assert {d for k, d in dtypes.items() if ".mlp." not in k} == {torch.float32}
    with torch.no_grad(), pytest.raises(RuntimeError):  # float32 activations into float64 weights, as unwrapped
        cm(**batch())
    assert {p.dtype for p in mlp.parameters()} == {torch.float64}, "the fetch kept the new dtype"

    def round_trip(m):
        decoder_layers(m)[1].mlp.to(torch.bfloat16).to(torch.float32)

    round_trip(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_same_grads(_reference_grads(prepare=round_trip), step_grads(cm, _trainable(model), batch())[1])
    cm.disable()
    assert _modules_as_they_are(model) == before


@pytest.mark.parametrize("merge", ["merge_and_unload", "merge_adapter"])
def test_merging_adapters_into_swapped_layers_is_refused_before_any_layer_merges(merge):
    cm, model = _wrapped()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"merging adapters .* Nothing was merged"):
        getattr(model, merge)()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert_same_grads(_reference_grads(), step_grads(cm, _trainable(model), batch())[1])
    cm.enable(cm.checkpoint_config.replace(swap_layers=0))
    merged = model.merge_and_unload()  # with the weights home, PEFT merges as usual
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def _rss_bytes():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_three_hundred_steps_with_offload_and_swap_keep_host_memory_flat():
    """A trend, not a timing: resident memory and live Python objects after warm-up stay level
    (a leak of one layer input or its host buffer per step would add 16 MiB over the measured
    window, one object per step 250 objects)."""
    model = add_lora(tiny_model(hidden_size=64, intermediate_size=96, attention_dropout=0.0))
    config = CheckpointConfig(every_n_layers=2, swap_layers=[1, 3], checkpoint_policy="offload", offload_min_bytes=0)
    cm = CheckpointedModel(model, config, offload_transport=SimulatedTransport())
    optimizer = torch.optim.SGD([p for _, p in _trainable(model)], lr=1e-3)
    data = batch(size=4, seq=64)
    rss, objects = [], []
    for step in range(300):
        loss = cm(**data).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
        if step >= 50 and step % 25 == 0:
            gc.collect()
            rss.append(_rss_bytes())
            objects.append(len(gc.get_objects()))
    assert controller_of(cm).swapper.resident_bytes == 0 and controller_of(cm).offloader.live_host_bytes() == {}
    assert max(rss[-3:]) - min(rss[:3]) < 12 * 2**20, [r // 2**20 for r in rss]
    assert max(objects[-3:]) - min(objects[:3]) < 100, objects


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_wrapped_cpu_model_moved_with_cuda_swaps_from_pinned_copies_exactly():
    cm, model = _wrapped()
    cm.cuda()
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert all(t.is_pinned() for entry in controller_of(cm).swapper.layers.values() for t in entry.host)
    cm.to(torch.bfloat16).to(torch.float32)  # dtype moves keep the host copies pinned
    assert all(t.is_pinned() for entry in controller_of(cm).swapper.layers.values() for t in entry.host)
    data = {k: v.cuda() for k, v in batch().items()}
    got = step_grads(cm, _trainable(model), data)[1]
    expected = _reference_grads(data, prepare=lambda m: m.cuda().to(torch.bfloat16).to(torch.float32))
    assert_same_grads(expected, got)


def test_adapters_load_into_a_model_with_swapped_layers_even_with_low_cpu_mem_usage(tmp_path):
    """PEFT's low_cpu_mem_usage loads adapter weights with assign=True: allowed, as they are not
    swapped weights (only those are refused)."""
    cm, model = _wrapped()
    other = add_lora(tiny_model(seed=4))
    CheckpointedModel(other, SWAP).save_pretrained(tmp_path / "other")
    model.load_adapter(str(tmp_path / "other"), adapter_name="second", low_cpu_mem_usage=True)
    model.train()  # PEFT puts the model in eval mode after loading an adapter for inference
    loaded = {n.replace(".second.", "."): p for n, p in model.named_parameters() if ".second." in n}
    expected = {n.replace(".default.", "."): p for n, p in other.named_parameters() if ".default." in n}
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert_same_grads(_reference_grads(), step_grads(cm, _trainable(model), batch())[1])


def test_moving_a_swapped_model_to_the_meta_device_is_refused_and_disable_still_works():
    """`model.to("meta")` failed in torch inside the swap (`set_data`: incompatible tensor type), leaving the swapped
    weights half converted, and `disable()` then failed the same way: the model was stuck."""
    cm, model = _wrapped()
    with pytest.raises(BlockSwapError, match=r"the meta device cannot hold .* call cm\.disable\(\)"):
        model.to("meta")
    cm.disable()  # the swapped weights come home from their host copies
    twin = add_lora(tiny_model())
    swapped = [n for n, p in model.named_parameters() if ".layers.1." in n and not p.requires_grad]
    assert swapped and all(torch.equal(model.get_parameter(n), twin.get_parameter(n)) for n in swapped)
    model.to("meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
