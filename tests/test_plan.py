"""The plan is a pure function of (config, layer names): no model needed."""

import pytest

from remat import CheckpointConfig, CheckpointMap, LayerPlan
from remat.plan import plan_layers, swapped_indices

NAMES = [f"model.layers.{i}" for i in range(8)]


def _policies(m):
    return [p.policy for p in m]


@pytest.mark.parametrize("n, expected", [(1, list(range(8))), (2, [0, 2, 4, 6]), (3, [0, 3, 6]), (8, [0]), (20, [0])])
def test_every_n_layers_counts_from_layer_0(n, expected):
    m = plan_layers(CheckpointConfig(every_n_layers=n), NAMES)
    assert m.checkpointed == expected
    assert [p.index for p in m] == list(range(8)) and [p.name for p in m] == NAMES


def test_layer_policies_override_the_checkpoint_policy():
    config = CheckpointConfig(every_n_layers=2, checkpoint_policy="offload", layer_policies={0: "none", 1: "recompute"})
    m = plan_layers(config, NAMES)
    assert _policies(m)[:4] == ["none", "recompute", "offload", "none"]


@pytest.mark.parametrize(
    "config, expected",
    [
        (CheckpointConfig(swap_layers=2, swap_placement="spread"), [3, 7]),
        (CheckpointConfig(swap_layers=3, swap_placement="spread"), [1, 4, 7]),
        (CheckpointConfig(swap_layers=2, swap_placement="tail"), [6, 7]),
        (CheckpointConfig(swap_layers=[5, 1]), [1, 5]),
        (CheckpointConfig(swap_layers=8), list(range(8))),
    ],
)
def test_swap_placement(config, expected):
    assert swapped_indices(config, 8) == expected


def test_swapped_layers_are_always_checkpointed_whatever_every_n_or_overrides_say():
    """Unsloth's defect: spread places swapped layers at odd indices, every_n=2 checkpoints even ones."""
    config = CheckpointConfig(every_n_layers=2, swap_layers=4, layer_policies={7: "none"})
    m = plan_layers(config, NAMES)
    swapped = [p for p in m if p.swapped]
    assert [p.index for p in swapped] == [1, 3, 5, 7]
    assert all(p.checkpointed for p in swapped)
    assert "always checkpointed" in m[7].reason
    off = plan_layers(config, NAMES, checkpointing_off_by="gradient_checkpointing_disable()")
    assert off.checkpointed == [1, 3, 5, 7]


@pytest.mark.parametrize(
    "config, message",
    [
        (CheckpointConfig(layer_policies={8: "none"}), "layer_policies names layer"),
        (CheckpointConfig(swap_layers=9), "more layers than the model has"),
        (CheckpointConfig(swap_layers=[2, 8]), "swap_layers names layer"),
    ],
)
def test_indices_beyond_the_model_are_errors(config, message):
    with pytest.raises(ValueError, match=message):
        plan_layers(config, NAMES)


def test_no_layers_is_an_error():
    with pytest.raises(ValueError):
        plan_layers(CheckpointConfig(), [])


def test_map_invariants_are_enforced():
    with pytest.raises(ValueError, match="swapped but not checkpointed"):
        CheckpointMap([LayerPlan(0, "a", "none", swapped=True)])
    with pytest.raises(ValueError, match="in order"):
        CheckpointMap([LayerPlan(1, "a", "none")])


def test_table_shows_index_name_policy_swapped_and_why():
    table = str(plan_layers(CheckpointConfig(every_n_layers=2, swap_layers=[1]), NAMES[:3]))
    lines = table.splitlines()
    assert lines[0].split() == ["index", "name", "policy", "swapped", "why"]
    assert lines[2].split()[:4] == ["0", "model.layers.0", "recompute", "no"]
    assert lines[3].split()[:4] == ["1", "model.layers.1", "recompute", "yes"]
    assert "always checkpointed" in lines[3] and lines[4].endswith("every_n_layers=2")
    assert repr(plan_layers(CheckpointConfig(every_n_layers=2), NAMES)) == (
        "CheckpointMap(8 layers: recompute [0, 2, 4, 6], offload [], none [1, 3, 5, 7], swapped [])"
    )
