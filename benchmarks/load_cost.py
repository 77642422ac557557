"""What a remat load costs against PEFT's own load of the same folder.

    python benchmarks/load_cost.py                      # ~250 MB adapter file, 7 alternated repeats
    python benchmarks/load_cost.py --rank 64 --repeats 3  # a quick look

One save (a LoRA of large rank on every projection of a small, wide Llama built from a config) is
written once into a folder under the system's temporary folder (never the repository). Then,
alternated so that drift in the machine's speed hits both alike, each repeat times

- PEFT: `PeftModel.from_pretrained(base, folder)`;
- remat: `CheckpointedModel.from_pretrained(base, folder)` (PEFT's load, plus remat's checks:
  reading and parsing `checkpoint_config.json`, the sha256 fingerprints of the adapter file and its
  `adapter_config.json`, the architecture and layer checks, and wrapping),

each on a fresh copy of the same base model (the copy is not timed). Reported: medians, and
remat / PEFT. The page cache is warm for both (the save was just written, and every load reads
the same files).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import transformers

from remat import CheckpointedModel

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(hidden: int, layers: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=550, help="LoRA rank (550: a ~250 MB adapter file)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the timings as JSON here")
    args = parser.parse_args()

    from peft import LoraConfig, PeftModel, get_peft_model

    pristine = base_model(args.hidden, args.layers)
    work = tempfile.mkdtemp(prefix="remat-load-cost-")
    folder = os.path.join(work, "save")
    try:
        lora = LoraConfig(r=args.rank, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
        CheckpointedModel(get_peft_model(copy.deepcopy(pristine), lora)).save_pretrained(folder)
        size = os.path.getsize(os.path.join(folder, "adapter_model.safetensors"))
        print(f"adapter_model.safetensors: {size / 1e6:.1f} MB in {folder}")

        def peft_load(base: torch.nn.Module) -> None:
            PeftModel.from_pretrained(base, folder)

        def remat_load(base: torch.nn.Module) -> None:
            CheckpointedModel.from_pretrained(base, folder)

        times: dict[str, list[float]] = {"peft": [], "remat": []}
        for repeat in range(args.repeats):
            order = [("peft", peft_load), ("remat", remat_load)]
            if repeat % 2:
                order.reverse()
            for name, load in order:
                base = copy.deepcopy(pristine)
                gc.collect()
                start = time.perf_counter()
                load(base)
                times[name].append(time.perf_counter() - start)
                del base
                gc.collect()
            print(f"repeat {repeat + 1}: peft {times['peft'][-1]:.3f} s, remat {times['remat'][-1]:.3f} s")
        peft, mine = statistics.median(times["peft"]), statistics.median(times["remat"])
        print(f"median of {args.repeats}: peft {peft:.3f} s, remat {mine:.3f} s, remat / peft {mine / peft:.3f}")
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"bytes": size, "times": times, "ratio": mine / peft}, handle, indent=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
