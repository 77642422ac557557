"""Every route that turns checkpointing on or off changes the map and nothing else."""

import pytest
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, hook_snapshot, step_grads, tiny_model

from remat import CheckpointConfig, CheckpointedModel
from remat.compat.transformers_compat import (
    DISABLE_ROUTES,
    ENABLE_ROUTES,
    has_activation_checkpointing_names,
    routes_defined_on,
)


def _recomputed(cm, model):
    counter = RecomputeCounter(decoder_layers(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    step_grads(cm, named, batch())
    counter.remove()
    return counter.recomputed()


def _enable_routes(model):
    return [r for r in routes_defined_on(model) if r in ENABLE_ROUTES]


def _disable_routes(model):
    return [r for r in routes_defined_on(model) if r in DISABLE_ROUTES]


def _routes_transformers_defines():
    """The enable/disable methods of transformers' own PreTrainedModel, read from transformers."""
    import transformers

    names = [
        n for n in dir(transformers.PreTrainedModel) if n.endswith(("checkpointing_enable", "checkpointing_disable"))
    ]
    return sorted(n for n in names if not n.startswith("_") and callable(getattr(transformers.PreTrainedModel, n)))


def test_remat_takes_over_exactly_the_routes_transformers_defines():
    model = tiny_model()
    CheckpointedModel(model)
    taken = sorted(n for n, v in vars(model).items() if n.endswith(("_enable", "_disable")) and callable(v))
    assert taken == _routes_transformers_defines()
    assert len(taken) in (2, 4)


# The same call on an unwrapped model and on a wrapped one (every layer by default). Where
# transformers honours the call, remat checkpoints the same layers; where this transformers
# ignores an option (every_n_layers before 5.16) or refuses it, remat gives what the option says.
_CALLS = {
    "no arguments": ((), {}),
    "non-reentrant kwargs": ((), {"gradient_checkpointing_kwargs": {"use_reentrant": False}}),
    "every_n_layers=2 in the kwargs": (
        (),
        {"gradient_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": 2}},
    ),
    "every_n_layers=2 as a keyword": (
        (),
        {"every_n_layers": 2, "gradient_checkpointing_kwargs": {"use_reentrant": False}},
    ),
}


def _transformers_recomputes(args, kwargs, then_disable):
    model = tiny_model()
    try:
        model.gradient_checkpointing_enable(*args, **kwargs)
        if then_disable:
            model.gradient_checkpointing_disable()
        return _recomputed(model, model)
    except (TypeError, ValueError) as refused:  # this version does not take the option
        return refused


@pytest.mark.parametrize("then_disable", [False, True], ids=["enable", "enable then disable"])
@pytest.mark.parametrize("call", list(_CALLS))
def test_a_route_call_checkpoints_what_transformers_checkpoints_for_the_same_call(call, then_disable):
    args, kwargs = _CALLS[call]
    native = _transformers_recomputes(args, kwargs, then_disable)
    model = tiny_model()
    cm = CheckpointedModel(model)
    model.gradient_checkpointing_enable(*args, **kwargs)
    if then_disable:
        model.gradient_checkpointing_disable()
    got = _recomputed(cm, model)
    asked = [] if then_disable else ([0, 2] if "every_n_layers" in call else [0, 1, 2, 3])
    if isinstance(native, list) and (native == asked or "every_n_layers" not in call):
        assert got == native, f"transformers recomputes {native}, remat {got}"
    else:  # transformers ignores or refuses every_n_layers here; remat honours it on every version
        assert got == asked, f"transformers: {native!r}"
    assert got == asked


@pytest.mark.parametrize("where", ["kwargs_dict", "keyword"])
def test_enable_route_sets_every_n_layers(where):
    model = tiny_model()
    cm = CheckpointedModel(model)
    for route in _enable_routes(model):
        cm.enable(CheckpointConfig())
        kwargs_name = route.replace("_enable", "_kwargs")
        if where == "kwargs_dict":
            getattr(model, route)(**{kwargs_name: {"every_n_layers": 2}})
        else:
            getattr(model, route)(every_n_layers=2)
        assert cm.checkpoint_config.every_n_layers == 2, route
        assert _recomputed(cm, model) == [0, 2], route


def test_defaults_only_call_keeps_the_wrappers_config():
    model = tiny_model()
    config = CheckpointConfig(every_n_layers=3, layer_policies={1: "recompute"})
    cm = CheckpointedModel(model, config)
    for route in _enable_routes(model):
        kwargs_name = route.replace("_enable", "_kwargs")
        getattr(model, route)()
        getattr(model, route)(**{kwargs_name: {}}, every_n_layers=1, offload=False)
        getattr(model, route)(**{kwargs_name: {"use_reentrant": False, "every_n_layers": 1}})
        assert cm.checkpoint_config == config
        assert _recomputed(cm, model) == [0, 1, 3]


def test_non_default_checkpoint_options_update_the_config(remat_logs):
    model = tiny_model()
    cm = CheckpointedModel(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert cm.checkpoint_config.use_reentrant is True
    assert "use_reentrant False -> True" in remat_logs.text
    assert _recomputed(cm, model) == [0, 1, 2, 3]


def test_disable_routes_turn_every_layer_off_and_enable_brings_the_config_back():
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    for route in _disable_routes(model):
        getattr(model, route)()
        assert [p.policy for p in cm.checkpoint_map] == ["none"] * 4
        assert all(route in p.reason for p in cm.checkpoint_map)
        assert _recomputed(cm, model) == []
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        model.gradient_checkpointing_enable()
        assert _recomputed(cm, model) == [0, 2]


def test_is_checkpointing_properties_follow_the_map():
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    names = ["is_gradient_checkpointing"]
    if has_activation_checkpointing_names():
        names.append("is_activation_checkpointing")
    assert all(getattr(model, n) for n in names)
    model.gradient_checkpointing_disable()
    assert not any(getattr(model, n) for n in names)
    cm.enable()
    cm.for_inference()
    assert not any(getattr(model, n) for n in names)
    cm.for_training()
    assert all(getattr(model, n) for n in names)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"gradient_checkpointing_kwargs": {"determinism_check": "none"}}, ValueError),
        ({"gradient_checkpointing_kwargs": {"every_n_layer": 2}}, ValueError),
        ({"gradient_checkpointing_kwargs": {"every_n_layers": 0}}, ValueError),
        ({"gradient_checkpointing_kwargs": {"every_n_layers": "2"}}, TypeError),
        ({"gradient_checkpointing_kwargs": ["use_reentrant"]}, TypeError),
        ({"gradient_checkpointing_kwargs": {"every_n_layers": 2}, "every_n_layers": 3}, ValueError),
        ({"gradient_checkpointing_kwargs": {"offload": "yes"}}, TypeError),
        ({"use_reentrant": True}, TypeError),
    ],
)
def test_bad_route_calls_are_clear_errors_that_change_nothing(kwargs, error):
    model = tiny_model()
    config = CheckpointConfig(every_n_layers=2)
    cm = CheckpointedModel(model, config)
    before_map, before_hooks = cm.checkpoint_map, hook_snapshot(model)
    with pytest.raises(error) as info:
        model.gradient_checkpointing_enable(**kwargs)
    assert "gradient_checkpointing_enable" in str(info.value)
    assert cm.checkpoint_config == config and cm.checkpoint_map == before_map
    assert hook_snapshot(model) == before_hooks
    assert _recomputed(cm, model) == [0, 2]


def test_a_refused_enable_after_a_generation_toggle_says_checkpointing_is_still_off():
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    model.gradient_checkpointing_disable()  # what TRL does before generating
    with pytest.raises(ValueError, match=r"still OFF \(turned off by gradient_checkpointing_disable\(\)\)"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"determinism_check": "none"})
    assert cm.checkpoint_map.checkpointed == []
    model.gradient_checkpointing_enable()
    assert _recomputed(cm, model) == [0, 2]


def test_a_route_kept_by_other_code_after_disable_drives_the_new_wrapper_not_the_old():
    """TRL keeps the enable method it wraps; after cm.disable() and a new wrapper, calls through
    the kept route reach the model's current route."""
    model = add_lora(tiny_model())
    old = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    kept_enable, kept_disable = model.gradient_checkpointing_enable, model.gradient_checkpointing_disable
    old.disable()
    new = CheckpointedModel(model, CheckpointConfig(every_n_layers=3))
    kept_disable()
    assert new.checkpoint_map.checkpointed == []
    kept_enable()
    assert new.checkpoint_map.checkpointed == [0, 3] and not old.is_enabled
    new.disable()
    kept_enable()  # no wrapper at all: transformers' own method
    assert model.is_gradient_checkpointing


def test_repeated_route_calls_add_no_hooks():
    model = add_lora(tiny_model())
    cm = CheckpointedModel(model)
    model.gradient_checkpointing_enable()
    before = hook_snapshot(model)
    for _ in range(5):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.gradient_checkpointing_disable()
        cm.gradient_checkpointing_enable()
    assert hook_snapshot(model) == before


def test_routes_through_peft_model_and_wrapper_reach_the_map():
    peft_model = add_lora(tiny_model())
    cm = CheckpointedModel(peft_model)
    peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"every_n_layers": 2})
    assert _recomputed(cm, peft_model) == [0, 2]
    cm.gradient_checkpointing_enable(every_n_layers=3)
    assert _recomputed(cm, peft_model) == [0, 3]
    peft_model.base_model.model.gradient_checkpointing_disable()
    assert _recomputed(cm, peft_model) == []


def _quantized_8bit(folder):
    """A real 8-bit model: bitsandbytes runs on the CPU."""
    import bitsandbytes  # noqa: F401  (a test dependency: the quantized model needs it)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama", attention_dropout=0.0, hidden_size=64, intermediate_size=128).save_pretrained(folder)
    quantized = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu"
    )
    assert quantized.is_loaded_in_8bit
    return quantized


def test_peft_prepare_model_for_kbit_training_on_a_quantized_model(tmp_path):
    """PEFT's k-bit preparation calls gradient_checkpointing_enable; on a real 8-bit model
    that call must land in the map, with the user's every_n_layers."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    quantized = _quantized_8bit(tmp_path)
    cm = CheckpointedModel(quantized, CheckpointConfig(every_n_layers=2))
    prepare_model_for_kbit_training(quantized, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert cm.checkpoint_config.every_n_layers == 2
    peft_model = get_peft_model(quantized, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.train()
    counter = RecomputeCounter(decoder_layers(quantized))
    loss = cm(**batch()).loss
    loss.backward()
    assert counter.recomputed() == [0, 2]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in peft_model.named_parameters() if "lora_" in n)


def test_prepare_model_for_kbit_training_called_on_a_peft_model_over_a_quantized_model(tmp_path):
    """The same route, called on the PeftModel the wrapper holds (PEFT forwards the call)."""
    from peft import prepare_model_for_kbit_training

    peft_model = add_lora(_quantized_8bit(tmp_path))
    cm = CheckpointedModel(peft_model, CheckpointConfig(every_n_layers=3))
    prepare_model_for_kbit_training(peft_model, gradient_checkpointing_kwargs={"every_n_layers": 2})
    assert cm.checkpoint_config.every_n_layers == 2
    peft_model.train()
    counter = RecomputeCounter(decoder_layers(peft_model))
    cm(**batch()).loss.backward()  # PEFT made the embedding output require grad, so backward runs
    assert counter.recomputed() == [0, 2]


def test_a_toggle_repeated_in_a_loop_says_its_change_once_and_still_makes_it(remat_logs):
    """TRL disables and enables checkpointing around every generation: two INFO lines a step said nothing new after
    the first. The map still changes each time (the model's flag, and the layers a step recomputes)."""
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    counter = RecomputeCounter(decoder_layers(model))
    for _ in range(3):
        model.gradient_checkpointing_disable()
        assert not cm.checkpoint_map.checkpointed
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        counter.reset()
        step_grads(cm, list(cm.named_parameters()), batch())
        assert counter.recomputed() == [0, 2]
    said = [m for r in remat_logs.records if "changed the checkpoint map" in (m := r.getMessage())]
    routes = [m for m in said if m.startswith("gradient_checkpointing")]
    assert len(routes) == 2 and "gradient_checkpointing_disable" in routes[0], said
    for every_n in (1, 2, 1):  # a change that is not its cause's last one is said each time
        cm.enable(every_n_layers=every_n)
    enabled = [r.getMessage() for r in remat_logs.records if r.getMessage().startswith("enable() changed the check")]
    assert [m.count("every_n_layers") for m in enabled if "config" in m] == [1, 1, 1], enabled


def test_the_users_own_changes_between_a_routes_toggles_are_said_and_make_the_toggle_news_again(remat_logs):
    """The once-only rule for a route's toggles silenced the user's own enable() after a route's disable (wrapping
    had said that map), and a route's disable after the user changed the map."""
    model = tiny_model()
    cm = CheckpointedModel(model)
    model.gradient_checkpointing_disable()
    cm.enable()  # back on, by the user
    cm.enable(every_n_layers=2)
    model.gradient_checkpointing_disable()
    said = [r.getMessage() for r in remat_logs.records]
    assert [m.split(" changed")[0] for m in said if "changed the checkpoint map" in m] == [
        "enable()",
        "gradient_checkpointing_disable()",
        "enable()",
        "enable()",
        "gradient_checkpointing_disable()",
    ], said
