"""Bad input to the wrapper: a clear error, and the model left untouched."""

import pytest
import torch
from conftest import add_lora, batch, hook_snapshot, tiny_model
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

from remat import CheckpointConfig, CheckpointedModel, NoCheckpointableLayersError
from remat.model import controller_of


def _fingerprint(model):
    return (
        hook_snapshot(model),
        {n: dict(vars(m)).keys() for n, m in model.named_modules()},
        [id(p) for p in model.parameters()],
    )


class PlainBlocksModel(PreTrainedModel):
    """A PreTrainedModel whose blocks are plain modules: nothing remat can checkpoint yet."""

    config_class = LlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.post_init()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_model_with_no_checkpointable_layers_names_what_was_searched_for():
    model = PlainBlocksModel(LlamaConfig(hidden_size=8, num_attention_heads=1, num_hidden_layers=1))
    before = _fingerprint(model)
    with pytest.raises(NoCheckpointableLayersError, match="GradientCheckpointingLayer") as info:
        CheckpointedModel(model)
    assert "PlainBlocksModel" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert _fingerprint(model) == before


@pytest.mark.parametrize("thing", [nn.Linear(2, 2), "model", None])
def test_not_a_transformers_model_is_a_type_error(thing):
    with pytest.raises(TypeError, match=r"PreTrainedModel|nn\.Module"):
        CheckpointedModel(thing)


def test_wrong_config_type_is_a_type_error():
    model = tiny_model()
    before = _fingerprint(model)
    with pytest.raises(TypeError, match="CheckpointConfig"):
        CheckpointedModel(model, {"every_n_layers": 2})
    assert _fingerprint(model) == before


@pytest.mark.parametrize(
    "config, error, message",
    [
        (CheckpointConfig(layer_policies={4: "none"}), ValueError, "has 4 layers"),
        (CheckpointConfig(swap_layers=5), ValueError, "more layers"),
    ],
)
def test_configs_the_model_cannot_take_are_refused_before_anything_changes(config, error, message):
    model = tiny_model()
    before = _fingerprint(model)
    with pytest.raises(error, match=message):
        CheckpointedModel(model, config)
    assert _fingerprint(model) == before
    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    wrapped = _fingerprint(model)
    with pytest.raises(error, match=message):
        cm.enable(config)
    assert cm.checkpoint_config == CheckpointConfig(every_n_layers=2) and cm.checkpoint_map.checkpointed == [0, 2]
    assert _fingerprint(model) == wrapped


def test_wrapping_twice_is_refused():
    model = tiny_model()
    cm = CheckpointedModel(model)
    with pytest.raises(ValueError, match="already wrapped"):
        CheckpointedModel(model)
    with pytest.raises(TypeError, match="already a CheckpointedModel"):
        CheckpointedModel(cm)


def test_wrapping_a_data_parallel_wrapper_is_refused_naming_the_order_and_changes_nothing():
    """`CheckpointedModel(accelerator.prepare(model))` under DDP trained, but warned that PEFT came after wrapping
    and refused every save (the PeftModel sat inside DDP's `module`): the order is what to change."""
    import torch.distributed as dist

    model = tiny_model()
    before = _fingerprint(model)
    with pytest.raises(TypeError, match=r"not the DataParallel around it.*cm = CheckpointedModel\(model\)"):
        CheckpointedModel(nn.DataParallel(model))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        for engine in (ddp, torch.compile(ddp)):  # accelerate compiles after DDP (dynamo_backend)
            with pytest.raises(TypeError, match="not the DistributedDataParallel around it"):
                CheckpointedModel(engine)
        cm = CheckpointedModel(add_lora(tiny_model()))
        with pytest.raises(TypeError, match="already runs a CheckpointedModel"):
            CheckpointedModel(nn.parallel.DistributedDataParallel(cm))
    finally:
        dist.destroy_process_group()
    assert _fingerprint(model) == before
    assert CheckpointedModel(model).checkpoint_map.checkpointed  # the model itself wraps


class _NoMethods:
    pass


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"offload_host_budget": "1 gigabyte"}, ValueError, r"offload_host_budget must be a size like"),
        ({"offload_host_budget": -1}, ValueError, r"offload_host_budget must be at least 0 bytes, got -1"),
        ({"offload_host_budget": 1.5}, TypeError, r"offload_host_budget must be a number of bytes"),
        ({"offload_transport": _NoMethods()}, TypeError, r"offload_transport must provide .*lacks handles"),
        ({"swap_mover": _NoMethods()}, TypeError, r"swap_mover must provide host_copy, fetch; _NoMethods lacks"),
        ({"layer_class": "NoSuchBlock"}, NoCheckpointableLayersError, r"NoSuchBlock.*no module of that class"),
    ],
)
def test_every_wrapper_argument_is_checked_when_the_wrapper_is_built(kwargs, error, message):
    model = tiny_model()
    before = _fingerprint(model)
    with pytest.raises(error, match=message):
        CheckpointedModel(model, CheckpointConfig(checkpoint_policy="offload"), **kwargs)
    assert _fingerprint(model) == before


@pytest.mark.parametrize("size, expected", [("1GB", 10**9), ("1.5 GiB", 3 * 2**29), ("512MiB", 2**29), (4096, 4096)])
def test_the_host_budget_takes_bytes_or_sizes_with_units(size, expected):
    cm = CheckpointedModel(tiny_model(), CheckpointConfig(checkpoint_policy="offload"), offload_host_budget=size)
    assert controller_of(cm).offloader.max_host_bytes == expected
    assert torch.isfinite(cm(**batch()).loss)


@pytest.mark.parametrize("progress", ["no", 0, None])
def test_profile_progress_other_than_true_or_false_is_refused_not_read_as_truthy(progress):
    cm = CheckpointedModel(tiny_model())
    with pytest.raises(TypeError, match="progress must be True or False"):
        cm.profile(batch(), progress=progress)


@pytest.mark.parametrize("option", ["offload_host_budget", "layer_class", "offload_transport", "swap_mover"])
def test_a_wrapper_option_given_to_enable_says_it_is_fixed_when_the_wrapper_is_built(option):
    """`cm.enable(offload_host_budget="1G")` suggested `offload_min_bytes=`, `layer_class=` suggested `layer_policies=`:
    fields that do something else."""
    cm = CheckpointedModel(tiny_model(), CheckpointConfig(every_n_layers=2))
    with pytest.raises(TypeError, match=rf"{option} is the wrapper's own, fixed when it is built") as refused:
        cm.enable(**{option: None})
    assert "did you mean" not in str(refused.value)
    assert cm.checkpoint_config == CheckpointConfig(every_n_layers=2)


def test_layer_policies_on_a_wrapper_with_a_budget_names_the_call_that_works():
    cm = CheckpointedModel(tiny_model(), CheckpointConfig(budget="1GiB"))
    with pytest.raises(ValueError, match=r"cm\.enable\(budget=None, layer_policies=\.\.\.\)"):
        cm.enable(layer_policies={0: "none"})
    cm.enable(budget=None, layer_policies={0: "none"})
    assert cm.checkpoint_map[0].policy == "none"


def test_a_wrong_optimizer_or_folder_type_is_a_remat_error_naming_what_it_takes(tmp_path):
    """`measure_step_peak(cm, batch, "adam")` failed inside it (`'str' object has no attribute 'state'`), and
    `save_pretrained(None)` in `os.fspath`: neither a RematError, neither naming what they take."""
    from remat import RematError
    from remat.testing import measure_step_peak

    cm = CheckpointedModel(tiny_model())
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer or None, got str") as wrong:
        measure_step_peak(cm, batch(), "adam")
    assert isinstance(wrong.value, RematError)
    with pytest.raises(TypeError, match=r"save_pretrained needs a folder \(a str or a path\), got None") as wrong:
        cm.save_pretrained(None)
    assert isinstance(wrong.value, RematError)
    with pytest.raises(TypeError, match=r"save_pretrained needs a folder \(a str or a path\), got None") as wrong:
        CheckpointConfig().save_pretrained(None)  # was os.fspath's TypeError
    assert isinstance(wrong.value, RematError)
