"""One error family: every exception class remat defines is a `remat.RematError` and is
importable from `remat`; real user errors are caught as `RematError` and as the builtin they
always were (`except ValueError` keeps working)."""

import importlib
import inspect
import pkgutil

import pytest
from conftest import batch, tiny_model

import remat
from remat import CheckpointConfig, CheckpointedModel, RematError


def _remat_modules():
    names = [m.name for m in pkgutil.walk_packages(remat.__path__, "remat.")]
    assert len(names) > 40, names  # the walk reaches the rooms
    return [importlib.import_module(name) for name in names]


def test_every_exception_class_remat_defines_is_a_remat_error_importable_from_remat():
    defined = {
        cls
        for module in _remat_modules()
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__.startswith("remat")
    }
    assert len(defined) >= 10, defined
    for cls in defined:
        assert issubclass(cls, RematError), cls
        assert getattr(remat, cls.__name__) is cls and cls.__name__ in remat.__all__, cls
        builtin = [base for base in cls.__mro__ if base.__module__ == "builtins" and base is not Exception]
        assert cls is RematError or builtin[0] is not BaseException, f"{cls} is only a RematError"


def _is(error, builtin):
    assert isinstance(error, RematError) and isinstance(error, builtin), type(error).__mro__


def test_a_bad_config_value_or_type_is_a_remat_error_and_the_builtin():
    with pytest.raises(RematError, match="every_n_layers must be >= 1") as info:
        CheckpointConfig(every_n_layers=0)
    _is(info.value, ValueError)
    with pytest.raises(RematError, match="use_reentrant must be True or False") as info:
        CheckpointConfig(use_reentrant="yes")
    _is(info.value, TypeError)


def test_a_bad_size_is_a_remat_error_and_a_value_error():
    with pytest.raises(ValueError, match="offload_host_budget must be a size like") as info:
        CheckpointedModel(tiny_model(), offload_host_budget="1 gigabyte")
    _is(info.value, ValueError)


def test_loading_a_malformed_or_missing_folder_is_a_remat_error_and_the_builtin(tmp_path):
    (tmp_path / "checkpoint_config.json").write_text("{not json")
    with pytest.raises(RematError, match=r"not valid JSON.*save again") as info:
        CheckpointConfig.from_pretrained(tmp_path)
    _is(info.value, ValueError)
    with pytest.raises(RematError, match="not valid JSON") as info:
        CheckpointedModel.from_pretrained(tiny_model(), tmp_path)
    _is(info.value, ValueError)
    with pytest.raises(RematError, match="no saved CheckpointedModel") as info:
        CheckpointedModel.from_pretrained(tiny_model(), tmp_path / "missing")
    _is(info.value, FileNotFoundError)


def test_measuring_in_inference_mode_is_a_remat_error_and_a_runtime_error():
    """(Planning from a stale profile: `test_profile_state`, caught as RematError and ValueError.)"""
    cm = CheckpointedModel(tiny_model(), CheckpointConfig()).for_inference()
    with pytest.raises(RematError, match=r"call cm\.for_training") as info:
        cm.memory_report(batch())
    _is(info.value, RuntimeError)


def test_assigning_a_config_field_or_the_wrappers_config_is_a_remat_error_and_an_attribute_error():
    """Was dataclasses' bare `cannot assign to field` and `property ... has no setter`."""
    import dataclasses

    config = CheckpointConfig()
    with pytest.raises(RematError, match=r"immutable .*every_n_layers.*cm\.enable\(every_n_layers=") as info:
        config.every_n_layers = 3
    _is(info.value, dataclasses.FrozenInstanceError)
    with pytest.raises(AttributeError, match=r"config\.replace\(head="):
        del config.head
    with pytest.raises(AttributeError, match=r"cm\.enable\(field=\.\.\.\).*fields: every_n_layers"):
        config.every_n_layer = 3  # not a field: the message lists them
    assert config == CheckpointConfig()
    cm = CheckpointedModel(tiny_model(), config)
    with pytest.raises(RematError, match=r"read-only: cm\.enable\(config\)") as info:
        cm.checkpoint_config = CheckpointConfig(every_n_layers=2)
    _is(info.value, AttributeError)
    assert cm.checkpoint_config is config and cm.checkpoint_map.checkpointed == [0, 1, 2, 3]


def test_a_profile_whose_every_layer_recomputed_step_runs_out_of_memory_is_torchs_error_too():
    """The device's out-of-memory error was replaced by a StateError with no cause: `except torch.OutOfMemoryError`
    retry loops and accelerate's batch-size finder did not see it (helper-91)."""
    import torch

    from remat import OutOfMemoryError

    cm = CheckpointedModel(tiny_model())
    injected = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    def out_of_memory_while_handling_another(*_):  # its context's traceback holds this frame (and what it holds)
        try:
            raise RuntimeError("a kernel's fallback failed")
        except RuntimeError:
            raise injected from None

    handle = cm.layers[1].register_forward_pre_hook(out_of_memory_while_handling_another)
    with pytest.raises(torch.OutOfMemoryError, match=r"ran out of memory\. No map can fit it: try a smaller") as info:
        cm.profile(batch(), progress=False)
    handle.remove()
    _is(info.value, RuntimeError)
    # the device's error as its cause, a copy: the one raised holds the failed step's tensors (review helper-92)
    cause = info.value.__cause__
    assert isinstance(info.value, OutOfMemoryError) and type(cause) is torch.OutOfMemoryError
    assert cause.args == injected.args and cause.__traceback__ is None and cause.__context__ is None
    cm.profile(batch(), progress=False)  # the next one measures


def test_a_profile_whose_step_checkpointing_nothing_runs_out_of_memory_says_that_map_is_not_offered():
    """The map that checkpoints nothing left the frontier without a note when its step ran out of memory (a budget's
    profile kept after Trainer's batch-size finder shrank the batch then never offered it; helper-91)."""
    import torch

    cm = CheckpointedModel(tiny_model())
    layer = next(iter(cm.layers[2].children()))
    ran = []

    def out_of_memory_when_nothing_is_checkpointed(*_):
        ran.append(1)
        if all(not row.checkpointed for row in cm.checkpoint_map):
            raise torch.OutOfMemoryError("CUDA out of memory. (injected)")

    handle = layer.register_forward_pre_hook(out_of_memory_when_nothing_is_checkpointed)
    profile = cm.profile(batch(), progress=False)
    handle.remove()
    assert "the map that checkpoints nothing ran out of memory on this batch: not offered" in profile.notes
    assert all(set(plan.layer_policies.values()) != {"none"} for plan in profile.frontier())
