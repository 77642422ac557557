"""for_inference / for_training: generation uses its cache, and round trips change nothing."""

import torch
from conftest import RecomputeCounter, add_lora, assert_same_grads, batch, decoder_layers, step_grads, tiny_model

from remat import CheckpointConfig, CheckpointedModel


class SequenceLengths:
    """Records the sequence length each call of layer 0 sees: 1 per new token means a cache."""

    def __init__(self, layer):
        self.lengths = []
        self._handle = next(iter(layer.children())).register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.lengths.append(hidden.shape[1])

    def remove(self):
        self._handle.remove()


def _generate(model, prompt):
    return model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
    )


def test_generation_under_for_inference_uses_the_cache_and_matches_the_bare_model():
    bare = tiny_model(seed=5).eval()
    prompt = batch(seed=9)["input_ids"][:, :5]
    with torch.no_grad():
        expected = _generate(bare, prompt)

    model = tiny_model(seed=5)
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    lengths = SequenceLengths(decoder_layers(model)[0])
    with torch.no_grad(), cm.for_inference():
        assert not model.training
        got = _generate(cm, prompt)
    lengths.remove()
    assert model.training, "leaving the with-block restores training"
    assert torch.equal(got, expected)
    assert lengths.lengths == [5] + [1] * 5, "each new token must be computed from the cache"


def test_round_trips_leave_map_config_and_behaviour_unchanged():
    model = add_lora(tiny_model())
    config = CheckpointConfig(every_n_layers=2, layer_policies={3: "recompute"})
    cm = CheckpointedModel(model, config)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    before_map = cm.checkpoint_map
    counter = RecomputeCounter(decoder_layers(model))
    _, first = step_grads(cm, named, batch())
    first_counts = list(counter.counts)
    for _ in range(5):
        assert cm.for_inference() is cm
        assert not model.training and not model.is_gradient_checkpointing
        assert cm.for_training() is cm
    counter.reset()
    _, again = step_grads(cm, named, batch())
    assert cm.checkpoint_map == before_map and cm.checkpoint_config == config
    assert counter.counts == first_counts == [2, 1, 2, 2]
    assert_same_grads(first, again, rtol=0, atol=0)


def test_training_mode_set_directly_after_for_inference_trains_with_the_map(remat_logs):
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    cm.for_inference()
    model.train()  # what Trainer does at every step, bypassing for_training()
    counter = RecomputeCounter(decoder_layers(model))
    step_grads(cm, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 2]
    assert "outside for_training" in remat_logs.text
    for _ in range(3):  # an evaluation loop that does this at every evaluation: said once, each time applied
        cm.for_inference()
        model.train()
        counter.reset()
        step_grads(cm, list(model.named_parameters()), batch())
        assert counter.recomputed() == [0, 2]
    assert remat_logs.text.count("outside for_training") == 1


def test_for_inference_keeps_the_map_and_for_training_reapplies_it_after_a_route_change():
    model = tiny_model()
    cm = CheckpointedModel(model)
    with cm.for_inference():
        model.gradient_checkpointing_enable(every_n_layers=3)  # e.g. a TRL toggle during generation
        assert not model.is_gradient_checkpointing
    counter = RecomputeCounter(decoder_layers(model))
    step_grads(cm, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 3] == cm.checkpoint_map.checkpointed


def test_a_forward_with_gradients_in_eval_mode_says_once_that_it_runs_no_checkpoint(remat_logs):
    """`from_pretrained` returns a model in eval mode; wrapped and trained so, no layer checkpoints (as in
    transformers), though the map says recompute: a warning, once per wrapper, and not in training mode or
    without gradients (evaluation)."""
    model = tiny_model().eval()
    cm = CheckpointedModel(model)
    with torch.no_grad():
        cm(**batch())
    assert "eval mode" not in remat_logs.text
    step_grads(cm, list(model.named_parameters()), batch())
    counter = RecomputeCounter(decoder_layers(model))
    step_grads(cm, list(model.named_parameters()), batch())
    assert counter.recomputed() == [], "eval mode: nothing checkpointed, as the warning says"
    assert remat_logs.text.count("in eval mode") == 1 and "cm.train() or cm.for_training()" in remat_logs.text
    cm.train()
    counter.reset()
    step_grads(cm, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 1, 2, 3] and remat_logs.text.count("in eval mode") == 1


def test_checkpointed_layers_in_eval_mode_inside_a_training_model_are_said_once(remat_logs):
    """A student built from a teacher's layers: `teacher.eval()` put them in eval mode, and they ran without their
    checkpoint (as in transformers) while the map and the model's mode said otherwise, with no word."""
    model = tiny_model()
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    layers = decoder_layers(model)
    layers[0].eval(), layers[2].eval()  # as another model sharing them would leave them
    counter = RecomputeCounter(layers)
    for _ in range(2):
        step_grads(cm, list(model.named_parameters()), batch())
    assert counter.counts == [2, 4, 2, 4], "layers 0 and 2 ran once a step"
    said = [line for line in remat_logs.text.splitlines() if "are in eval mode" in line]
    assert len(said) == 1 and "layers [0, 2]" in said[0] and "cm.train()" in said[0]
    cm.train()
    counter.reset()
    step_grads(cm, list(model.named_parameters()), batch())
    assert counter.recomputed() == [0, 1, 2, 3]


def test_no_eval_mode_warning_where_a_route_turned_checkpointing_off(remat_logs):
    """cm.train() would not checkpoint there either (the route's "off" holds until an enable)."""
    model = tiny_model().eval()
    cm = CheckpointedModel(model, CheckpointConfig(budget="1GiB"))
    model.gradient_checkpointing_disable()
    step_grads(cm, list(model.named_parameters()), batch())
    assert "eval mode" not in remat_logs.text
    model.gradient_checkpointing_enable()
    step_grads(cm, list(model.named_parameters()), batch())
    assert remat_logs.text.count("in eval mode") == 1


def test_the_wrappers_training_flag_is_the_models_mode(tmp_path):
    """`cm.training` read True inside `for_inference()` and False after `cm.eval(); cm.for_training()`."""
    model = add_lora(tiny_model())
    cm = CheckpointedModel(model)
    assert cm.training and model.training
    with cm.for_inference():
        assert not cm.training and not model.training
    assert cm.training
    cm.eval()
    assert not cm.training and not model.training
    cm.for_training()
    assert cm.training and model.training
    cm.train(False)
    assert not cm.training and not model.training
    cm.train()
    cm.save_pretrained(tmp_path)
    loaded = CheckpointedModel.from_pretrained(tiny_model(), tmp_path, is_trainable=False)
    assert not loaded.training and not loaded.model.training


def test_generation_in_train_mode_between_steps_keeps_its_cache_on_every_transformers_release():
    """TRL generates in train mode between steps, a route's disable around it; a swapped layer stays checkpointed
    through the disable. transformers before 5.24 dropped the KV cache of a flagged layer (and of the model that
    holds the layers) in train mode even under no_grad: other tokens on 4.57, a crash on 5.17."""
    bare = add_lora(tiny_model(seed=5, attention_dropout=0.0), dropout=0.0).eval()
    prompt = batch(seed=9)["input_ids"][:, :5]
    with torch.no_grad():
        expected = _generate(bare, prompt)
    for config, toggle in ((CheckpointConfig(swap_layers=2), True), (CheckpointConfig(every_n_layers=2), False)):
        cm = CheckpointedModel(add_lora(tiny_model(seed=5, attention_dropout=0.0), dropout=0.0), config)
        model, before = cm.model, cm.checkpoint_map
        step_grads(cm, [(n, p) for n, p in model.named_parameters() if p.requires_grad], batch())
        lengths = SequenceLengths(decoder_layers(model)[0])
        if toggle:
            model.gradient_checkpointing_disable()  # TRL's unwrap_model_for_generation
        assert model.training
        with torch.no_grad():
            got = _generate(model, prompt)
        lengths.remove()
        assert torch.equal(got, expected), config
        assert lengths.lengths == [5] + [1] * 5, "each new token from the cache"
        if toggle:
            model.gradient_checkpointing_enable()
        assert cm.checkpoint_map == before
