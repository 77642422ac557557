"""CheckpointConfig: each field validated at construction, immutable, JSON round trip."""

import copy
import dataclasses
import json
import logging
import pickle

import pytest

from remat import CheckpointConfig


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("every_n_layers", 0, ValueError),
        ("every_n_layers", -2, ValueError),
        ("every_n_layers", 1.5, TypeError),
        ("every_n_layers", "2", TypeError),
        ("every_n_layers", True, TypeError),
        ("offload", 1, TypeError),
        ("offload", "yes", TypeError),
        ("offload_min_bytes", -1, ValueError),
        ("offload_min_bytes", 2.0, TypeError),
        ("swap_layers", -1, ValueError),
        ("swap_layers", 1.0, TypeError),
        ("swap_layers", [0, 0], ValueError),
        ("swap_layers", [-1], ValueError),
        ("swap_layers", ["a"], TypeError),
        ("swap_layers", {0: 1}, TypeError),
        ("swap_placement", "middle", ValueError),
        ("swap_placement", None, ValueError),
        ("layer_policies", {0: "checkpoint"}, ValueError),
        ("layer_policies", {-1: "none"}, ValueError),
        ("layer_policies", {1.0: "none"}, TypeError),
        ("layer_policies", [(0, "none")], TypeError),
        ("layer_policies", {0: "none", "0": "recompute"}, ValueError),
        ("use_reentrant", None, TypeError),
        ("preserve_rng_state", 0, TypeError),
    ],
)
def test_each_bad_value_is_an_error_naming_the_field(field, value, error):
    with pytest.raises(error) as info:
        CheckpointConfig(**{field: value})
    assert field in str(info.value)


def test_defaults_match_the_contract():
    c = CheckpointConfig()
    assert (c.every_n_layers, c.checkpoint_policy, c.offload_min_bytes, c.swap_layers, c.swap_placement) == (
        1,
        "recompute",
        2 * 1024**2,
        0,
        "spread",
    )
    assert (dict(c.layer_policies), c.use_reentrant, c.preserve_rng_state) == ({}, False, True)


def test_config_is_immutable_and_replace_validates():
    c = CheckpointConfig(layer_policies={2: "none"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.every_n_layers = 2
    with pytest.raises(TypeError):
        c.layer_policies[3] = "recompute"
    assert c.replace(every_n_layers=2).every_n_layers == 2
    with pytest.raises(ValueError):
        c.replace(every_n_layers=0)
    with pytest.raises(TypeError, match="no field"):
        c.replace(every_n=2)


def test_callers_dict_and_list_are_copied():
    policies, swap = {1: "none"}, [3, 1]
    c = CheckpointConfig(layer_policies=policies, swap_layers=swap)
    policies[2] = "recompute"
    swap.append(0)
    assert dict(c.layer_policies) == {1: "none"} and c.swap_layers == (1, 3)


def test_json_round_trip_with_every_option_set(tmp_path):
    c = CheckpointConfig(
        every_n_layers=3,
        checkpoint_policy="offload",
        offload_min_bytes=1024,
        swap_layers=3,
        swap_placement="tail",
        layer_policies={"2": "none", 5: "offload"},
        use_reentrant=True,
        preserve_rng_state=False,
    )
    path = c.save_pretrained(tmp_path)
    data = json.loads(tmp_path.joinpath("checkpoint_config.json").read_text())
    assert path == str(tmp_path / "checkpoint_config.json")
    assert data["format_version"] == 3 and "remat_version" in data
    assert list(data) == sorted(data)
    assert CheckpointConfig.from_pretrained(tmp_path) == c
    assert CheckpointConfig.from_dict(c.to_dict()) == c
    assert copy.deepcopy(c) == c and pickle.loads(pickle.dumps(c)) == c
    assert hash(copy.deepcopy(c)) == hash(c)


@pytest.mark.parametrize("content", ["", "{", "[1, 2]", '{"every_n_layers": 0}', '{"offload": "no"}'])
def test_bad_files_are_value_errors_naming_the_file(tmp_path, content):
    (tmp_path / "checkpoint_config.json").write_text(content)
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_pretrained(tmp_path)
    assert "checkpoint_config.json" in str(info.value)


def test_unknown_keys_from_a_newer_remat_load_with_a_warning(tmp_path, caplog):
    (tmp_path / "checkpoint_config.json").write_text('{"every_n_layers": 2, "planner": "auto"}')
    with caplog.at_level("WARNING", logger="remat"):
        c = CheckpointConfig.from_pretrained(tmp_path)
    assert c.every_n_layers == 2 and "planner" in caplog.text


def test_a_field_every_format_3_save_writes_missing_is_said_and_takes_its_default(tmp_path, caplog):
    """A hand-edited or damaged save without `every_n_layers` or `swap_layers` ran every layer recomputed, or nothing
    swapped, without a word. Fields added since format 3 began (head, budget) are missing from older saves: silent."""
    data = json.loads(CheckpointConfig(every_n_layers=2, swap_layers=1, head="chunked").to_json_string())
    for name in ("every_n_layers", "swap_layers", "head", "budget"):
        del data[name]
    (tmp_path / "checkpoint_config.json").write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="remat"):
        c = CheckpointConfig.from_pretrained(tmp_path)
    assert (c.every_n_layers, c.swap_layers, c.head) == (1, 0, "plain")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "['every_n_layers', 'swap_layers'] missing" in said[0], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="remat"):  # a dict of the user's own (no format_version): nothing said
        assert CheckpointConfig.from_dict({"every_n_layers": 2}).every_n_layers == 2
    assert not caplog.records


def test_layer_policies_cannot_be_changed_in_place_by_any_dict_route():
    c = CheckpointConfig(layer_policies={1: "none"})
    before = hash(c)
    for change in (
        lambda: c.layer_policies.__setitem__(2, "recompute"),
        lambda: dict.__setitem__(c.layer_policies, 2, "recompute"),
        lambda: dict.update(c.layer_policies, {2: "recompute"}),
        lambda: c.layer_policies.__ior__({2: "recompute"}),
    ):
        with pytest.raises(TypeError):
            change()
    assert dict(c.layer_policies) == {1: "none"} and hash(c) == before
    assert c == CheckpointConfig(layer_policies={1: "none"}) and c.layer_policies == {1: "none"}


@pytest.mark.parametrize("version, message", [(99, r"format_version 99.*reads format_version 3"), ("1", "positive")])
def test_a_format_version_this_remat_cannot_read_is_an_error_naming_the_file(tmp_path, version, message):
    (tmp_path / "checkpoint_config.json").write_text(json.dumps({"format_version": version, "every_n_layers": 2}))
    with pytest.raises(ValueError, match=message) as info:
        CheckpointConfig.from_pretrained(tmp_path)
    assert "checkpoint_config.json" in str(info.value)


def test_a_file_of_the_first_format_still_loads(tmp_path):
    (tmp_path / "checkpoint_config.json").write_text(json.dumps({"format_version": 1, "every_n_layers": 2}))
    assert CheckpointConfig.from_pretrained(tmp_path) == CheckpointConfig(every_n_layers=2)


def test_swap_placement_with_a_list_of_layers_is_refused_and_an_old_save_of_it_reads_as_spread(caplog):
    """swap_placement places a count; with a list it was taken and ignored, silently."""
    with pytest.raises(ValueError, match=r"swap_placement='tail' places a count.*swap_layers=\[0, 2\] names them"):
        CheckpointConfig(swap_layers=[0, 2], swap_placement="tail")
    tail = CheckpointConfig(swap_layers=2, swap_placement="tail")  # the message's way out, where it is inherited
    with pytest.raises(ValueError, match="swap_placement='spread'"):
        tail.replace(swap_layers=[0, 1])
    assert tail.replace(swap_layers=[0, 1], swap_placement="spread").swap_layers == (0, 1)
    saved = {**CheckpointConfig(swap_layers=[0, 2]).to_dict(), "swap_placement": "tail"}
    with caplog.at_level(logging.WARNING, logger="remat"):
        loaded = CheckpointConfig.from_dict(saved)
    assert loaded == CheckpointConfig(swap_layers=[0, 2]) and "read as 'spread'" in caplog.text
