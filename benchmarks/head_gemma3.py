"""The head on Gemma 3's 262k vocabulary, a family the chunked head computes since the family list grew.

    python benchmarks/head_gemma3.py --repeats 3

A Gemma 3 text model of 2 layers (hidden 128) with its 262,144-token vocabulary, LoRA r=4, one row of 512 tokens
(every label counted). Per head: the loss, the step peak without an optimizer as torch's `MemTracker` counts it
(`remat.testing.measure_step_peak`), and the forward and backward's wall time (median of `--repeats`).
"""

import argparse
import statistics
import time

import torch
import transformers
from peft import LoraConfig, get_peft_model

from remat import CheckpointConfig, CheckpointedModel
from remat.testing import measure_step_peak


def build() -> torch.nn.Module:
    config = transformers.Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    return get_peft_model(model, lora)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    args = parser.parse_args()
    ids = torch.randint(3, 262144, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids.clone()}
    for head, chunk in (("plain", None), ("chunked", args.chunk)):
        cm = CheckpointedModel(build(), CheckpointConfig(head=head, head_chunk_tokens=chunk))
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            loss = cm(**data).loss
            loss.backward()
            seconds.append(time.perf_counter() - start)
            cm.model.zero_grad(set_to_none=True)
        peak = measure_step_peak(cm, data)
        row = cm.checkpoint_map.head
        print(
            f"{row.policy}({row.chunk_tokens or ''}) loss {loss.item():.6f} step peak {peak / 2**20:.1f} MiB "
            f"step {statistics.median(seconds):.2f} s"
        )


if __name__ == "__main__":
    main()
