"""Building, loading and enabling a wrapper find the layers once and plan the map once.

Counted by behaviour: every module of remat that looks up `discover_layers` or `plan_layers`
gets a counting spy in its place, so a call is counted whichever room makes it."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter

import pytest
from conftest import add_lora, tiny_model

import remat.layers
import remat.plan
from remat import CheckpointConfig, CheckpointedModel


@contextlib.contextmanager
def counted(monkeypatch):
    calls: Counter[str] = Counter()
    for name, original in (
        ("discover_layers", remat.layers.discover_layers),
        ("plan_layers", remat.plan.plan_layers),
    ):

        def spy(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        for module in [m for n, m in sys.modules.items() if n == "remat" or n.startswith("remat.")]:
            if getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, spy)
    yield calls
    monkeypatch.undo()


def test_construction_discovers_once_and_plans_once(monkeypatch):
    model = add_lora(tiny_model())  # frozen base weights: a layer can be swapped
    with counted(monkeypatch) as calls:
        cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2, swap_layers=1))
    assert calls == {"discover_layers": 1, "plan_layers": 1}
    assert cm.checkpoint_map.checkpointed == [0, 2, 3]  # 3 is swapped, so checkpointed
    assert [p.swapped for p in cm.checkpoint_map] == [False, False, False, True]


@pytest.mark.parametrize("into", ["peft_model", "plain_save"])
def test_a_load_discovers_once_and_plans_once(tmp_path, monkeypatch, into):
    config = CheckpointConfig(every_n_layers=2)
    if into == "peft_model":
        CheckpointedModel(add_lora(tiny_model()), config).save_pretrained(tmp_path)
        target = add_lora(tiny_model())
    else:
        CheckpointedModel(tiny_model(), config).save_pretrained(tmp_path)
        target = tiny_model()
    with counted(monkeypatch) as calls:
        cm = CheckpointedModel.from_pretrained(target, tmp_path)
    assert calls == {"discover_layers": 1, "plan_layers": 1}
    assert cm.checkpoint_config.every_n_layers == 2


def test_a_load_that_builds_a_peft_model_plans_once(tmp_path, monkeypatch):
    """PEFT turns the base model into a new model: its layers are found again (a tuner may add
    some), once; the map is planned once, for that model."""
    CheckpointedModel(add_lora(tiny_model()), CheckpointConfig(every_n_layers=2)).save_pretrained(tmp_path)
    with counted(monkeypatch) as calls:
        cm = CheckpointedModel.from_pretrained(tiny_model(), tmp_path)
    assert calls == {"discover_layers": 2, "plan_layers": 1}
    assert cm.checkpoint_map[0].name.startswith("base_model.")


def test_enable_and_routes_plan_once_and_discover_nothing(monkeypatch):
    cm = CheckpointedModel(tiny_model())
    cm.disable()
    with counted(monkeypatch) as calls:
        cm.enable(every_n_layers=2)
    assert calls == {"plan_layers": 1}
    with counted(monkeypatch) as calls:
        cm.enable(every_n_layers=1)  # already enabled: a re-plan
    assert calls == {"plan_layers": 1}
    with counted(monkeypatch) as calls:
        cm.model.gradient_checkpointing_disable()
    assert calls == {"plan_layers": 1}
    assert cm.checkpoint_map.checkpointed == []
    with counted(monkeypatch) as calls:
        cm.model.gradient_checkpointing_enable()
    assert calls == {"plan_layers": 1}
    assert cm.checkpoint_map.checkpointed == [0, 1, 2, 3]


def test_a_load_takes_the_constructors_own_keywords_and_checks_them_before_anything_changes(tmp_path):
    CheckpointedModel(tiny_model(), CheckpointConfig(every_n_layers=2)).save_pretrained(tmp_path)
    target = tiny_model()
    with pytest.raises(ValueError, match="offload_host_budget"):
        CheckpointedModel.from_pretrained(target, tmp_path, offload_host_budget="lots")
    with pytest.raises(ValueError, match="layer_class names \\['NoSuchBlock'\\]"):
        CheckpointedModel.from_pretrained(target, tmp_path, layer_class="NoSuchBlock")
    assert "_remat_owner" not in target.__dict__, "refused: nothing installed"
    cm = CheckpointedModel.from_pretrained(target, tmp_path, layer_class="LlamaDecoderLayer", offload_host_budget="1G")
    assert cm.checkpoint_map.checkpointed == [0, 2]
