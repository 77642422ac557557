"""Time prices from counts: a profile prices a policy by the work it repeats (FLOPs, counted as
torch's `FlopCounterMode` counts them, plus bytes and op launches at the device's balance)
times one rate calibrated on the machine, so the plan at every budget does not move when the
wall clock does.

Checked against what shares no code with remat: `FlopCounterMode` over whole training steps
with and without a layer recomputed (what a recompute really repeats), and plans from a profile
whose timed steps were slowed on purpose (a hook that sleeps in some layers' forwards)."""

import contextlib
import itertools
import statistics
import time

import pytest
from conftest import batch, decoder_layers, tiny_model
from peft import LoraConfig, get_peft_model
from torch.utils.flop_counter import FlopCounterMode

from remat import CheckpointConfig, CheckpointedModel
from remat.loss import step_loss
from remat.planner.chooser import TimePrices, frontier, predicted
from remat.planner.timing import BALANCES, Balance, Counts, Work, _prices


def _partly_lora(layers: int = 4):
    """LoRA on the first half of the layers only: two kinds of layer, with different work."""
    model = tiny_model(num_hidden_layers=layers)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[0, 1])
    model = get_peft_model(model, lora)
    model.train()
    return model


def _step_flops(cm, data, policies):
    cm.enable(CheckpointConfig(layer_policies=policies))
    with FlopCounterMode(display=False) as counter:
        step_loss(cm.model, data, None).backward()
    cm.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def test_a_recompute_is_priced_by_the_flops_it_repeats_as_flopcountermode_counts_a_step():
    """FlopCounterMode over a whole step: recomputing layer i adds exactly the profile's count of
    what its recompute repeats (its forward, less the tail torch need not run again), and
    "selective" exactly its count of what selective repeats; identical layers share one count;
    a layer's recompute price is that count times the profile's one rate."""
    cm = CheckpointedModel(_partly_lora())
    data = batch(size=2, seq=16)
    profile = cm.profile(data, repeats=1, progress=False)
    prices = profile.measurements.time
    n = len(cm.checkpoint_map)
    nothing = _step_flops(cm, data, dict.fromkeys(range(n), "none"))
    for i in range(n):
        recomputed = _step_flops(cm, data, {**dict.fromkeys(range(n), "none"), i: "recompute"})
        selective = _step_flops(cm, data, {**dict.fromkeys(range(n), "none"), i: "selective"})
        assert recomputed - nothing == prices.flops[i] > 0, i
        assert selective - nothing == prices.selective_flops[i], i
        seconds = profile.measurements.layers[i].seconds
        assert seconds["recompute"] == pytest.approx(prices.seconds_per_flop * prices.work[i])
        assert seconds["selective"] == pytest.approx(prices.seconds_per_flop * prices.selective_work[i])
        assert prices.work[i] > prices.flops[i]  # the other ops' bytes and launches count too
    assert prices.flops[0] == prices.flops[1] > prices.flops[2] == prices.flops[3]  # LoRA adds work
    assert prices.work[0] == prices.work[1] > prices.work[2] == prices.work[3]
    assert all(0 < s < f for s, f in zip(prices.selective_flops, prices.flops, strict=True))  # eager attention's core


def _plans(profile, budgets):
    out = []
    for budget in budgets:
        try:
            out.append(tuple(c.policy for c in profile.plan(budget).choices))
        except ValueError:
            out.append(None)
    return out


def _same_plans(calm, busy) -> list[int]:
    """Two profiles give the same frontier and the same plan at 41 budgets spread over it."""
    smallest = calm.frontier()[0].predicted_device_bytes
    largest = calm.frontier()[-1].predicted_device_bytes
    budgets = [smallest + (largest - smallest) * k // 40 for k in range(41)]
    assert _plans(busy, budgets) == _plans(calm, budgets)
    maps = lambda profile: [[c.policy for c in p.choices] for p in profile.frontier()]
    assert maps(busy) == maps(calm)
    return budgets


def test_layers_slowed_in_some_timed_steps_change_no_plan_at_any_budget():
    """Two profiles of one model and batch, the second with the plain layers' forwards (less
    work than the LoRA layers') slowed by a sleep in two of its three repeats, as another
    process would: the same frontier and the same plan at every budget. (Before, each kind of
    layer was priced by its own median forward time: the slowed kind looked the dearer to
    recompute and was kept instead.)"""
    model = _partly_lora()
    layers = decoder_layers(model)
    cm = CheckpointedModel(model, CheckpointConfig(use_reentrant=True))  # none and recompute: counts decide
    data = batch(size=2, seq=16)
    calm = cm.profile(data, repeats=3, progress=False)

    steps = {"count": 0}
    outer = cm.model.register_forward_pre_hook(lambda *_: steps.__setitem__("count", steps["count"] + 1))
    memory_steps = 1 + 2 + 1 + 1  # every layer recomputed, two mixed maps, nothing checkpointed, the FLOP count

    def slow(module, args):
        timed = steps["count"] - memory_steps  # the timed steps come after the memory steps and the count
        if 0 < timed <= 4:  # the first two repeats of both timed maps
            time.sleep(0.05)

    handles = [layer.register_forward_pre_hook(slow) for layer in layers[2:]]
    busy = cm.profile(data, repeats=3, progress=False)
    for handle in [*handles, outer]:
        handle.remove()
    assert steps["count"] > memory_steps + 4

    budgets = _same_plans(calm, busy)
    assert len({_plans(calm, [b])[0] for b in budgets}) >= 3  # the budgets span several plans


def _runs(slow_share: float, slowed: int):
    """Hand-made timed steps of two identical layers: per step the map, its time, and per layer
    (forward, recompute) seconds; `slowed` of the steps have every call `slow_share` slower."""
    maps = [{0: "none", 1: "selective"}, {0: "selective", 1: "recompute"}, {0: "recompute", 1: "none"}]
    calls = {"none": [0.010, None], "selective": [0.012, 0.004], "recompute": [0.011, 0.010]}
    out = []
    for k in range(9):
        factor = 1 + slow_share if k < slowed else 1.0
        policies = maps[k % 3]
        layers = [[None if c is None else c * factor for c in calls[policies[i]]] for i in range(2)]
        out.append((policies, 0.100 * factor + 0.02, layers))
    return out


def test_selective_slowed_while_timed_changes_no_plan_at_any_budget(monkeypatch):
    """Selective's policy slowed on purpose (a sleep each time torch asks for its contexts, in
    the forward and the recompute) while one profile is timed, as a busy machine slows what
    happens to run: the same frontier and the same plan at every budget as a profile that ran
    undisturbed, selective included. (Before, what selective costs of a recompute was a timed
    ratio: 0.26, 1.35 and 2.13 in three profiles of one batch, and the plans moved with it.)"""
    from remat.planner import timing
    from remat.policies import _selective_ops

    # a device where op launches cost nothing: selective then repeats less than a recompute
    # and is on the frontier (on this CPU, tiny layers are all launches and it is not)
    monkeypatch.setitem(timing.BALANCES, "cpu", timing.Balance(8.0, 0.0, 0.0))
    cm = CheckpointedModel(_partly_lora())
    data = batch(size=2, seq=16)
    calm = cm.profile(data, repeats=2, progress=False)
    fresh = _selective_ops.fresh_contexts

    def slow(index):
        time.sleep(0.02)
        return fresh(index)

    monkeypatch.setattr(_selective_ops, "fresh_contexts", slow)
    busy = cm.profile(data, repeats=2, progress=False)
    monkeypatch.setattr(_selective_ops, "fresh_contexts", fresh)

    assert "selective" in {c.policy for p in calm.frontier() for c in p.choices}  # it is in play
    _same_plans(calm, busy)


def test_selective_costs_its_counted_work_however_slow_the_timed_steps():
    """The ratio of selective's price to a recompute's is counts alone: the same from calm steps
    and from steps a third of which ran twice as slow; the rate (a median over every timed
    layer call) moves by much less than the slowdown; the spread widens."""
    held = {"none": {0: (10, 0), 1: (10, 0)}, "selective": {0: (6, 0), 1: (6, 0)}, "recompute": {0: (1, 0), 1: (1, 0)}}
    names = ["none", "selective", "recompute"]
    forward = [Work(10**7, 10**5, 40, 60)] * 2
    counts = Counts(forward, [Work(9 * 10**6, 10**5, 38, 55)] * 2, [Work(10**5, 10**5, 36, 110)] * 2)
    balance = BALANCES["cpu"]
    calm = _prices(2, names, held, counts, balance, _runs(0.0, 0), [])
    busy = _prices(2, names, held, counts, balance, _runs(1.0, 3), [])
    ratio = lambda prices: prices[0]["selective"][0] / prices[0]["recompute"][0]
    policed = 110 * balance.flops_per_policed_op
    expected = (counts.selective[0].units(balance) + policed) / counts.recompute[0].units(balance)
    assert ratio(calm) == pytest.approx(expected) == pytest.approx(ratio(busy))
    assert calm[2].selective_share == pytest.approx(expected)
    assert 1.0 <= busy[2].seconds_per_flop / calm[2].seconds_per_flop < 1.2
    assert busy[2].spread() > calm[2].spread()


def _measurements_of(prices):
    from test_chooser import layer, measurements

    layers = []
    for i in range(3):
        seconds = {"none": 0.0, "selective": prices["selective"], "recompute": prices["recompute"], "offload": 0.0}
        layers.append(layer(i, seconds=seconds))
    rate = prices["recompute"] / 100
    time = TimePrices(
        (100,) * 3, (30,) * 3, (100.0,) * 3, (30.0,) * 3, rate, (rate * 0.5, rate * 2), (9.0, 12.0), 12, 9
    )
    m = measurements(layers, base=10.0)
    return type(m)(**{**m.__dict__, "time": time})


def test_predicted_step_time_is_a_monotone_function_of_the_policies_with_its_spread():
    """A map's prediction is the base plus each layer's price: moving any layer from "none" to
    "selective" to "recompute" never makes it faster; the spread contains the prediction and
    follows the rate's quartiles; the frontier is ascending in bytes and descending in time."""
    m = _measurements_of({"selective": 0.3, "recompute": 1.0})
    order = ["none", "selective", "recompute"]
    for policies in itertools.product(order, repeat=3):
        plan = predicted(m, policies)
        assert plan.seconds == pytest.approx(
            10.0 + sum({"none": 0, "selective": 0.3, "recompute": 1.0}[p] for p in policies)
        )
        low, high = plan.seconds_range
        assert low <= plan.seconds <= high
        added = plan.seconds - 10.0
        assert (low, high) == pytest.approx((9.0 + added * 0.5, 12.0 + added * 2))
        for i in range(3):
            rank = order.index(policies[i])
            for more in order[rank + 1 :]:
                heavier = list(policies)
                heavier[i] = more
                assert predicted(m, heavier).seconds >= plan.seconds
    times = [p.seconds for p in frontier(m)]
    assert times == sorted(times, reverse=True)


def test_the_plan_and_the_profile_show_the_spread():
    cm = CheckpointedModel(tiny_model(num_hidden_layers=2))
    profile = cm.profile(batch(), repeats=1, progress=False)
    assert any("ms per GFLOP of a layer's forward" in note for note in profile.notes)
    planned = profile.plan("1GiB")
    low, high = planned.predicted_seconds_range
    assert low <= planned.predicted_seconds <= high
    assert f"per step ({low * 1e3:.0f}-{high * 1e3:.0f})" in str(planned)


def test_the_demo_says_which_settings_the_machine_was_too_busy_to_rank():
    """Two settings whose middle halves overlap cannot be ranked by this run: named, with both
    spreads; a setting clearly apart is not."""
    from remat.demo import spread, unranked

    assert spread([0.9, 1.0, 1.1, 1.2, 5.0]) == (1.0, 1.2)  # one outlier does not widen it
    rows = [
        ("no checkpointing", 1.00, 10, (0.95, 1.10)),
        ("every layer", 1.40, 1, (1.35, 1.45)),
        ("every second layer", 1.05, 5, (1.00, 1.20)),
    ]
    (said,) = unranked(rows)
    assert said.startswith("no checkpointing and every second layer: 50 ms apart, within the spread")


def test_the_base_comes_from_the_steps_timed_without_the_layer_timers():
    """The layer timers' hooks cost time that no real step pays: steps timed with them (30 ms
    slower here) give the rate, and the step with nothing recomputed comes from the steps timed
    without them only, so the timers do not inflate every prediction."""
    held = {"none": {0: (10, 0), 1: (10, 0)}, "selective": {0: (6, 0), 1: (6, 0)}, "recompute": {0: (1, 0), 1: (1, 0)}}
    names = ["none", "selective", "recompute"]
    counts = Counts([Work(10**7)] * 2, [Work(9 * 10**6)] * 2, [Work(10**6)] * 2)
    balance = BALANCES["cpu"]
    plain_only = [(policies, seconds, None) for policies, seconds, _ in _runs(0.0, 0)]
    hooked = [(policies, seconds + 0.030, calls) for policies, seconds, calls in _runs(0.0, 0)]
    mixed = _prices(2, names, held, counts, balance, hooked + plain_only, [])
    hooked_only = _prices(2, names, held, counts, balance, hooked, [])
    assert mixed[2].seconds_per_flop == hooked_only[2].seconds_per_flop  # the rate: from the timed calls
    assert hooked_only[1] - mixed[1] == pytest.approx(0.030)
    expected = statistics.median(
        seconds - sum(mixed[0][p][i] for i, p in policies.items()) for policies, seconds, _ in plain_only
    )
    assert mixed[1] == pytest.approx(expected)


def test_every_other_timed_step_runs_without_the_layer_timers_and_none_runs_selective(monkeypatch):
    """A profile times each map both with the layer timers and without them, and no timer hook is
    left on any layer outside a timed step. The timed maps are every layer "none" and every layer
    "recompute" only: "selective" is priced by counts, and timed beside them, any error in its
    price went into the base of every map (on the tiny preset, 24 ms predicted for a 13 ms step)."""
    from remat.planner import measuring, timing

    hooked, plain, maps = [], [], []
    original = timing.LayerClock.step

    @contextlib.contextmanager
    def counting(self):
        with original(self):
            hooks = sum(len(m._forward_pre_hooks) for layer in self.layers for m in (layer, *layer.children()))
            hooked.append(hooks)
            yield

    monkeypatch.setattr(timing.LayerClock, "step", counting)
    cm = CheckpointedModel(_partly_lora())
    layers = decoder_layers(cm.model)
    before = sum(len(m._forward_pre_hooks) for layer in layers for m in (layer, *layer.children()))
    timed = measuring._Steps.timed

    def counted_timed(self, policies, within):
        if not isinstance(within, timing.FlopTally):
            maps.append(set(dict(policies).values()))
        if isinstance(within, contextlib.nullcontext):
            plain.append(sum(len(m._forward_pre_hooks) for layer in layers for m in (layer, *layer.children())))
        return timed(self, policies, within)

    monkeypatch.setattr(measuring._Steps, "timed", counted_timed)
    profile = cm.profile(batch(size=2, seq=16), repeats=2, progress=False)
    assert len(hooked) == len(plain) == 2  # 2 maps x 2 repeats, half of them each way
    assert all(count > before for count in hooked)
    assert plain == [before] * 2
    assert maps == [{"none"}, {"recompute"}] * 2  # every layer none, then every layer recomputed
    assert "selective" in profile.measurements.layers[0].seconds  # still priced (by counts)


def _whole_runs(base: float, per_recompute: float, jitter: float = 0.0):
    """Steps of two identical layers timed without the layer timers: every layer none, every layer
    recomputed, repeated, each `per_recompute` seconds a recomputed layer adds measured whole."""
    out = []
    for k in range(6):
        noise = jitter * (k % 3 - 1)
        out.append(({0: "none", 1: "none"}, base + noise, None))
        out.append(({0: "recompute", 1: "recompute"}, base + 2 * per_recompute + noise, None))
    hooked = [({0: "recompute", 1: "none"}, 0.5, [[0.010, 0.010], [0.010, None]])]  # the calls: 1 ms a GFLOP
    return hooked + out


def test_a_recompute_costs_what_it_adds_to_whole_steps_beyond_its_timed_calls():
    """The tiny preset's layers cost 4.4-4.9 ms a step each when recomputed, measured whole, where
    their timed calls priced 1.8 ms: torch's checkpoint hooks around the calls are in no timed call.
    The prices are scaled to what the steps timed whole show (here 30 ms a layer against 10 ms
    timed), so every map's prediction is the measured step; the ratio of any two prices stays
    their counts' (selective's to a recompute's), so the plans at every budget do not change."""
    held = {"none": {0: (10, 0), 1: (10, 0)}, "selective": {0: (6, 0), 1: (6, 0)}, "recompute": {0: (1, 0), 1: (1, 0)}}
    names = ["none", "selective", "recompute"]
    counts = Counts([Work(10**7)] * 2, [Work(10**7)] * 2, [Work(3 * 10**6)] * 2)
    balance = Balance(0.0, 0.0, 0.0)
    seconds, base, prices, notes = _prices(2, names, held, counts, balance, _whole_runs(0.100, 0.030), [])
    assert prices.whole == pytest.approx(3.0)
    assert seconds["recompute"] == {0: pytest.approx(0.030), 1: pytest.approx(0.030)}
    assert seconds["selective"][0] == pytest.approx(0.009)  # 0.3 of a recompute, counted
    assert base == pytest.approx(0.100)
    assert prices.seconds_per_flop * prices.work[0] == pytest.approx(0.030)
    assert "measured whole costs 3.00x its timed calls" in prices.summary()
    # a machine that slowed the recomputing steps moves the factor, never the ratio of two prices
    noisy = _prices(2, names, held, counts, balance, _whole_runs(0.100, 0.036, jitter=0.004), [])
    assert noisy[2].whole == pytest.approx(3.6)
    assert noisy[0]["selective"][0] / noisy[0]["recompute"][0] == pytest.approx(0.3)


def test_recomputing_measured_no_slower_whole_falls_back_to_the_timed_calls_and_says_so():
    held = {"none": {0: (10, 0), 1: (10, 0)}, "recompute": {0: (1, 0), 1: (1, 0)}}
    counts = Counts([Work(10**7)] * 2, [Work(10**7)] * 2, [])
    runs = _whole_runs(0.100, -0.005)
    seconds, _, prices, notes = _prices(2, ["none", "recompute"], held, counts, Balance(0.0, 0.0, 0.0), runs, [])
    assert prices.whole == 1.0 and seconds["recompute"][0] == pytest.approx(0.010)
    assert any("not measured slower" in note for note in notes)
