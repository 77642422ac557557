"""A layer "selective" refuses (it changes in place an output the policy keeps for backward: Falcon's new decoder
architecture adds the attention's output into the MLP's with `+=`) is profiled without that option: the profile, its
plans, the frontier, the plot and a budget in the config work, and say once why; the other policies train exactly.
A user who asks for "selective" on such a layer is still refused, and any other PolicyError still reaches the user."""

import logging

import pytest
import torch
import transformers
from conftest import VOCAB, add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model
from torch import nn

from remat import CheckpointConfig, CheckpointedModel, PolicyError
from remat.planner.chooser import predicted
from remat.testing import measure_held_activations

NOTE = "selective not considered on"


def _falcon(seed: int = 0) -> nn.Module:
    """A tiny Falcon of the new decoder architecture, LoRA on its fused projection (B non-zero, dropout on)."""
    torch.manual_seed(seed)
    config = transformers.FalconConfig(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
        vocab_size=VOCAB,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return add_lora(model, target_modules=("query_key_value",))


def _trainable(model: nn.Module) -> list:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _plain_grads(model: nn.Module, data) -> dict:
    """One step's gradients without any checkpointing (before wrapping: a reference for the wrapped model)."""
    return step_grads(model, _trainable(model), data)[1]


@pytest.fixture(scope="module")
def falcon_profiled():
    model, data = _falcon(), batch(seq=16)
    expected = _plain_grads(model, data)
    cm = CheckpointedModel(model)
    return cm, data, expected, cm.profile(data, progress=False)


def test_a_falcon_profile_offers_no_layer_selective_and_says_so_once(falcon_profiled):
    _, _, _, profile = falcon_profiled
    m = profile.measurements
    for measured in (m, m.shorter):  # both lengths of the plain-text batch
        assert measured.options == (("none", "recompute"),) * 4
        assert all(set(layer.held) == set(layer.seconds) == {"none", "recompute"} for layer in measured.layers)
    assert m.time.selective_work is None and m.time.selective_flops is None  # no layer takes it: not counted
    notes = [note for note in profile.notes if note.startswith(NOTE)]
    assert notes == [
        "selective not considered on layers 0, 1, 2, 3: each changes in place an output that selective keeps for "
        "backward (aten.add_.Tensor), which selective refuses; those layers take one of the other policies"
    ], profile.notes
    assert not any("selective costs" in note for note in profile.notes)
    with pytest.raises(ValueError, match="one of each layer's options"):
        predicted(m, ["selective"] * 4)


def test_plans_frontier_and_plot_of_that_profile_train_as_without_checkpointing(falcon_profiled):
    cm, data, expected, profile = falcon_profiled
    frontier = profile.frontier()
    sizes = [p.predicted_device_bytes for p in frontier]
    assert len(frontier) >= 3 and sizes == sorted(sizes)
    assert {c.policy for c in frontier[0].choices} == {"recompute"}
    assert {c.policy for c in frontier[-1].choices} == {"none"}
    middle = profile.plan(sizes[len(sizes) // 2])
    assert {c.policy for c in middle.choices} == {"none", "recompute"}
    assert any(note.startswith(NOTE) for note in middle.notes) and NOTE in str(middle)
    figure = profile.plot(budget=sizes[len(sizes) // 2])
    assert type(figure).__name__ == "Figure"
    try:
        for planned in (frontier[0], middle, frontier[-1]):
            cm.enable(planned)
            assert [p.policy for p in cm.checkpoint_map] == [c.policy for c in planned.choices]
            assert_same_grads(expected, step_grads(cm, _trainable(cm.model), data)[1], rtol=1e-5)
    finally:
        cm.enable(CheckpointConfig())


def test_a_budget_in_the_config_trains_falcon_as_without_checkpointing(remat_logs):
    data = batch(seq=16)
    measuring = CheckpointedModel(_falcon())  # the budget: midway between every layer recomputed and none
    every = {
        policy: CheckpointConfig(layer_policies=dict.fromkeys(range(4), policy)) for policy in ("recompute", "none")
    }
    low, high = (measure_held_activations(measuring.enable(every[p]), data) for p in ("recompute", "none"))
    budget = (low + high) // 2
    model = _falcon()
    expected = _plain_grads(model, data)
    cm = CheckpointedModel(model, budget=budget, budget_scope="activations")
    got = step_grads(cm, _trainable(model), data)[1]
    assert_same_grads(expected, got, rtol=1e-5)
    policies = [p.policy for p in cm.checkpoint_map]
    assert set(policies) == {"none", "recompute"}, policies
    said = [r.getMessage() for r in remat_logs.records if r.name == "remat" and NOTE in r.getMessage()]
    assert len(said) == 1 and "layers 0, 1, 2, 3" in said[0], said


def test_asking_for_selective_on_such_a_layer_is_still_refused():
    data = batch(seq=16)
    cm = CheckpointedModel(_falcon(), CheckpointConfig(layer_policies={1: "selective"}))
    with pytest.raises(PolicyError, match=r"layer 1 changes in place .*layer_policies=\{1: 'recompute'\}"):
        cm(**data)
    cm.enable(CheckpointConfig(checkpoint_policy="selective"))
    with pytest.raises(PolicyError, match=r"layer 0 changes in place"):
        cm(**data)


def _changes_a_kept_output(module, args, out):
    out.add_(1.0)  # in place, on the output of a projection "selective" keeps


def test_only_the_layer_that_changes_a_kept_output_loses_selective(remat_logs):
    model, data = tiny_model(attention_dropout=0.0), batch(seq=16)
    decoder_layers(model)[2].mlp.down_proj.register_forward_hook(_changes_a_kept_output)
    expected = _plain_grads(model, data)
    cm = CheckpointedModel(model)
    profile = cm.profile(data, progress=False)
    m = profile.measurements
    for measured in (m, m.shorter):
        assert [("selective" in options) for options in measured.options] == [True, True, False, True]
        assert ["selective" in layer.held for layer in measured.layers] == [True, True, False, True]
        assert ["selective" in layer.seconds for layer in measured.layers] == [True, True, False, True]
    assert m.time.selective_work is not None  # counted on the layers that take it
    assert [note for note in profile.notes if note.startswith(NOTE)] == [
        "selective not considered on layer 2: it changes in place an output that selective keeps for backward "
        "(aten.add_.Tensor), which selective refuses; that layer takes one of the other policies"
    ]
    said = [r for r in remat_logs.records if NOTE in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    predicted(m, ["selective", "selective", "recompute", "selective"])  # the others still take it
    with pytest.raises(ValueError, match="one of each layer's options"):
        predicted(m, ["selective"] * 4)
    for planned in profile.frontier():
        cm.enable(planned)
        assert_same_grads(expected, step_grads(cm, _trainable(model), data)[1], rtol=1e-5)


@pytest.mark.parametrize(
    "error",
    [
        PolicyError("layer 1 cannot run this: a test's own error"),
        # the refusal's own form, naming a layer that does not run "selective" in that step
        PolicyError("layer 0 changes in place (aten.add_.Tensor)", layer=0, op="aten.add_.Tensor"),
    ],
)
def test_any_other_policy_error_still_reaches_the_user(error):
    model = tiny_model(attention_dropout=0.0)
    cm = CheckpointedModel(model)

    def other_error(module, args, out):
        if cm.checkpoint_map[1].policy == "selective" and cm.checkpoint_map[0].policy != "selective":
            raise error

    decoder_layers(model)[1].mlp.register_forward_hook(other_error)
    with pytest.raises(PolicyError) as raised:
        cm.profile(batch(), repeats=1, progress=False)
    assert raised.value is error
    assert cm.checkpoint_config == CheckpointConfig()  # the profile put the config back


def test_torchs_own_refusal_explained_in_backward_names_the_layer():
    """The refusal torch raises in backward (a kept tensor changed through a view), as the policy explains it,
    carries the layer the profile leaves "selective" out for."""
    from remat.compat.transformers_compat import TORCH_SAC_MUTATED
    from remat.policies import policy

    explained = policy("selective").explain_recompute_error(RuntimeError(TORCH_SAC_MUTATED), 3)
    assert isinstance(explained, PolicyError) and explained.layer == 3


def test_a_layer_refused_only_at_the_shorter_length_is_offered_selective_at_no_length():
    """The profile measures a second, shorter batch (for `tokens=`): a refusal found there holds at every length."""
    model = tiny_model(attention_dropout=0.0)

    def changes_a_kept_output_when_short(module, args, out):
        if out.shape[1] < 16:
            out.add_(1.0)

    decoder_layers(model)[2].mlp.down_proj.register_forward_hook(changes_a_kept_output_when_short)
    profile = CheckpointedModel(model).profile(batch(seq=16), repeats=1, progress=False)
    m = profile.measurements
    assert "selective" not in m.options[2] and "selective" not in m.shorter.options[2]
    assert all("selective" in m.options[i] for i in (0, 1, 3))
    for tokens in (None, 16, 64):
        with pytest.raises(ValueError, match="one of each layer's options"):
            predicted(m.scaled(tokens), ["recompute", "recompute", "selective", "recompute"])
