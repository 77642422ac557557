"""LoRA fine-tuning with remat under DDP, launched by torchrun or accelerate.

    torchrun --nproc-per-node 2 examples/train_distributed.py
    accelerate launch --config_file configs/accelerate/multi_cpu.yaml examples/train_distributed.py

Every rank wraps its model the same way, so the map is the same everywhere; remat's recompute
runs inside DDP's forward, with every parameter marked ready once. Each rank prints its map's
checkpointed layers and how often each layer ran in the last step (2 = recomputed).
"""

from __future__ import annotations

import argparse
import sys

import torch
from accelerate import Accelerator

from remat import CheckpointConfig, CheckpointedModel
from remat.demo import add_lora, batches, build_model, load_assets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--every-n-layers", type=int, default=2)
    parser.add_argument("--offload", action="store_true")
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
    optimizer = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=3e-3)
    model, optimizer = accelerator.prepare(cm, optimizer)
    data = batches(text, seq=64, size=2, seed=accelerator.process_index)
    for _ in range(args.steps):
        runs[:] = [0] * len(runs)
        batch = {k: v.to(accelerator.device) for k, v in next(data).items()}
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    line = (
        f"rank {accelerator.process_index}/{accelerator.num_processes}: checkpointed {cm.checkpoint_map.checkpointed}, "
        f"runs per layer in the last step {runs}, loss {loss.item():.3f}\n"
    )
    sys.stdout.write(line)  # one write: the ranks share stdout, and print() writes the newline apart
    sys.stdout.flush()


if __name__ == "__main__":
    main()
