"""RematTrainer on two gloo processes (launched by torchrun): train two steps with a
checkpoint at step 2, then resume a wrapper with another map from it and train one more.

argv: out_dir tests_dir [fsdp]. Each rank prints one line "RESULT {json}" with its rank, the
config the resumed wrapper ended with, the files of checkpoint-2, and the engine Trainer wrapped
the model in. With "fsdp", Trainer shards with accelerate's FSDP2 (it needs GPUs: on CPUs
accelerate runs DDP instead, or refuses FSDP).
"""

import json
import os
import sys

sys.path.insert(0, sys.argv[2])

import torch
from conftest import add_lora, batch, tiny_model
from transformers import TrainingArguments

from remat import CheckpointConfig, CheckpointedModel, RematTrainer
from remat.testing import trainer_checkpointing_args


def main() -> None:
    out = sys.argv[1]
    fsdp = sys.argv[3:] == ["fsdp"]
    engine = (
        {"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
        if fsdp
        else {"use_cpu": True, "ddp_backend": "gloo"}
    )
    rows = [{k: v[0] for k, v in batch(seed=seed, size=1).items()} for seed in range(8)]

    def args(steps: int) -> TrainingArguments:
        return TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=1,
            learning_rate=1e-2,
            save_strategy="steps",
            save_steps=2,
            # transformers before 5.24 cannot reload an optimizer saved by multi-CPU runs
            # (map_location "cpu:0"); the model files and the map are what this run checks
            save_only_model=True,
            report_to=[],
            seed=7,
            **engine,
            **trainer_checkpointing_args(True, None),
        )

    saved = CheckpointConfig(every_n_layers=2, layer_policies={3: "recompute"})
    RematTrainer(model=CheckpointedModel(add_lora(tiny_model(seed=3)), saved), args=args(2), train_dataset=rows).train()
    resumed = CheckpointedModel(add_lora(tiny_model(seed=3)))
    trainer = RematTrainer(model=resumed, args=args(3), train_dataset=rows)
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    result = {
        "rank": trainer.args.process_index,
        "world": trainer.args.world_size,
        "restored": resumed.checkpoint_config == saved,
        "files": sorted(os.listdir(os.path.join(out, "checkpoint-2"))),
        "engine": type(trainer.model_wrapped).__name__,
    }
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")  # one write: both ranks share stdout
    sys.stdout.flush()
    # Trainer leaves the process group open; gloo's threads torn down at interpreter exit abort
    # the process now and then ("terminate called without an active exception")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # and a rank has also hung at exit, joining a thread, after its result was written (2026-12-02, under load):
    # the result is out and flushed, so leave without the interpreter's teardown
    os._exit(0)


if __name__ == "__main__":
    main()
