"""torch.compile (inductor) with every layer recomputed: remat's map against transformers' own checkpointing,
both compiled, and remat eager, on a LoRA'd Llama (4 layers, hidden 256, vocabulary 8,192, 2 x 256 tokens, CPU,
one thread). Medians of training steps taken in turn (A, B, C, A, B, C, ...) after each has compiled and warmed
up; the ratios are the result, the seconds move with the machine. Before remat compiled checkpointed layers,
its compiled step ran every layer eagerly (tests/test_compile.py counts the graphs' matmuls)."""

import statistics
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from remat import CheckpointConfig, CheckpointedModel

STEPS = 9


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=8192, use_cache=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    lora = LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    model = get_peft_model(model, lora)
    model.train()
    return model


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(1)
    ids = torch.randint(0, 8192, (2, 256))
    batch = {"input_ids": ids, "labels": ids}
    native = build()
    native.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    runs = {
        "native, compiled": torch.compile(native),
        "remat, compiled": torch.compile(CheckpointedModel(build(), CheckpointConfig())),
        "remat, eager": CheckpointedModel(build(), CheckpointConfig()),
    }
    for name, call in runs.items():  # compile and warm up
        started = time.perf_counter()
        for _ in range(2):
            call(**batch).loss.backward()
        print(f"{name}: first two steps (compiling) {time.perf_counter() - started:.1f} s", file=sys.stderr)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(STEPS):
        for name, call in runs.items():
            started = time.perf_counter()
            call(**batch).loss.backward()
            seconds[name].append(time.perf_counter() - started)
    base = statistics.median(seconds["native, compiled"])
    for name, taken in seconds.items():
        median = statistics.median(taken)
        print(f"{name:18s} median {median * 1000:7.1f} ms a step   {median / base:5.2f}x native compiled")


if __name__ == "__main__":
    main()
