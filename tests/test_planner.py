"""`cm.plan_for_budget(batch, budget)`: the map it returns fits the budget and holds what it
predicted (checked with `memory_report`, an independent measurement), the smallest budget it
names is the smallest that works, and planning leaves the model as it was."""

import json
import re

import pytest
import torch
from conftest import add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model
from test_discovery import tiny_llava
from test_remote_code import _llava_batch

from remat import CheckpointConfig, CheckpointedModel
from remat.model import controller_of
from remat.planner import PlannedConfig


def _llama():
    model = add_lora(tiny_model(num_hidden_layers=6))
    return CheckpointedModel(model), batch(size=2, seq=32)


def _llava():
    model = tiny_llava()
    model.train()
    return CheckpointedModel(model), _llava_batch()


def _span(cm, data):
    """The held bytes of the smallest and of the largest plan (all recompute, all none)."""
    n = len(cm.checkpoint_map)
    low = cm.enable(CheckpointConfig(layer_policies=dict.fromkeys(range(n), "recompute"))).memory_report(data)
    high = cm.enable(CheckpointConfig(layer_policies=dict.fromkeys(range(n), "none"))).memory_report(data)
    cm.enable(CheckpointConfig())
    for p in cm.model.parameters():
        p.grad = None
    return low.device_bytes, high.device_bytes


@pytest.mark.parametrize("family", [_llama, _llava], ids=["llama-lora", "llava"])
@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.85])
def test_the_planned_map_fits_the_budget_and_holds_what_was_predicted(family, fraction):
    cm, data = family()
    low, high = _span(cm, data)
    budget = int(low + fraction * (high - low))
    planned = cm.plan_for_budget(data, budget, repeats=1)
    assert isinstance(planned, PlannedConfig) and planned.predicted_device_bytes <= budget
    cm.enable(planned)
    assert [p.policy for p in cm.checkpoint_map] == [c.policy for c in planned.choices]
    measured = cm.memory_report(data).device_bytes
    assert measured <= budget
    assert abs(measured - planned.predicted_device_bytes) <= 0.05 * planned.predicted_device_bytes


def test_a_budget_that_nothing_fits_names_the_smallest_one_that_does():
    cm, data = _llama()
    low, _ = _span(cm, data)
    with pytest.raises(ValueError, match=r"the smallest is (\d+) bytes") as info:
        cm.plan_for_budget(data, low // 2, repeats=1)
    smallest = int(re.search(r"the smallest is (\d+) bytes", str(info.value)).group(1))
    assert smallest == low
    planned = cm.plan_for_budget(data, smallest, repeats=1)
    assert {c.policy for c in planned.choices} == {"recompute"}
    with pytest.raises(ValueError, match="smallest is"):
        cm.plan_for_budget(data, smallest - 1, repeats=1)


def test_the_ends_of_the_range_give_all_none_and_all_recompute():
    cm, data = _llama()
    low, _ = _span(cm, data)
    assert {c.policy for c in cm.plan_for_budget(data, "1GiB", repeats=1).choices} == {"none"}
    assert {c.policy for c in cm.plan_for_budget(data, low, repeats=1).choices} == {"recompute"}


def test_swapped_layers_stay_checkpointed_and_a_cpu_model_gets_no_offload():
    cm = CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(swap_layers=[1]))
    planned = cm.plan_for_budget(batch(), "1GiB", repeats=1)
    assert [c.policy for c in planned.choices][1] != "none"
    assert [c.policy for c in planned.choices][:1] + [c.policy for c in planned.choices][2:] == ["none"] * 3
    assert "offload" not in {c.policy for c in planned.choices}
    assert "offload not considered: the model runs on the CPU" in str(planned)
    cm.enable(planned)
    assert cm.checkpoint_map[1].swapped and cm.checkpoint_map[1].checkpointed


def test_planning_leaves_the_model_as_it_was():
    cm, data = _llama()
    config = CheckpointConfig(every_n_layers=2)
    cm.enable(config)
    cm.model.gradient_checkpointing_disable()  # a route has checkpointing off
    named = [(n, p) for n, p in cm.model.named_parameters() if p.requires_grad]
    marker = torch.full_like(named[0][1], 7.0)
    named[0][1].grad = marker
    rng = torch.random.get_rng_state()
    mlp = decoder_layers(cm.model)[1].mlp  # counts its calls, as an MoE router counts tokens
    mlp.calls = 0
    mlp.register_buffer("seen", torch.zeros(1))

    def count(module, args):
        module.calls += 1
        module.seen += 1

    handle = mlp.register_forward_pre_hook(count)
    cm.plan_for_budget(data, "1GiB", repeats=1)
    handle.remove()
    assert mlp.calls == 0 and mlp.seen.item() == 0, "the measuring steps' counts were put back"
    assert cm.config == config and cm.checkpoint_map.checkpointed == [] and named[0][1].grad is marker
    assert all(p.grad is None for _, p in named[1:])
    assert torch.equal(torch.random.get_rng_state(), rng)
    cm.model.gradient_checkpointing_enable()
    assert cm.checkpoint_map.checkpointed == [0, 2, 4]
    reference = add_lora(tiny_model(num_hidden_layers=6))
    _, expected = step_grads(reference, [(n, p) for n, p in reference.named_parameters() if p.requires_grad], data)
    assert_same_grads(expected, step_grads(cm, named, data)[1])


def test_the_plan_prints_per_layer_and_is_a_config_like_any_other(tmp_path):
    cm, data = _llama()
    low, high = _span(cm, data)
    planned = cm.plan_for_budget(data, (low + high) // 2, repeats=1)
    text = str(planned)
    assert text.count("base_model.model.model.layers.") == 6 and "total (predicted)" in text and "budget" in text
    path = planned.save_pretrained(tmp_path)
    loaded = CheckpointConfig.from_pretrained(tmp_path)
    with open(path) as handle:
        assert loaded == planned and json.load(handle)["layer_policies"]
    cm.enable(loaded)
    cm.model.gradient_checkpointing_disable()
    cm.model.gradient_checkpointing_enable()  # a generation toggle: the plan comes back as it was
    assert [p.policy for p in cm.checkpoint_map] == [c.policy for c in planned.choices]


@pytest.mark.parametrize("budget, error", [("lots", ValueError), (-5, ValueError), (1.5, TypeError)])
def test_bad_budgets_are_clear_errors_that_change_nothing(budget, error):
    cm, data = _llama()
    with pytest.raises(error, match="budget"):
        cm.plan_for_budget(data, budget)
    assert cm.config == CheckpointConfig() and controller_of(cm).is_enabled


def test_planning_a_model_in_inference_mode_is_refused():
    cm, data = _llama()
    cm.for_inference()
    with pytest.raises(RuntimeError, match="for_training"):
        cm.plan_for_budget(data, "1GiB")


def test_choosing_keeps_the_last_offloaded_input_on_the_device():
    """The choice itself, on profiles given by hand (offload needs an accelerator to measure):
    with offload, the input of the last checkpointed layer stays on the device (measured so on the
    last layer), and a map whose last checkpointed layer is another offloaded one is predicted
    with that layer's input on the device."""
    from remat.planner import _fastest_fitting, _front
    from remat.policies import LayerProfile

    def _choose(profiles, options, budget, outside, names):
        alone = {p.index: p.held["none"] for p in profiles}  # the all-"none" run: as measured per layer here
        return _fastest_fitting(_front(profiles, options), profiles, budget, outside, names, alone)

    def profile(i, last):
        held = {"none": (100, 0), "recompute": (10, 0), "offload": ((10, 0) if last else (0, 10))}
        seconds = {"none": 0.0, "recompute": 1.0, "offload": 1.5}
        return LayerProfile(index=i, input_bytes=10, held=held, seconds=seconds)

    profiles = [profile(0, False), profile(1, False), profile(2, True)]
    outside, names = {False: 5, True: 5}, ["a", "b", "c"]
    everything = [["none", "recompute", "offload"]] * 3
    fastest = _choose(profiles, everything, 5 + 110, outside, names)  # one none, one recompute, one offload
    assert sorted(c.policy for c in fastest) == ["none", "offload", "recompute"]
    assert sum(c.device_bytes for c in fastest) == 110 and sum(c.seconds for c in fastest) == 2.5
    lone = _choose(profiles[:2], [["offload"], ["none"]], 1000, outside, names)
    assert [(c.policy, c.device_bytes, c.host_bytes) for c in lone] == [("offload", 10, 0), ("none", 100, 0)]
    # uncorrected, offloading layer 0 would fit 105 bytes; with its input on the device nothing does
    assert _choose(profiles[:2], [["offload", "recompute"], ["none"]], 5 + 100, outside, names) is None


def test_measuring_a_map_that_runs_out_of_memory_falls_back_to_groups_of_layers():
    """A device too small for "none" on more than two layers at once (an out-of-memory error
    injected by a hook, as CUDA raises it): the planner measures in groups and still plans."""
    cm, data = _llama()

    def small_device(module, args):
        if sum(p.policy == "none" for p in cm.checkpoint_map) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = cm.model.register_forward_pre_hook(small_device)
    planned = cm.plan_for_budget(data, "1GiB", repeats=1)
    handle.remove()
    assert any("measured in" in note and "groups" in note for note in planned.notes)
    policies = [c.policy for c in planned.choices]
    # every layer measured, so the fastest map is known; nothing checkpointed ran out of memory as a
    # whole, so that map is not offered: the fastest one left checkpoints one layer (recompute or
    # selective, whichever measured faster)
    assert policies.count("none") == len(policies) - 1, policies
    cm.enable(planned)
    measured = cm.memory_report(data).device_bytes  # measured in groups: within 5%, not exact
    assert abs(measured - planned.predicted_device_bytes) <= 0.05 * planned.predicted_device_bytes


def test_planning_leaves_the_offload_and_swap_counters_and_refuses_an_optimizer_in_backward():
    model = add_lora(tiny_model())
    cm = CheckpointedModel(model, CheckpointConfig(swap_layers=[1]))
    step_grads(cm, [(n, p) for n, p in model.named_parameters() if p.requires_grad], batch())
    fetches, peak = cm.swap_stats[1].fetches, controller_of(cm).swapper.peak_resident_bytes
    cm.plan_for_budget(batch(), "1GiB", repeats=1)
    assert cm.swap_stats[1].fetches == fetches and controller_of(cm).swapper.peak_resident_bytes == peak
    lora = next(p for n, p in model.named_parameters() if "lora_A" in n)
    lora.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(RuntimeError, match="post-accumulate-grad hook"):
        cm.plan_for_budget(batch(), "1GiB", repeats=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_budget_below_every_layer_recomputed_is_met_by_offloading_as_predicted():
    """On a device, offload frees what recompute cannot (the inputs go to host memory): a budget
    between all-offload and all-recompute is met with offloaded layers, the last one's input
    counted on the device (the correction the CPU only tests with a hand-built profile)."""
    model = add_lora(tiny_model(num_hidden_layers=6, hidden_size=256, intermediate_size=512)).cuda()
    cm = CheckpointedModel(model)
    data = {k: v.cuda() for k, v in batch(size=2, seq=256).items()}
    n = len(cm.checkpoint_map)
    low, _ = _span(cm, data)
    everything_offloaded = CheckpointConfig(layer_policies=dict.fromkeys(range(n), "offload"), offload_min_bytes=0)
    offloaded = cm.enable(everything_offloaded).memory_report(data).device_bytes
    assert offloaded < low, "offloading every layer holds less on the device than recomputing every layer"
    cm.enable(CheckpointConfig(offload_min_bytes=0))
    budget = (low + offloaded) // 2
    planned = cm.plan_for_budget(data, budget, repeats=1)
    assert "offload" in {c.policy for c in planned.choices}
    cm.enable(planned)
    measured = cm.memory_report(data).device_bytes
    assert measured <= budget
    assert abs(measured - planned.predicted_device_bytes) <= 0.05 * planned.predicted_device_bytes
