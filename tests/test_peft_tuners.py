"""Every PEFT tuner type the installed PEFT has, saved through the wrapper and loaded into its own
base model by remat and by PEFT itself (the layer names a save writes are relative to the
transformers model, whatever PEFT wrapper holds it: issue 25, item 5).

The types come from PEFT (`peft.PeftType`); each gets the smallest config that applies to a
two-layer Llama. A type missing from `CONFIGS` fails `test_every_tuner_type_of_peft_has_a_case`
(add its config when PEFT adds a tuner)."""

import json
import os

import pytest
import torch
from conftest import assert_same_grads, batch, hook_snapshot, step_grads, tiny_model
from peft import PeftModel, PeftType, get_peft_model
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.utils import get_peft_model_state_dict

from remat import CheckpointConfig, CheckpointedModel

LAYERS = 2
TARGETS = ["q_proj", "o_proj"]  # square (32 x 32): every tuner's shape rules hold
CONFIGS = {
    # prompt learning: PEFT saves the prompts and loads them for inference only
    "PROMPT_TUNING": {"num_virtual_tokens": 4},
    "MULTITASK_PROMPT_TUNING": {"num_virtual_tokens": 4},
    "P_TUNING": {"num_virtual_tokens": 4, "encoder_hidden_size": 16},
    "PREFIX_TUNING": {"num_virtual_tokens": 4},
    "CPT": {},
    "CARTRIDGE": {"num_virtual_tokens": 4},
    # the others inject layers into the model (or, ShadowPEFT, add a backbone beside it)
    "LORA": {"target_modules": TARGETS, "r": 2},
    "ADALORA": {"target_modules": TARGETS, "init_r": 4, "target_r": 2, "total_step": 10},
    "ADAMSS": {"target_modules": TARGETS},
    "BOFT": {"target_modules": TARGETS, "boft_block_size": 4},
    "ADAPTION_PROMPT": {"adapter_len": 4, "adapter_layers": 1},
    "IA3": {"target_modules": TARGETS, "feedforward_modules": []},
    "BEFT": {"target_modules": TARGETS},
    "LILY": {"target_modules": TARGETS},
    "LOHA": {"target_modules": TARGETS, "r": 2},
    "LOKR": {"target_modules": TARGETS, "r": 2},
    "OFT": {"target_modules": TARGETS, "r": 0, "oft_block_size": 8},
    "POLY": {"target_modules": TARGETS, "r": 2},
    "LN_TUNING": {},
    "VERA": {"target_modules": TARGETS, "r": 4},
    "FROD": {"target_modules": TARGETS},
    "PVERA": {"target_modules": TARGETS, "r": 4},
    "FOURIERFT": {"target_modules": TARGETS, "n_frequency": 16},
    "GLORA": {"target_modules": TARGETS},
    "XLORA": {"hidden_size": 32, "xlora_size": 8},  # + the LoRA adapters it mixes (`_config`)
    "HRA": {"target_modules": TARGETS, "r": 2},
    "VBLORA": {"target_modules": TARGETS, "r": 2, "vector_length": 8, "num_vectors": 16},
    "UNILORA": {"target_modules": TARGETS},
    "MISS": {"target_modules": TARGETS, "r": 8},
    "RANDLORA": {"target_modules": TARGETS, "r": 4},
    "ROAD": {"target_modules": TARGETS, "group_size": 8},
    "TRAINABLE_TOKENS": {"token_indices": [3, 5]},
    "HIRA": {"target_modules": TARGETS},
    "SHIRA": {"target_modules": TARGETS, "r": 2},
    "C3A": {"target_modules": TARGETS, "block_size": 8},
    "WAVEFT": {"target_modules": TARGETS, "n_frequency": 16},
    "OSF": {"target_modules": TARGETS},
    "DELORA": {"target_modules": TARGETS, "r": 2},
    "GRALORA": {"target_modules": TARGETS, "r": 4},
    "TINYLORA": {"target_modules": TARGETS},
    "PSOFT": {"target_modules": TARGETS, "r": 4},
    "PEANUT": {"target_modules": TARGETS},
    "SHADOW": {"target_modules": TARGETS},
    "SUPERTUNING": {"target_modules": TARGETS},
    "DEFT": {"target_modules": TARGETS},
}
NEEDS_PACKAGE = {"ADAMSS": ("sklearn", "scikit-learn")}
"""Types PEFT builds only with an optional package: where it is missing, PEFT's own refusal
naming it is asserted instead (the tuner itself applies to a causal LM)."""

NOT_SAVED = {"XLORA": "internal_xlora_classifier"}
"""Tensors PEFT leaves out of the save (X-LoRA's classifier, frozen: each load draws its own)."""

PEFT_TYPES = [t.value for t in PeftType]


def _base():
    return tiny_model(num_hidden_layers=LAYERS, use_cache=False)  # X-LoRA needs use_cache off


def _config(peft_type, folder):
    kwargs = dict(CONFIGS[peft_type])
    if peft_type == "XLORA":  # X-LoRA mixes LoRA adapters trained before: one, saved by PEFT
        from peft import LoraConfig

        lora = os.path.join(folder, "lora-for-xlora")
        _trained(
            get_peft_model(_base(), LoraConfig(task_type="CAUSAL_LM", target_modules=TARGETS, r=2))
        ).save_pretrained(lora)
        kwargs["adapters"] = {"0": lora}
    return PEFT_TYPE_TO_CONFIG_MAPPING[peft_type](task_type="CAUSAL_LM", **kwargs)


def _trained(model):
    """Every trainable tensor moved away from its initial value, as training would."""
    torch.manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    return model


def _assert_same_tensors(expected, got):
    assert expected.keys() == got.keys(), sorted(expected.keys() ^ got.keys())[:5]
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def _saved_part(model, peft_type):
    """The whole model's tensors, adapters in it, less those PEFT does not save."""
    unsaved = NOT_SAVED.get(peft_type)
    return {k: v for k, v in model.state_dict().items() if unsaved is None or unsaved not in k}


def _trainable(model):
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def test_every_tuner_type_of_peft_has_a_case():
    missing = sorted(set(PEFT_TYPES) - set(CONFIGS))
    assert not missing, f"PEFT has tuner types this test does not build: {missing}; add a minimal config to CONFIGS"


@pytest.mark.parametrize("peft_type", PEFT_TYPES)
def test_a_save_of_every_tuner_loads_into_its_own_base_model(tmp_path, peft_type):
    if peft_type in NEEDS_PACKAGE:
        module, package = NEEDS_PACKAGE[peft_type]
        try:
            __import__(module)
        except ImportError:
            with pytest.raises(ImportError, match=package):
                get_peft_model(_base(), _config(peft_type, tmp_path))
            return
    config = _config(peft_type, tmp_path)
    model = _trained(get_peft_model(_base(), config))
    trained = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    # prefix tuning's cache is dropped in a checkpointed layer: such a map is refused (the test below)
    prefix = peft_type in ("PREFIX_TUNING", "CARTRIDGE")
    cm = CheckpointedModel(model, CheckpointConfig(layer_policies={0: "none", 1: "none"}) if prefix else None)
    cm.save_pretrained(tmp_path / "save")

    if config.is_prompt_learning:
        base = _base()
        before = {k: v.clone() for k, v in base.state_dict().items()}
        with pytest.raises(ValueError, match=r"prompt-learning adapter .*is_trainable=False\. Nothing was loaded"):
            CheckpointedModel.from_pretrained(base, tmp_path / "save")  # PEFT refuses is_trainable=True
        _assert_same_tensors(before, base.state_dict())
        assert not hasattr(base, "peft_config")
    loaded = CheckpointedModel.from_pretrained(_base(), tmp_path / "save", is_trainable=not config.is_prompt_learning)
    assert loaded.checkpoint_map == cm.checkpoint_map
    _assert_same_tensors(trained, get_peft_model_state_dict(loaded.model))  # what PEFT saves of the adapter
    if not config.is_prompt_learning:  # (prompt learning saves the prompts, not the encoder that made them)
        _assert_same_tensors(_saved_part(model, peft_type), _saved_part(loaded.model, peft_type))
        assert _trainable(loaded.model) == _trainable(model)

    by_peft = PeftModel.from_pretrained(_base(), tmp_path / "save")
    _assert_same_tensors(trained, get_peft_model_state_dict(by_peft))
    _assert_same_tensors(_saved_part(by_peft, peft_type), _saved_part(loaded.model, peft_type))


@pytest.mark.parametrize("peft_type", ["PROMPT_TUNING", "LORA"])
def test_saved_layer_names_are_the_transformers_models_whatever_wraps_it(tmp_path, peft_type):
    CheckpointedModel(get_peft_model(_base(), _config(peft_type, tmp_path))).save_pretrained(tmp_path / "peft")
    CheckpointedModel(_base()).save_pretrained(tmp_path / "bare")
    names = [json.loads((tmp_path / f / "checkpoint_config.json").read_text())["layers"] for f in ("peft", "bare")]
    assert names[0] == names[1] == ["model.layers.0", "model.layers.1"]


@pytest.mark.parametrize(
    ("peft_type", "prefix"), [("LORA", "base_model.model."), ("PROMPT_TUNING", "base_model."), (None, "")]
)
def test_a_save_from_an_older_remat_with_a_peftmodels_full_names_still_loads(tmp_path, peft_type, prefix):
    """Before relative names a save wrote the wrapped model's own names."""
    model = _base() if peft_type is None else get_peft_model(_base(), _config(peft_type, tmp_path))
    CheckpointedModel(model, CheckpointConfig(layer_policies={1: "none"})).save_pretrained(tmp_path / "save")
    file = tmp_path / "save" / "checkpoint_config.json"
    data = json.loads(file.read_text())
    data["layers"] = [prefix + n for n in data["layers"]]
    file.write_text(json.dumps(data))

    trainable = peft_type != "PROMPT_TUNING"
    loaded = CheckpointedModel.from_pretrained(_base(), tmp_path / "save", is_trainable=trainable)
    assert loaded.checkpoint_config.layer_policies == {1: "none"}
    if peft_type is not None:  # into a PeftModel of the same kind, like a Trainer resume
        into_peft = get_peft_model(_base(), _config(peft_type, tmp_path))
        assert CheckpointedModel.from_pretrained(
            into_peft, tmp_path / "save", is_trainable=trainable
        ).checkpoint_config == (loaded.checkpoint_config)


def test_a_model_of_another_depth_is_still_refused_whatever_the_wrapper(tmp_path):
    model = get_peft_model(_base(), _config("PROMPT_TUNING", tmp_path))
    CheckpointedModel(model).save_pretrained(tmp_path / "save")
    with pytest.raises(ValueError, match=r"planned for 2 layers \(model.layers.0, model.layers.1\), but this model"):
        CheckpointedModel.from_pretrained(tiny_model(num_hidden_layers=3), tmp_path / "save", is_trainable=False)


def test_a_map_over_the_layers_a_tuner_adds_loads_with_the_adapter(tmp_path):
    """ShadowPEFT adds a decoder layer beside the model: the map counts it, and a save whose
    config names it loads into the base model, where that layer comes with PEFT's load."""
    model = _trained(get_peft_model(_base(), _config("SHADOW", tmp_path)))
    config = CheckpointConfig(layer_policies={LAYERS: "none", 0: "recompute"})
    cm = CheckpointedModel(model, config)
    assert len(cm.checkpoint_map) == LAYERS + 1
    cm.save_pretrained(tmp_path / "save")
    saved = json.loads((tmp_path / "save" / "checkpoint_config.json").read_text())["layers"]
    assert saved[LAYERS].startswith("peft:base_model.") and "model.layers.0" in saved

    loaded = CheckpointedModel.from_pretrained(_base(), tmp_path / "save")
    assert loaded.checkpoint_config == config and loaded.checkpoint_map == cm.checkpoint_map
    with pytest.raises(ValueError, match="planned for 3 layers"):
        CheckpointedModel.from_pretrained(tiny_model(num_hidden_layers=3, use_cache=False), tmp_path / "save")


def test_a_prompt_learning_save_loads_trainable_into_a_peftmodel_that_has_the_adapter(tmp_path):
    """PEFT refuses to add a prompt-learning adapter as trainable, not to load weights into one
    the model has: a resume of prompt tuning keeps training."""
    model = _trained(get_peft_model(_base(), _config("PROMPT_TUNING", tmp_path)))
    CheckpointedModel(model).save_pretrained(tmp_path / "save")
    into = get_peft_model(_base(), _config("PROMPT_TUNING", tmp_path))
    loaded = CheckpointedModel.from_pretrained(into, tmp_path / "save")
    _assert_same_tensors(get_peft_model_state_dict(model), get_peft_model_state_dict(loaded.model))
    assert _trainable(loaded.model) == _trainable(model) == ["prompt_encoder.default.embedding.weight"]


def test_prefix_tuning_with_a_checkpointed_layer_is_refused_and_trains_exactly_with_none():
    """Prefix tuning's virtual keys and values reach each layer as the cache, which transformers drops in a
    checkpointed layer: a shape error on transformers 5 and, on 4.57, wrong gradients without a word (the prefix
    ignored by every other layer). Refused, changing nothing; with no layer checkpointed it trains exactly."""
    from peft import PrefixTuningConfig, TaskType, get_peft_model

    def build():
        return get_peft_model(tiny_model(), PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))

    model = build()
    before = hook_snapshot(model)
    with pytest.raises(ValueError, match=r"prefix_tuning passes its virtual tokens .*\(layers \[0, 1, 2, 3\]"):
        CheckpointedModel(model, CheckpointConfig())
    assert hook_snapshot(model) == before and not model.base_model.is_gradient_checkpointing
    none = CheckpointConfig(layer_policies=dict.fromkeys(range(4), "none"))
    cm = CheckpointedModel(model, none)
    with pytest.raises(ValueError, match="prefix_tuning passes its virtual tokens"):
        cm.enable(every_n_layers=2, layer_policies={})
    assert cm.checkpoint_config == none
    # a budget takes no layer_policies: the refusal says to drop it, not to name policies the budget refuses
    with pytest.raises(ValueError, match=r"drop budget='64MiB' and checkpoint no layer"):
        cm.enable(budget="64MiB", layer_policies={})
    reference = build()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    expected = step_grads(reference, [(n, p) for n, p in reference.named_parameters() if p.requires_grad], batch())
    assert_same_grads(expected[1], step_grads(cm, named, batch())[1])


def test_a_peft_mixed_model_is_told_apart_from_peft_applied_after_wrapping_and_its_save_refused_as_peft_would(
    tmp_path, caplog
):
    """`get_peft_model(..., mixed=True)` applied before wrapping, as the README says: remat took it for PEFT applied
    around cm.model after wrapping and told the user to apply PEFT first; PEFT itself cannot save such a model."""
    from peft import LoHaConfig, LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj"]), mixed=True)
    model.add_adapter("h", LoHaConfig(r=4, target_modules=["v_proj"]))
    model.set_adapter(["default", "h"])
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=1))
    with caplog.at_level("WARNING", logger="remat"):
        cm(**batch()).loss.backward()
        cm(**batch()).loss.backward()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("cm.model is a PeftMixedModel") and "after wrapping" not in said[0]
    with pytest.raises(ValueError, match=r"PeftMixedModel .* which PEFT cannot save"):
        cm.save_pretrained(tmp_path / "save")
    assert not (tmp_path / "save").exists()
