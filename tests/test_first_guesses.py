"""The lines a new user types first: keyword arguments where a config is expected, sizes as
people write them, and refusals that speak only of what the user did."""

import pytest
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, step_grads, tiny_model
from test_trainer import _dataset, _plain_args
from transformers import Trainer

from remat import CheckpointConfig, CheckpointedModel
from remat.arguments import parse_bytes
from remat.model import controller_of


def _recomputed(cm):
    counter = RecomputeCounter(decoder_layers(cm.model))
    step_grads(cm, [(n, p) for n, p in cm.model.named_parameters() if p.requires_grad], batch())
    counter.remove()
    return counter.recomputed()


# -- config fields as keywords -------------------------------------------------------------------


def test_config_fields_as_keywords_to_the_constructor_and_enable_change_what_runs():
    cm = CheckpointedModel(add_lora(tiny_model()), every_n_layers=2, checkpoint_policy="offload")
    assert cm.checkpoint_config == CheckpointConfig(every_n_layers=2, checkpoint_policy="offload")
    assert _recomputed(cm) == [0, 2]
    cm.enable(every_n_layers=3)  # the current config with that field changed
    assert cm.checkpoint_config == CheckpointConfig(every_n_layers=3, checkpoint_policy="offload")
    assert _recomputed(cm) == [0, 3]
    cm.enable(CheckpointConfig(layer_policies={1: "recompute"}), every_n_layers=4)
    assert cm.checkpoint_config == CheckpointConfig(every_n_layers=4, layer_policies={1: "recompute"})
    assert _recomputed(cm) == [0, 1]


def test_a_config_with_keywords_changes_those_fields_of_it():
    cm = CheckpointedModel(
        tiny_model(), CheckpointConfig(every_n_layers=2, checkpoint_policy="offload"), every_n_layers=3
    )
    assert cm.checkpoint_config == CheckpointConfig(every_n_layers=3, checkpoint_policy="offload")


@pytest.mark.parametrize("where", ["constructor", "enable"])
def test_a_misspelt_keyword_is_a_type_error_naming_the_field_meant_and_nothing_changes(where):
    model = tiny_model()
    if where == "constructor":
        with pytest.raises(
            TypeError, match=r"CheckpointedModel\(\).*'every_n_layer' \(did you mean every_n_layers=\?\)"
        ):
            CheckpointedModel(model, every_n_layer=2)
        assert "_remat_owner" not in model.__dict__
        return
    cm = CheckpointedModel(model, every_n_layers=2)
    with pytest.raises(TypeError, match=r"enable\(\).*'every_n_layer' \(did you mean every_n_layers=\?\).*offload"):
        cm.enable(every_n_layer=3)
    with pytest.raises(ValueError, match="every_n_layers"):
        cm.enable(every_n_layers=0)
    assert cm.checkpoint_config == CheckpointConfig(every_n_layers=2) and cm.checkpoint_map.checkpointed == [0, 2]


# -- sizes -----------------------------------------------------------------------------------------

GIB = 2**30


@pytest.mark.parametrize(
    "size, expected",
    [
        ("6G", 6 * GIB),
        ("6g", 6 * GIB),
        ("6 GiB", 6 * GIB),
        ("6gib", 6 * GIB),
        ("6Gi", 6 * GIB),
        ("6144M", 6 * GIB),
        ("6144 MiB", 6 * GIB),
        ("1.5G", 3 * GIB // 2),
        ("512K", 512 * 1024),
        ("6GB", 6 * 10**9),
        ("6 GB", 6 * 10**9),
        ("6gb", 6 * 10**9),
        ("6000MB", 6 * 10**9),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_sizes_in_the_forms_people_write_them(size, expected):
    assert parse_bytes(size, "budget") == expected


def test_a_size_the_wrapper_is_given_as_6G_is_6_GiB():
    cm = CheckpointedModel(tiny_model(), CheckpointConfig(checkpoint_policy="offload"), offload_host_budget="6G")
    assert controller_of(cm).offloader.max_host_bytes == 6 * GIB


def test_a_size_refused_says_what_G_and_GB_mean():
    with pytest.raises(ValueError) as refused:
        parse_bytes("6 gigs", "budget")
    message = str(refused.value)
    assert "'6G' == '6GiB'" in message and "'6GB' == 6*10**9 bytes" in message and "'6 gigs'" in message


# -- refusals that speak of what the user did ------------------------------------------------------


def test_the_plain_trainer_refusal_is_short_and_names_the_trainer_used(tmp_path):
    class MyTrainer(Trainer):
        pass

    for cls, works in [
        (Trainer, "use remat.RematTrainer(model=cm, ...)"),
        (MyTrainer, "remat_trainer_class(MyTrainer)"),
    ]:
        cm = CheckpointedModel(add_lora(tiny_model()))
        with pytest.raises(TypeError) as refused:
            cls(model=cm, args=_plain_args(tmp_path), train_dataset=_dataset())
        message = str(refused.value)
        assert message.startswith(f"{cls.__name__}(model=cm)") and works in message, message
        assert "peft_config" not in message and len(message) < 200, message


def test_the_refusal_speaks_of_peft_config_only_when_one_was_passed(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from peft import LoraConfig

    from remat.demo import byte_tokenizer

    data = datasets.Dataset.from_dict({"text": ["the quick brown fox"] * 4})
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, max_length=16, report_to=[], use_cpu=True)
    for lora in (None, LoraConfig(r=4, target_modules=["q_proj"])):
        cm = CheckpointedModel(tiny_model())
        with pytest.raises(TypeError) as refused:
            trl.SFTTrainer(model=cm, args=args, train_dataset=data, processing_class=byte_tokenizer(), peft_config=lora)
        message = str(refused.value)
        assert message.startswith("SFTTrainer(model=cm)") and "remat_trainer_class(SFTTrainer)" in message
        assert ("peft_config" in message) == (lora is not None), message
        assert len(message) < 320, message


def test_a_misspelt_field_in_replace_names_the_field_meant():
    with pytest.raises(TypeError, match=r"\['every_n_layer'\] \(did you mean every_n_layers\?\); it takes the fields"):
        CheckpointConfig().replace(every_n_layer=3)


def test_a_misspelt_field_in_the_config_itself_is_a_remat_type_error_naming_the_field_meant():
    from remat import RematError

    with pytest.raises(TypeError, match=r"'every_n_layer' \(did you mean every_n_layers=\?\); it takes") as info:
        CheckpointConfig(every_n_layer=2)
    assert isinstance(info.value, RematError)


def test_a_misspelt_wrapper_option_is_matched_against_the_wrapper_options_too():
    model = tiny_model()
    with pytest.raises(TypeError, match=r"'offload_host_budgt' \(did you mean offload_host_budget=\?\)"):
        CheckpointedModel(model, offload_host_budgt="1GiB")


def test_switching_the_head_to_plain_needs_no_second_field():
    cm = CheckpointedModel(add_lora(tiny_model()), head="chunked", head_chunk_tokens=16)
    cm.enable(head="plain")
    assert (cm.checkpoint_config.head, cm.checkpoint_config.head_chunk_tokens) == ("plain", None)
    assert cm.checkpoint_map.head.label == "plain"
    with pytest.raises(ValueError, match='add head="chunked"'):  # a chunk given with the plain head is still refused
        cm.enable(head="plain", head_chunk_tokens=8)


def test_a_batch_that_is_not_a_dict_is_refused_naming_the_form_profile_takes():
    cm = CheckpointedModel(add_lora(tiny_model()))
    with pytest.raises(TypeError, match=r"profile takes the model's inputs as a dict, .*got list"):
        cm.profile([1, 2, 3], progress=False)


@pytest.mark.parametrize("size", ["1.5", "0.5", "24.0", "1.5B"])
def test_a_fraction_of_a_byte_is_a_unit_left_out_not_a_byte_count(size):
    """ "1.5" read as bytes was 1 byte (a budget no map meets, named only when the first step plans): the unit meant
    is asked for, with the value as given."""
    meant = size.rstrip("B")
    with pytest.raises(
        ValueError,
        match=rf"a size in bytes is a whole number; got {size!r}: add the unit meant \('{meant}MiB' or '{meant}GiB'\)",
    ):
        parse_bytes(size, "budget")


def test_a_negative_size_is_named_as_such():
    for size in ("-3MiB", " -1.5G", "-4096"):
        with pytest.raises(ValueError, match=rf"budget is a size, which cannot be negative; got {size!r}"):
            parse_bytes(size, "budget")


# -- refusals that name the way out ----------------------------------------------------------------


def test_a_plan_made_for_another_models_layers_is_refused_naming_a_profile_of_this_one():
    """A 2-layer model's plan on a 4-layer one planned layers 2 and 3 by the default rule without a word (and the
    other way round named `layer_policies`, which the user never wrote)."""
    for profiled, given in ((2, 4), (4, 2)):
        planned = (
            CheckpointedModel(tiny_model(num_hidden_layers=profiled)).profile(batch(), progress=False).plan("1GiB")
        )
        cm = CheckpointedModel(tiny_model(num_hidden_layers=given), every_n_layers=2)
        before = (cm.checkpoint_config, cm.checkpoint_map)
        with pytest.raises(
            ValueError, match=rf"made from the profile of a model with {profiled} layers, .* has {given}"
        ):
            cm.enable(planned)
        assert (cm.checkpoint_config, cm.checkpoint_map) == before


def test_config_refusals_name_the_way_out():
    with pytest.raises(ValueError, match=r"got 'none' \(no checkpointing: cm.disable\(\), or layer_policies="):
        CheckpointConfig(checkpoint_policy="none")
    for given in ({1, 2}, "2"):
        with pytest.raises(
            TypeError, match="swap_layers must be an int \\(how many layers\\) or a list of layer indices"
        ):
            CheckpointConfig(swap_layers=given)
    assert CheckpointConfig(offload_min_bytes="2MiB") == CheckpointConfig(offload_min_bytes=2 * 1024**2)  # a size
    cm = CheckpointedModel(add_lora(tiny_model()), layer_policies={0: "offload"})
    with pytest.raises(ValueError, match=r"cm.enable\(budget=..., layer_policies=\{\}\) plans by budget"):
        cm.enable(budget="1GiB")
    cm.enable(budget="1GiB", layer_policies={})  # the way out it names
    assert cm.checkpoint_config.budget == "1GiB" and not cm.checkpoint_config.layer_policies


def test_the_no_checkpointing_hint_is_given_for_the_policy_only():
    for field in ("head", "swap_placement", "budget_scope"):
        with pytest.raises(ValueError) as refused:
            CheckpointConfig(**{field: "none"})
        assert "no checkpointing" not in str(refused.value), field
