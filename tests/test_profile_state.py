"""A profile describes one state of the model, and plans are built on the wrapper as it is now.

Planning from a profile of another state (a cast, a frozen or new trainable parameter, another
adapter, another checkpoint implementation) is refused naming what changed; a plan keeps every
setting of the wrapper's current config that is not the per-layer policy choice, so applying it
never undoes block swap (checked by where the swapped weights live, not by a flag). Every bad
number given to the planner or a config is a ValueError."""

import gc

import pytest
import torch
from conftest import add_lora, batch, decoder_layers, tiny_model
from independent_memory import activation_bytes
from peft import LoraConfig

from remat import CheckpointConfig, CheckpointedModel, RematError, StaleProfileError
from remat.model import controller_of
from remat.planner.state import ModelState


def _profiled(optimizer=False, **config):
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(**config))
    data = batch(size=2, seq=16)
    opt = torch.optim.SGD([p for p in cm.parameters() if p.requires_grad], lr=0.1) if optimizer else None
    return cm, data, cm.profile(data, repeats=1, progress=False, optimizer=opt)


def _frozen_weights_resident(cm, index):
    """Bytes the frozen weights of layer `index` hold where the model runs, read from their storages."""
    seen = {}
    for p in decoder_layers(cm.model)[index].parameters():
        if not p.requires_grad:
            storage = p.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def test_planning_a_model_cast_since_the_profile_is_refused_naming_the_dtype():
    cm, data, profile = _profiled()
    assert profile.plan("1GiB").predicted_device_bytes > 0  # the same state: plans
    cm.to(torch.float64)
    for plan in (lambda: profile.plan("1GiB"), lambda: profile.frontier()):
        with pytest.raises(RematError, match=r"float32 .*now float64.*call cm\.profile\(batch\) again") as info:
            plan()
        assert isinstance(info.value, StaleProfileError) and isinstance(info.value, ValueError)
    fresh = cm.profile(data, repeats=1, progress=False)  # what the refusal asks for works
    planned = fresh.plan("1GiB")
    cm.enable(planned)
    measured = activation_bytes(cm, data)
    assert abs(measured - planned.predicted_device_bytes) <= 0.05 * planned.predicted_device_bytes


def test_a_parameter_frozen_or_an_adapter_switched_since_the_profile_is_refused():
    cm, _, profile = _profiled()
    lora = next(p for n, p in cm.model.named_parameters() if "lora_A" in n)
    lora.requires_grad_(False)
    with pytest.raises(StaleProfileError, match="1 no longer trainable"):
        profile.plan("1GiB")
    lora.requires_grad_(True)
    assert profile.plan("1GiB") is not None  # back in the state measured
    cm.model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(StaleProfileError, match=r"adapters were \['default'\], now \['default', 'other'\]"):
        profile.plan("1GiB")


def test_another_checkpoint_implementation_since_the_profile_is_refused():
    cm, _, profile = _profiled()
    cm.enable(CheckpointConfig(use_reentrant=True))
    with pytest.raises(StaleProfileError, match="use_reentrant was False, now True"):
        profile.plan("1GiB")


def test_another_attention_implementation_since_the_profile_is_refused():
    """Eager attention holds its scores for backward: a plan for SDPA's profile held 15% more than predicted."""
    cm, _, profile = _profiled()
    was = cm.model.config._attn_implementation
    cm.model.set_attn_implementation("sdpa" if was == "eager" else "eager")
    with pytest.raises(StaleProfileError, match=f"the attention implementation was '{was}', now"):
        profile.plan("1GiB")
    cm.model.set_attn_implementation(was)
    assert profile.plan("1GiB") is not None


def test_a_vision_language_models_text_attention_changed_since_the_profile_is_refused():
    """A sub-config's implementation alone (`{"text_config": "eager"}`) left the top one as it was, unrefused."""
    from test_discovery import tiny_llava
    from test_remote_code import _llava_batch

    model = tiny_llava()
    model.train()
    cm = CheckpointedModel(model)
    profile = cm.profile(_llava_batch(), repeats=1, progress=False)
    was = model.config.text_config._attn_implementation
    model.set_attn_implementation({"text_config": "sdpa" if was == "eager" else "eager"})
    with pytest.raises(StaleProfileError, match=f"text_config={was}"):
        profile.plan("1GiB")


def test_a_head_changed_since_the_profile_is_refused_both_ways_unless_the_profile_chooses_the_head():
    """The bytes outside the layers are the head's: a plain head's profile planned for a chunked head (or the other
    way) mispredicted the step's peak by 2.3x in a user's trial, silently."""
    cm, data, profile = _profiled(head="chunked", head_chunk_tokens=8)
    cm.enable(head="plain", head_chunk_tokens=None)
    with pytest.raises(StaleProfileError, match=r"the head was chunked\(8\), now plain"):
        profile.plan("1GiB")
    cm.enable(head="chunked", head_chunk_tokens=8)
    assert profile.plan("1GiB") is not None  # back in the state measured
    cm, data, profile = _profiled()  # the plain head
    cm.enable(head="chunked", head_chunk_tokens=16)
    with pytest.raises(StaleProfileError, match=r"the head was plain, now chunked\(16\)"):
        profile.frontier()
    fresh = cm.profile(data, repeats=1, progress=False)  # what the refusal asks for works
    planned = fresh.plan("1GiB")
    cm.enable(planned)
    measured = activation_bytes(cm, data)
    assert abs(measured - planned.predicted_device_bytes) <= 0.05 * planned.predicted_device_bytes
    cm, _, profile = _profiled(head="chunked")  # no chunk given: the profile prices the heads, its plans name one
    cm.enable(head="plain")
    assert profile.plan("1GiB").head in ("plain", "chunked")


def test_a_plan_is_built_on_the_current_config_and_keeps_its_settings():
    cm, _, profile = _profiled()
    cm.enable(CheckpointConfig(offload_min_bytes=12345, preserve_rng_state=False, every_n_layers=3))
    planned = profile.plan("1GiB")
    assert planned.offload_min_bytes == 12345 and not planned.preserve_rng_state and planned.every_n_layers == 3
    cm.enable(planned)
    assert cm.checkpoint_config.offload_min_bytes == 12345 and controller_of(cm).offloader.min_bytes == 12345


def test_a_swap_set_enabled_since_the_profile_is_refused_and_a_profile_under_it_keeps_the_weights_on_the_host():
    """Block swap's slots are held across the step (here 2 layers' frozen weights, about a third
    of the plan's held bytes): a profile without them would under-predict, so it is refused."""
    cm, data, profile = _profiled(optimizer=True)
    full = _frozen_weights_resident(cm, 1)
    cm.enable(CheckpointConfig(swap_layers=2))
    swapped = [p.index for p in cm.checkpoint_map if p.swapped]
    assert swapped == [1, 3] and _frozen_weights_resident(cm, 1) < full / 100
    for scope in ("activations", "step"):
        with pytest.raises(StaleProfileError, match=r"swapped layers were \[\], now \[1, 3\].*cm\.profile\(batch\)"):
            profile.plan("1GiB", scope=scope)
    assert [p.index for p in cm.checkpoint_map if p.swapped] == swapped, "the refusal changed nothing"
    planned = cm.profile(data, repeats=1, progress=False).plan("1GiB")  # measured under the swap set
    assert planned.swap_layers == 2
    assert all(planned.choices[i].policy != "none" for i in swapped), "a swapped layer is always checkpointed"
    cm.enable(planned)
    assert [p.index for p in cm.checkpoint_map if p.swapped] == swapped
    assert all(_frozen_weights_resident(cm, i) < full / 100 for i in swapped), "the swapped weights stay on the host"
    assert _frozen_weights_resident(cm, 0) == full
    # the slots the swapped layers' weights are fetched into were allocated before forward: the
    # allocator's count of what forward left does not see them; remat holds them in the plan
    measured = activation_bytes(cm, data) + len(swapped) * full
    assert abs(measured - planned.predicted_device_bytes) <= 0.05 * planned.predicted_device_bytes


def test_an_offload_threshold_changed_since_a_profile_that_measured_offload_is_refused():
    """Offload is measured only on an accelerator; the rule itself is checked on recorded states."""
    model = tiny_model()
    measured = ModelState.of(model, CheckpointConfig(), 4)
    now = ModelState.of(model, CheckpointConfig(offload_min_bytes=0), 4)
    assert now.offload_min_bytes == 0 and now.dtypes == (("float32", len(list(model.parameters()))),)
    assert measured.changes(now, measured_offload=True) == ["offload_min_bytes was 2097152, now 0"]
    assert measured.changes(now, measured_offload=False) == []  # on a CPU nothing was offloaded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_profile_of_the_model_on_another_device_is_refused():
    cm, data, profile = _profiled()
    cm.to("cuda")
    with pytest.raises(StaleProfileError, match=r"devices were cpu .*now cuda:0"):
        profile.plan("1GiB")


BAD_BUDGETS = [10**400, "9" * 400, "1" + "0" * 400 + "GiB", 2**63, float("inf"), float("nan"), float("-inf")]


@pytest.fixture(scope="module")
def profiled():
    return _profiled()


@pytest.mark.parametrize("budget", BAD_BUDGETS, ids=["int400", "str400", "str400GiB", "2**63", "inf", "nan", "-inf"])
def test_every_bad_budget_is_a_value_error_and_runs_nothing(profiled, budget):
    cm, data, profile = profiled
    forwards = []
    handle = cm.model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="budget"):
            profile.plan(budget)
    finally:
        handle.remove()
    assert forwards == []


@pytest.mark.parametrize("tokens", [10**400, 2**63, float("inf"), float("nan")], ids=["int400", "2**63", "inf", "nan"])
def test_every_bad_token_count_is_a_value_error(profiled, tokens):
    cm, data, profile = profiled
    with pytest.raises(ValueError, match="tokens"):
        profile.plan("1GiB", tokens=tokens)
    with pytest.raises(ValueError, match="tokens"):
        profile.frontier(tokens=tokens)


@pytest.mark.parametrize("value", [10**400, float("inf"), float("nan")], ids=["int400", "inf", "nan"])
@pytest.mark.parametrize("field", ["offload_min_bytes", "every_n_layers", "swap_layers"])
def test_every_bad_number_in_a_config_is_a_value_error(field, value):
    with pytest.raises(ValueError, match=field):
        CheckpointConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        CheckpointConfig.from_dict({field: value})


def test_embeddings_resized_since_the_profile_are_refused_naming_the_frozen_weight():
    """`resize_token_embeddings` under LoRA (chat tokens added) changes no dtype, device or trainable parameter: the
    profile planned the larger head at the smaller one's bytes (helper-89: 2.7-3.6x over a budget, measured)."""
    cm, _, profile = _profiled()
    vocab = cm.model.get_input_embeddings().weight.shape[0]
    cm.model.resize_token_embeddings(vocab + 2000)
    with pytest.raises(StaleProfileError, match=r"frozen parameters changed in name or shape \(resized embeddings"):
        profile.plan("1GiB")


def _bytes(profile):
    m = profile.measurements
    return m.outside, m.alone, [(layer.input_bytes, layer.held) for layer in m.layers]


def test_a_profile_in_a_process_that_froze_nothing_freezes_only_while_it_measures_and_measures_the_same():
    """The suite freezes what each test starts with (conftest.py), so remat's profile keeps that freeze; here, with
    nothing frozen, it collects and freezes for its own steps and leaves nothing frozen, with the same bytes."""
    data = batch(size=2, seq=8)
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        unfrozen = CheckpointedModel(add_lora(tiny_model(), dropout=0.0)).profile(data, repeats=1, progress=False)
        assert gc.get_freeze_count() == 0
    finally:
        gc.collect()
        gc.freeze()
    frozen = CheckpointedModel(add_lora(tiny_model(), dropout=0.0)).profile(data, repeats=1, progress=False)
    assert _bytes(unfrozen) == _bytes(frozen)
