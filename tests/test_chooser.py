"""The planner's chooser is a pure function of measurements: tested here with hand-built
profiles and no model, as `remat.plan` is in test_plan.py."""

import itertools

import pytest

from remat import CheckpointConfig
from remat.planner.chooser import (
    Combination,
    Measurements,
    Outside,
    StepMemory,
    choose,
    combinations,
    frontier,
    smallest,
    undominated,
)
from remat.planner.profile import Profile
from remat.policies import LayerProfile


def layer(i, none=100, recompute=10, selective=40, offload=None, seconds=None, input_bytes=10):
    held = {"none": (none, 0), "recompute": (recompute, 0), "selective": (selective, 0)}
    if offload is not None:
        held["offload"] = offload
    seconds = seconds or {"none": 0.0, "recompute": 1.0, "selective": 0.4, "offload": 1.5}
    return LayerProfile(index=i, input_bytes=input_bytes, held=held, seconds={k: seconds[k] for k in held})


def measurements(layers, *, outside=(5, 5), alone=True, base=10.0, tokens=100, step=None):
    return Measurements(
        layers=tuple(layers),
        names=tuple(f"layers.{p.index}" for p in layers),
        options=tuple(tuple(p.held) for p in layers),
        outside=Outside(*outside),
        alone=tuple(p.held["none"] for p in layers) if alone else None,
        base_seconds=base,
        tokens=tokens,
        step=step,
    )


def _policies(plan):
    return [c.policy for c in plan.choices]


def test_the_fastest_map_that_fits_is_chosen_and_its_prediction_adds_up():
    m = measurements([layer(0), layer(1), layer(2)])
    # everything kept: 300 + 5; one layer selective saves 60 bytes for 0.4 s
    assert _policies(choose(m, 305)) == ["none"] * 3
    plan = choose(m, 304)
    assert sorted(_policies(plan)) == ["none", "none", "selective"]
    assert plan.activation_bytes == 5 + 100 + 100 + 40 and plan.seconds == pytest.approx(10.4)
    assert _policies(choose(m, 5 + 30)) == ["recompute"] * 3
    assert choose(m, 5 + 29) is None and smallest(m) == 35


def test_the_map_that_checkpoints_nothing_is_priced_by_its_own_run_or_not_offered():
    """Per layer, "none" holds 100 in mixed maps; with nothing checkpointed each holds 150 (as on
    transformers 4.57) and 3 outside: that map costs 303, not 5 + 200."""
    m = measurements([layer(0), layer(1)], outside=(5, 3))
    alone = Measurements(**{**m.__dict__, "alone": ((150, 0), (150, 0))})
    assert _policies(choose(alone, 302)) != ["none", "none"]
    everything = choose(alone, 303)
    assert _policies(everything) == ["none", "none"] and everything.activation_bytes == 303
    assert [c.device_bytes for c in everything.choices] == [150, 150] and everything.outside_bytes == 3
    hidden = Measurements(**{**m.__dict__, "alone": None})  # did not fit, or layers are swapped
    assert _policies(choose(hidden, 10**9)) != ["none", "none"]


def test_choosing_keeps_the_last_offloaded_input_on_the_device():
    """With offload, the input of the last checkpointed layer stays on the device (measured so on
    the last layer); a map whose last checkpointed layer is another offloaded one is predicted
    with that layer's input on the device."""
    seconds = {"none": 0.0, "recompute": 1.0, "offload": 1.5}

    def profile(i, last):
        held = {"none": (100, 0), "recompute": (10, 0), "offload": ((10, 0) if last else (0, 10))}
        return LayerProfile(index=i, input_bytes=10, held=held, seconds=seconds)

    def m(profiles, options):
        return Measurements(
            layers=tuple(profiles),
            names=("a", "b", "c")[: len(profiles)],
            options=tuple(tuple(o) for o in options),
            outside=Outside(5, 5),
            alone=tuple(p.held["none"] for p in profiles),
            base_seconds=0.0,
            tokens=1,
        )

    profiles = [profile(0, False), profile(1, False), profile(2, True)]
    fastest = choose(m(profiles, [["none", "recompute", "offload"]] * 3), 5 + 110)
    assert sorted(_policies(fastest)) == ["none", "offload", "recompute"]
    assert sum(c.device_bytes for c in fastest.choices) == 110 and fastest.seconds == 2.5
    lone = choose(m(profiles[:2], [["offload"], ["none"]]), 1000)
    assert [(c.policy, c.device_bytes, c.host_bytes) for c in lone.choices] == [("offload", 10, 0), ("none", 100, 0)]
    # uncorrected, offloading layer 0 would fit 105 bytes; with its input on the device nothing does
    assert choose(m(profiles[:2], [["offload", "recompute"], ["none"]]), 5 + 100) is None


def test_the_frontier_is_every_undominated_map_ascending_in_bytes_and_descending_in_time():
    m = measurements([layer(i) for i in range(4)])
    plans = frontier(m)
    sizes = [p.device_bytes for p in plans]
    times = [p.seconds for p in plans]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert all(a > b for a, b in itertools.pairwise(times))
    assert plans[0].device_bytes == smallest(m) and _policies(plans[-1]) == ["none"] * 4
    # every map of the front is on the frontier or beaten by one of it
    for c in combinations(m):
        total = c.device_bytes + c.owed_bytes + m.outside.checkpointing
        assert any(p.device_bytes <= total and p.seconds <= m.base_seconds + c.seconds + 1e-12 for p in plans)
    # each point is what `choose` gives at that budget
    for p in plans:
        assert choose(m, p.device_bytes).seconds == pytest.approx(p.seconds)


def test_undominated_keeps_per_amount_owed_the_strictly_faster_ones():
    found = [
        Combination(10, 0, 3.0, ("a",)),
        Combination(20, 0, 3.0, ("b",)),  # as slow, holds more: dropped
        Combination(30, 0, 1.0, ("c",)),
        Combination(20, 5, 3.0, ("d",)),  # owes: kept apart
    ]
    assert [c.policies for c in undominated(found)] == [("a",), ("c",), ("d",)]


def test_no_predicted_time_is_negative():
    cheap = {"none": 0.0, "recompute": -5.0, "selective": -5.0}  # noise, as a bad measurement gives
    m = measurements([layer(0, seconds=cheap), layer(1, seconds=cheap)], base=1.0)
    assert all(p.seconds >= 0 for p in frontier(m))
    assert choose(m, 10**9).seconds >= 0


def test_step_scope_adds_what_the_step_needs_besides_activations_by_the_last_layers_policy():
    step = StepMemory({("none", False): 900, ("none", True): 800, ("recompute", True): 1000, ("selective", True): 950})
    m = measurements([layer(0), layer(1)], step=step)
    plan = choose(m, 5 + 200 + 900, scope="step")
    assert _policies(plan) == ["none", "none"] and plan.peak_bytes == 5 + 200 + 900
    plan = choose(m, 5 + 200 + 899, scope="step")  # the last layer kept, the first one selective
    assert _policies(plan) == ["selective", "none"] and plan.activation_bytes == 5 + 140
    # keeping at least what recomputing keeps, it peaks at least where every layer recomputing does (a full
    # fine-tune's recomputes), above its last layer's extra: 5 + 40 + 100 + 800
    assert plan.device_bytes == plan.peak_bytes == 5 + 20 + 1000
    assert smallest(m, "step") == 5 + 20 + 1000
    assert _policies(choose(m, 5 + 20 + 1000, scope="step")) == ["selective", "none"]  # as small, and faster
    assert choose(m, 5 + 20 + 999, scope="step") is None
    unknown = measurements([layer(0), layer(1)], step=StepMemory({("recompute", True): 1000}))
    assert choose(unknown, 10**9, scope="step").peak_bytes == unknown.outside.not_checkpointing + 200 + 1000
    with pytest.raises(ValueError, match="did not measure"):
        choose(measurements([layer(0)]), 10**9, scope="step")
    with pytest.raises(ValueError, match="scope must be one of"):
        choose(m, 10**9, scope="everything")


def test_tokens_scale_activations_and_time_not_the_weights():
    step = StepMemory({("none", True): 1000})
    m = measurements([layer(0), layer(1)], base=10.0, tokens=100, step=step)
    double = m.scaled(200)
    assert double.tokens == 200 and double.base_seconds == 20.0
    assert double.layers[0].held["none"] == (200, 0) and double.layers[0].seconds["recompute"] == 2.0
    assert double.outside == Outside(10, 10) and double.step == step
    assert m.scaled(None) is m and m.scaled(100) is m
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tokens"):
            m.scaled(bad)


def test_tokens_with_a_second_length_fit_what_grows_with_its_square():
    """Bytes measured at 50 and 100 tokens: a figure that grows faster than the tokens is fitted
    as a*t + b*t**2 (attention scores), one that grows slower as a line (a fixed part)."""
    long = measurements([layer(0, none=300, recompute=100)], outside=(40, 40), tokens=100)
    short = measurements([layer(0, none=100, recompute=50)], outside=(30, 30), tokens=50)
    m = Measurements(**{**long.__dict__, "shorter": short})
    double = m.scaled(200)
    # none: 100 at 50, 300 at 100 -> a = 1, b = 0.02 -> 200 + 800 at 200
    assert double.layers[0].held["none"] == (1000, 0)
    assert double.layers[0].held["recompute"] == (200, 0)  # in proportion: a line through the origin
    assert double.outside == Outside(60, 60)  # 30 at 50, 40 at 100: a line with a fixed part
    assert double.shorter is None and double.layers[0].seconds["recompute"] == 2.0


def test_a_profile_plans_without_a_model_and_names_the_smallest_budget():
    m = measurements([layer(0), layer(1), layer(2)])
    profile = Profile(m, CheckpointConfig(), ("a note",), 0.0)
    planned = profile.plan(5 + 30)
    assert isinstance(planned, CheckpointConfig) and planned.layer_policies == {
        0: "recompute",
        1: "recompute",
        2: "recompute",
    }
    assert planned.predicted_device_bytes == 35 and planned.predicted_seconds == pytest.approx(13.0)
    assert "a note" in str(planned) and "total (predicted)" in str(planned)
    with pytest.raises(ValueError, match=r"the smallest is 35 bytes"):
        profile.plan(34)
    for budget in (0, -1):
        with pytest.raises(ValueError, match="budget"):
            profile.plan(budget)
    configs = profile.frontier()
    assert [c.predicted_device_bytes for c in configs] == sorted(c.predicted_device_bytes for c in configs)
    assert configs[-1].layer_policies == {0: "none", 1: "none", 2: "none"}
