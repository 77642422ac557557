"""One rank of RematTrainer under DeepSpeed ZeRO on two gloo processes (launched by torchrun with
DS_ACCELERATOR=cpu), started by tests/test_deepspeed.py.

argv: out_dir tests_dir stage. ZeRO-3 runs on the repository's configs/deepspeed/zero3.json (the README's), ZeRO-2
on a config written here. For each map (MAPS: non-reentrant recompute on every other layer,
"selective" on every layer) a LoRA model (no dropout) trains two steps with a checkpoint at step 2;
the recompute run's checkpoint is then resumed by a wrapper with no map of its own (every layer),
which trains one more step. The
rank writes out_dir/<policy>-rank<r>.pt with, measured by this worker's own instruments: the first
step's inputs, loss and whole gradients (DeepSpeed's `safe_get_full_grad` just before the engine's
step), each step's runs per layer, how many frozen parameters DeepSpeed still has gathered when the
backward is done (its own `ds_status`, just before the engine's step, which partitions everything),
and what this process saved (save_pretrained calls, files moved into the checkpoint).
Under ZeRO-3 a LoRA model whose adapter has a name of its own ("extra", saved in a subfolder) trains four steps with
load_best_model_at_end (the best is the first checkpoint, the map changed after it); the rank writes its adapters
after the best-model load, its map before and after, and what remat logged about the load. A block swap of the
ZeRO-3 engine's partitioned layers is tried last.
"""

import json
import logging
import os
import sys

sys.path.insert(0, sys.argv[2])

import deepspeed
import torch
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, tiny_model
from deepspeed.utils import safe_get_full_grad
from peft import PeftModel
from safetensors.torch import load_file
from transformers import PreTrainedModel, TrainerCallback, TrainingArguments

from remat import BlockSwapError, CheckpointConfig, CheckpointedModel, RematTrainer
from remat.testing import trainer_checkpointing_args

OUT, STAGE = sys.argv[1], int(sys.argv[3])
ROWS = [{k: v[0] for k, v in batch(seed=seed, size=1).items()} for seed in range(8)]
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}  # torch's AdamW (no compiled op)
ZERO3_CONFIG = os.path.join(os.path.dirname(sys.argv[2]), "configs", "deepspeed", "zero3.json")
WRITES: list[tuple[str, str]] = []  # ("save_pretrained" | "os.rename", path) of what this process saved into OUT


def _audit(event: str, args: tuple) -> None:
    if event == "os.rename" and str(args[1]).startswith(OUT):
        WRITES.append((event, str(args[1])))


def _saves_recorded(cls: type) -> None:
    """Every save_pretrained of this process, where safetensors and torch.save write past Python's audit events."""
    original = cls.save_pretrained

    def save_pretrained(self, save_directory, *args, **kwargs):
        WRITES.append(("save_pretrained", os.path.abspath(str(save_directory))))
        return original(self, save_directory, *args, **kwargs)

    cls.save_pretrained = save_pretrained


def _arguments(
    output_dir: str, steps: int, zero3: str | dict = ZERO3_CONFIG, checkpointing: dict | None = None, **extra
) -> TrainingArguments:
    zero2 = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2},
        "optimizer": {**ADAMW, "params": {"lr": "auto", "torch_adam": True}},
    }
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        seed=7,
        use_cpu=True,
        deepspeed=zero3 if STAGE == 3 else zero2,
        **trainer_checkpointing_args(True, checkpointing),
        **extra,
    )


class Instruments(TrainerCallback):
    """The worker's own measurements of a run (nothing read from remat)."""

    def __init__(self, trainer: RematTrainer, cm: CheckpointedModel):
        self.trainer, self.cm = trainer, cm
        self.counter = RecomputeCounter(decoder_layers(cm.model))
        self.first: dict = {}
        self.counts: list[list[int]] = []
        self.gathered_frozen: list[int] = []
        self.gathered_in_forward = 0  # the same count inside a layer's forward: the instrument sees gathers

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        assert isinstance(engine, deepspeed.DeepSpeedEngine), type(engine)
        original = engine.step

        def step(*a, **k):  # the backward is done; DeepSpeed's step comes next
            if not self.first.get("grads"):  # the whole gradient of each trainable parameter
                named = engine.module.named_parameters()
                self.first["grads"] = {n: safe_get_full_grad(p).clone() for n, p in named if p.requires_grad}
            if STAGE == 3:  # before the step, which partitions every parameter whatever the backward left
                self.gathered_frozen.append(_gathered_frozen(self.cm))
            return original(*a, **k)

        engine.step = step
        engine.module.register_forward_hook(self._record, with_kwargs=True)
        if STAGE == 3:  # after ZeRO-3's own pre-hook, which gathers the projection's weight
            decoder_layers(self.cm.model)[0].mlp.gate_proj.register_forward_pre_hook(self._inside)

    def _record(self, module, args, kwargs, output):
        if "inputs" not in self.first:
            self.first["inputs"] = {k: kwargs[k].clone() for k in ("input_ids", "attention_mask", "labels")}
            self.first["loss"] = float(output.loss.detach())
            # what Trainer divides the summed token losses by (both ranks' tokens; counted by its own rule)
            self.first["items"] = float(kwargs.get("num_items_in_batch", float("nan")))

    def _inside(self, module, args):
        self.gathered_in_forward = max(self.gathered_in_forward, _gathered_frozen(self.cm))

    def on_step_begin(self, args, state, control, **kwargs):
        self.counter.reset()

    def on_step_end(self, args, state, control, **kwargs):
        self.counts.append(list(self.counter.counts))


def _gathered_frozen(cm: CheckpointedModel) -> int:
    """Frozen parameters whose ZeRO-3 status is not "partitioned" (DeepSpeed's own bookkeeping)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    frozen = [p for p in cm.model.parameters() if not p.requires_grad]
    return sum(p.ds_status != ZeroParamStatus.NOT_AVAILABLE for p in frozen)


MAPS = {"recompute": CheckpointConfig(every_n_layers=2), "selective": CheckpointConfig(checkpoint_policy="selective")}


def lora_model():
    """The test's model (no dropout). All are built before the first TrainingArguments: once those ask for ZeRO-3,
    transformers builds models inside `deepspeed.zero.Init`, partitioned as they are made, so the LoRA weights the
    test sets would not be set and the weights would not be the one-process run's."""
    return add_lora(tiny_model(seed=3, attention_dropout=0.0), dropout=0.0)


def train(policy: str, model, resumed_model, argued_model) -> dict:
    output_dir = os.path.join(OUT, policy)
    config = MAPS[policy]
    cm = CheckpointedModel(model, config)
    trainer = RematTrainer(model=cm, args=_arguments(output_dir, 2), train_dataset=ROWS)
    instruments = Instruments(trainer, cm)
    trainer.add_callback(instruments)
    WRITES.clear()
    trainer.train()
    checkpoint = os.path.join(output_dir, "checkpoint-2")
    writes = [(event, os.path.relpath(path, checkpoint)) for event, path in WRITES if path.startswith(checkpoint)]
    result = {
        **instruments.first,
        "counts": instruments.counts,
        "gathered_frozen": instruments.gathered_frozen,
        "gathered_in_forward": instruments.gathered_in_forward,
        "kept": cm.checkpoint_config == config,
        "writes": writes,
        "files": sorted(os.listdir(checkpoint)),
    }
    if policy == "recompute":
        result["resumed"] = resume(checkpoint, os.path.join(OUT, "resumed"), resumed_model)
        # the training arguments' options apply over the saved map (DeepSpeed resumes in another place)
        argued = os.path.join(OUT, "resumed-argued")
        result["resumed_argued"] = resume(checkpoint, argued, argued_model, {"every_n_layers": 3})
    return result


def resume(checkpoint: str, output_dir: str, model, checkpointing: dict | None = None) -> dict:
    """A wrapper with no map of its own takes the saved one, and trains on from step 2 with it."""
    cm = CheckpointedModel(model)
    arguments = _arguments(output_dir, 3, checkpointing=checkpointing)
    trainer = RematTrainer(model=cm, args=arguments, train_dataset=ROWS)
    instruments = Instruments(trainer, cm)
    trainer.add_callback(instruments)
    trainer.train(resume_from_checkpoint=checkpoint)
    return {
        "config": cm.checkpoint_config.to_dict(),
        "counts": instruments.counts,
        "step": trainer.state.global_step,
        "gathered_frozen": instruments.gathered_frozen,
        "gathered_in_forward": instruments.gathered_in_forward,
    }


def named_lora_model():
    """The test's model with its adapter named "extra": PEFT saves it in the checkpoint's subfolder extra/."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(tiny_model(seed=3, attention_dropout=0.0), config, adapter_name="extra")


class _ChangeTheMap(TrainerCallback):
    """After the best checkpoint (step 2) every layer is checkpointed: the map at the end is not the saved one."""

    def __init__(self, cm: CheckpointedModel):
        self.cm, self.at_end = cm, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.cm.enable(CheckpointConfig(every_n_layers=1))

    def on_step_end(self, args, state, control, **kwargs):
        self.at_end = self.cm.checkpoint_config.to_dict()


def best_model(model) -> dict:
    """load_best_model_at_end with an adapter in a subfolder: DeepSpeed's engine loads the best checkpoint (remat's
    own load of the subfolders, PEFT's into the engine's model, is not taken), and the best checkpoint's map applies.
    The loss falls, so with greater_is_better=True the best is the first checkpoint of two."""
    cm = CheckpointedModel(model, MAPS["recompute"])
    extra = {"eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True}
    extra |= {"metric_for_best_model": "loss", "greater_is_better": True}
    arguments = _arguments(os.path.join(OUT, "best"), 4, **extra)
    change = _ChangeTheMap(cm)
    trainer = RematTrainer(model=cm, args=arguments, train_dataset=ROWS, eval_dataset=ROWS[:4], callbacks=[change])
    said = _Warnings(logging.INFO)
    remat_logger = logging.getLogger("remat")
    level = remat_logger.level
    remat_logger.addHandler(said)
    remat_logger.setLevel(logging.INFO)
    try:
        trainer.train()
    finally:
        remat_logger.removeHandler(said)
        remat_logger.setLevel(level)
    trainable = [(n, p) for n, p in cm.model.named_parameters() if p.requires_grad]
    adapters = {}
    for name, parameter in trainable:  # ZeRO-3's shards, whole, one at a time: DeepSpeed < 0.19.8 gathers a
        with deepspeed.zero.GatheredParameters([parameter]):  # list on gloo waiting on its last handle only, so
            adapters[name] = parameter.detach().clone()  # another could still be arriving (PR #8539)
    return {
        "best": trainer.state.best_model_checkpoint,
        "adapters": adapters,
        "at_end": change.at_end,
        "config": cm.checkpoint_config.to_dict(),
        "model_kept": trainer.model is cm.model,
        "said": [m for m in said.messages if "best" in m or "subfolder" in m],
    }


def save_ungathered(model) -> dict:
    """ZeRO-3 without `stage3_gather_16bit_weights_on_model_save`: what the checkpoint's adapter file holds, and what
    remat warned (transformers 4.57 saves an empty state dict there; 5 gathers the trainable parameters itself)."""
    with open(ZERO3_CONFIG) as file:
        config = json.load(file)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    output_dir = os.path.join(OUT, "ungathered")
    trainer = RematTrainer(model=CheckpointedModel(model), args=_arguments(output_dir, 2, config), train_dataset=ROWS)
    warnings = _Warnings()
    logging.getLogger("remat").addHandler(warnings)
    try:
        trainer.train()
    finally:
        logging.getLogger("remat").removeHandler(warnings)
    saved = os.path.join(output_dir, "checkpoint-2", "adapter_model.safetensors")
    tensors = len(load_file(saved)) if int(os.environ["RANK"]) == 0 else None
    return {"tensors": tensors, "warnings": [m for m in warnings.messages if "stage3_gather_16bit" in m]}


class _Warnings(logging.Handler):
    def __init__(self, level: int = logging.WARNING):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def refuse_swap(model) -> dict:
    """Block swap of layers whose weights ZeRO-3 partitioned: refused before anything moves."""
    engine, *_ = deepspeed.initialize(
        model=model,
        config={"train_batch_size": 2, "zero_optimization": {"stage": 3}, "optimizer": ADAMW},
        model_parameters=[p for p in model.parameters() if p.requires_grad],
    )
    before = {n: p.ds_tensor.clone() for n, p in model.named_parameters()}
    try:
        CheckpointedModel(model, CheckpointConfig(swap_layers=2))
        message = None
    except BlockSwapError as err:
        message = str(err)
    unchanged = all(torch.equal(before[n], p.ds_tensor) for n, p in model.named_parameters())
    return {"refused": message, "unchanged": unchanged}


def main() -> None:
    sys.addaudithook(_audit)
    for cls in (PeftModel, PreTrainedModel):
        _saves_recorded(cls)
    rank = int(os.environ["RANK"])
    models = {policy: (lora_model(), lora_model(), lora_model()) for policy in MAPS}
    swapped, ungathered, named = lora_model(), lora_model(), named_lora_model()
    results = {policy: train(policy, *models[policy]) for policy in MAPS}
    if STAGE == 3:
        results["best"] = best_model(named)
        results["ungathered"] = save_ungathered(ungathered)
        results["swap"] = refuse_swap(swapped)
    results["deepspeed"] = deepspeed.__version__
    torch.save(results, os.path.join(OUT, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    os._exit(0)  # the results are written; leave without gloo's teardown (see trainer_worker.py)


if __name__ == "__main__":
    main()
