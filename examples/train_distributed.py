"""LoRA fine-tuning with remat under DDP, FSDP2 or DeepSpeed, launched by torchrun or accelerate.

    torchrun --nproc-per-node 2 examples/train_distributed.py            # DDP
    torchrun --nproc-per-node 2 examples/train_distributed.py --fsdp2    # FSDP2 (fully_shard)
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml examples/train_distributed.py
    torchrun --nproc-per-node 2 examples/train_distributed.py --deepspeed configs/deepspeed/zero3.json

Every rank wraps its model the same way, so the map is the same everywhere; remat's recompute
runs inside the engine's forward (DDP: every parameter marked ready once; FSDP2 and ZeRO-3: with
the layer's parameters gathered). Each rank prints the engine, its map's checkpointed layers and
how often each layer ran in the last step (2 = recomputed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from remat import CheckpointConfig, CheckpointedModel
from remat.demo import add_lora, batches, build_model, load_assets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--every-n-layers", type=int, default=2)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--fsdp2", action="store_true", help="shard with fully_shard (each layer, then the model)")
    parser.add_argument("--deepspeed", metavar="CONFIG", help="train with DeepSpeed's engine, from this JSON config")
    args = parser.parse_args()

    accelerator = Accelerator()
    model_config, text = load_assets()
    torch.manual_seed(0)  # the same weights on every rank
    cm = CheckpointedModel(
        add_lora(build_model(model_config)),
        CheckpointConfig(
            every_n_layers=args.every_n_layers, checkpoint_policy="offload" if args.offload else "recompute"
        ),
    )
    runs = [0] * len(cm.layers)
    for i, layer in enumerate(cm.layers):
        next(iter(layer.children())).register_forward_pre_hook(lambda m, a, i=i: runs.__setitem__(i, runs[i] + 1))
    if args.fsdp2:  # wrap first, then shard: remat's shims sit on the layers FSDP2 shards
        from torch.distributed.fsdp import fully_shard

        for layer in cm.layers:
            fully_shard(layer)
        fully_shard(cm.model)
    trainable = [p for p in cm.parameters() if p.requires_grad]
    if args.deepspeed:  # DeepSpeed's engine and optimizer around the wrapper; it steps in its own backward
        import deepspeed

        config = _filled(json.loads(Path(args.deepspeed).read_text()), batch_size=2, lr=3e-3)
        model, optimizer, *_ = deepspeed.initialize(model=cm, model_parameters=trainable, config=config)
    elif args.fsdp2:
        model, optimizer = cm, accelerator.prepare(torch.optim.AdamW(trainable, lr=3e-3))
    else:  # accelerate wraps the model in DDP
        model, optimizer = accelerator.prepare(cm, torch.optim.AdamW(trainable, lr=3e-3))
    data = batches(text, seq=64, size=2, seed=accelerator.process_index)
    for _ in range(args.steps):
        runs[:] = [0] * len(runs)
        batch = {k: v.to(accelerator.device) for k, v in next(data).items()}
        loss = model(**batch).loss
        if args.deepspeed:
            model.backward(loss)
            model.step()
        else:
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    line = (
        f"rank {accelerator.process_index}/{accelerator.num_processes}: {_engine(model)}, "
        f"checkpointed {cm.checkpoint_map.checkpointed}, "
        f"runs per layer in the last step {runs}, loss {loss.item():.3f}\n"
    )
    sys.stdout.write(line)  # one write: the ranks share stdout, and print() writes the newline apart
    sys.stdout.flush()


def _filled(config: dict, *, batch_size: int, lr: float) -> dict:
    """The config's "auto" values (Trainer's, which fills them from TrainingArguments) filled as this loop runs."""
    values = {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1}
    config = {key: values.get(key, value) if value == "auto" else value for key, value in config.items()}
    if config.get("optimizer", {}).get("params", {}).get("lr") == "auto":
        config["optimizer"] = {**config["optimizer"], "params": {**config["optimizer"]["params"], "lr": lr}}
    return config


def _engine(model: torch.nn.Module) -> str:
    if not isinstance(model, CheckpointedModel):
        return type(model).__name__  # DistributedDataParallel, DeepSpeedEngine
    return "FSDP2" if type(model.model).__name__.startswith("FSDP") else "one process"


if __name__ == "__main__":
    main()
