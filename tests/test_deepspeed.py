"""RematTrainer under DeepSpeed ZeRO-2 and ZeRO-3: two gloo processes on the CPU (DS_ACCELERATOR=cpu),
a LoRA model with non-reentrant recompute and with "selective", judged against one process on the
batch both ranks saw. ZeRO-3 with frozen parameters is where per-layer checkpointing breaks elsewhere
(transformers #47254, DeepSpeed #4332: "saved [1024] vs recomputed [0]"; 0.19.3 leaves frozen
parameters gathered after recompute). The worker (tests/distributed/deepspeed_worker.py) measures;
each stage is one torchrun launch.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import add_lora, assert_same_grads, free_port, tiny_model
from safetensors.torch import load_file

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (a test extra; make test installs it)")

WORKER = Path(__file__).parent / "distributed" / "deepspeed_worker.py"
COUNTS = {"recompute": [2, 1, 2, 1], "selective": [2, 2, 2, 2]}  # runs per layer a step, by the worker's map


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each stage's two ranks, launched once for the module: stage -> (folder, [rank 0's results, rank 1's])."""
    done: dict[int, tuple] = {}

    def run(stage: int) -> tuple:
        if stage not in done:
            done[stage] = _launch(stage, tmp_path_factory.mktemp(f"zero{stage}"))
        return done[stage]

    return run


@pytest.fixture(params=[2, 3], ids=["zero2", "zero3"])
def zero(request, launched):
    return launched(request.param)


@pytest.fixture
def zero3(launched):
    return launched(3)


def _launch(stage: int, out: Path) -> tuple:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    command += [str(free_port()), str(WORKER), str(out), str(Path(__file__).parent), str(stage)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out, [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def _one_process(inputs: list[dict], items: float) -> tuple[float, dict]:
    """Loss and gradients of the same LoRA model without checkpointing, on both ranks' rows at once, its
    summed token losses divided by what Trainer divided them by (`num_items_in_batch`: transformers 4.57
    counts the labels before the shift, one more a row than the loss sums)."""
    model = add_lora(tiny_model(seed=3, attention_dropout=0.0), dropout=0.0)
    data = {k: torch.cat([rank[k] for rank in inputs]) for k in inputs[0]}
    tokens = int((data["labels"][:, 1:] != -100).sum())
    loss = model(**data).loss * tokens / items
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("policy", ["recompute", "selective"])
def test_lora_trains_with_the_map_and_its_gradients_equal_one_process(zero, policy):
    """No CheckpointError; the first step's whole gradients (DeepSpeed's, just before its step) and the
    loss equal one process on the rows both ranks trained on (fp32, rtol 1e-5); every step ran the map."""
    _, ranks = zero
    runs = [rank[policy] for rank in ranks]
    assert runs[0]["items"] == runs[1]["items"]
    loss, expected = _one_process([run["inputs"] for run in runs], runs[0]["items"])
    # each rank's loss is its tokens' share: Trainer divides by the tokens of both ranks' batches
    assert sum(run["loss"] for run in runs) == pytest.approx(loss, rel=1e-5)
    for run in runs:
        assert set(run["grads"]) == set(expected)
        assert_same_grads(expected, run["grads"], rtol=1e-5, atol=1e-7)
        assert run["counts"] == [COUNTS[policy]] * 2
        assert run["kept"], "the wrapper's map after the run is the one it started with"


def test_zero3_leaves_no_frozen_parameter_gathered_after_any_backward(zero3):
    """DeepSpeed's own status of each frozen (LoRA base) parameter when each backward is done (before the
    engine's step, which partitions everything), resumed run too: all partitioned again, also those of
    the first layer, whose submodules have no backward hook (their output needs no gradient). The same
    instrument saw them gathered inside a layer's forward."""
    _, ranks = zero3
    for rank in ranks:
        for run in (rank["recompute"], rank["selective"], rank["recompute"]["resumed"]):
            assert run["gathered_frozen"] and set(run["gathered_frozen"]) == {0}, run["gathered_frozen"]
            assert run["gathered_in_forward"] > 0, "the count sees a gathered parameter"


def test_rank0_alone_saves_the_adapters_with_the_map_and_resume_applies_it(zero):
    out, ranks = zero
    checkpoint = out / "recompute" / "checkpoint-2"
    for name in ("adapter_model.safetensors", "checkpoint_config.json"):
        moved_in = [path for event, path in ranks[0]["recompute"]["writes"] if event == "os.rename" and path == name]
        assert len(moved_in) == 1, ranks[0]["recompute"]["writes"]
    assert any(event == "save_pretrained" for event, _ in ranks[0]["recompute"]["writes"]), "the saves are seen"
    assert ranks[1]["recompute"]["writes"] == [], "rank 1 saved into the checkpoint"
    saved = load_file(checkpoint / "adapter_model.safetensors")
    model = add_lora(tiny_model(seed=3))
    lora = {n.replace(".default", ""): p.shape for n, p in model.named_parameters() if p.requires_grad}
    assert {n: t.shape for n, t in saved.items()} == lora, "every adapter, whole (gathered from ZeRO-3's shards)"
    for rank in ranks:
        resumed = rank["recompute"]["resumed"]
        assert resumed["config"]["every_n_layers"] == 2 and resumed["step"] == 3
        assert resumed["counts"] == [COUNTS["recompute"]]
        # with every_n_layers=3 in the training arguments: they apply over the saved map, as without DeepSpeed
        argued = rank["recompute"]["resumed_argued"]
        assert argued["config"]["every_n_layers"] == 3 and argued["counts"] == [[2, 1, 1, 2]]


def test_zero3_best_model_with_a_named_adapter_is_deepspeeds_load_with_the_best_checkpoints_map(zero3):
    """load_best_model_at_end where the adapter ("extra") sits in the checkpoint's subfolder: DeepSpeed's engine loads
    the best checkpoint (Trainer's own best-model load), not remat's load of the subfolders, whose PEFT load into the
    partitioned parameters is refused (SavedFileError: the model's adapter weights are ZeRO-3's empty (0,) shards);
    the adapters are then the best checkpoint's file, exactly, and its map (every other layer) replaces the map at
    the end (every layer), said once as the best model's."""
    out, ranks = zero3
    best = out / "best" / "checkpoint-2"
    saved = load_file(best / "extra" / "adapter_model.safetensors")
    last = load_file(out / "best" / "checkpoint-4" / "extra" / "adapter_model.safetensors")
    assert saved.keys() == last.keys() and any(not torch.equal(saved[n], last[n]) for n in saved), "best is the last"
    for rank in ranks:
        run = rank["best"]
        assert run["best"] == str(best) and run["model_kept"]
        loaded = {n.replace(".extra", ""): p for n, p in run["adapters"].items()}
        assert loaded.keys() == saved.keys()
        for name, tensor in saved.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
        assert run["at_end"]["every_n_layers"] == 1 and run["config"]["every_n_layers"] == 2
        assert len(run["said"]) == 1 and run["said"][0].startswith(f"loading the best model from {best}: "), run["said"]


def test_block_swap_of_zero3_partitioned_layers_is_refused_before_anything_moves(zero3):
    _, ranks = zero3
    for rank in ranks:
        assert rank["swap"]["refused"] and "DeepSpeed ZeRO-3" in rank["swap"]["refused"]
        assert rank["swap"]["unchanged"]


def test_a_zero3_save_without_the_adapters_says_where_they_are(zero3):
    """Without `stage3_gather_16bit_weights_on_model_save`, transformers 4.57 saves an empty state dict under
    ZeRO-3 (the adapters only in DeepSpeed's files): rank 0 warns once, naming the setting. transformers 5
    gathers the trainable parameters into the save itself: every adapter there, no warning."""
    _, ranks = zero3
    saving, other = ranks[0]["ungathered"], ranks[1]["ungathered"]
    assert other["warnings"] == [], "only the rank that saves says it"
    if int(transformers.__version__.split(".")[0]) < 5:
        assert saving["tensors"] == 0 and len(saving["warnings"]) == 1, saving
    else:
        assert saving["tensors"] == 24 and saving["warnings"] == [], saving


def test_the_accelerate_deepspeed_config_names_the_readmes_zero3_file():
    """configs/accelerate/deepspeed_zero3.yaml (GPUs only: not launched here) reads the file the tests train with."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    config = yaml.safe_load((root / "configs" / "accelerate" / "deepspeed_zero3.yaml").read_text())
    assert config["distributed_type"] == "DEEPSPEED"
    assert (root / config["deepspeed_config"]["deepspeed_config_file"]).is_file()
