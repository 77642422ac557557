"""`python -m remat.demo`: a LoRA fine-tune of a tiny model on CPU, with its checkpoint map.
Everything ships with remat (no downloads). It prints the map, the loss falling, and per setting (none, every layer,
every second layer) the median step time with its spread and activation bytes held."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import time
import warnings
from functools import partial
from importlib import resources
from typing import TYPE_CHECKING

import torch
import transformers

from .config import CheckpointConfig
from .display import mib, render_table
from .measure import held_bytes_after, weight_storages

if TYPE_CHECKING:  # the wrapper (and PEFT, which it imports) only once a script has quieted the noise
    from .model import CheckpointedModel

Row = tuple[str, float, int, tuple[float, float]]  # setting, median seconds, activation bytes held, spread


def quiet_third_party_noise() -> None:
    """Keep what scripts print theirs: at import bitsandbytes (through PEFT) warns that an optional Hub kernel cannot
    load, transformers about deprecations. The library never touches others' logging."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers.logging.set_verbosity_error()


def load_assets() -> tuple[dict, bytes]:
    folder = resources.files("remat") / "assets"
    return json.loads((folder / "tiny_llama_config.json").read_text()), (folder / "demo_text.txt").read_bytes()


def build_model(config: dict, seed: int = 0):
    torch.manual_seed(seed)
    llama = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    return transformers.AutoModelForCausalLM.from_config(llama, attn_implementation="eager")


def add_lora(model):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=targets))


def byte_tokenizer():
    """A tokenizer whose ids are the text's bytes (as `batches` reads it), with no download: `<pad>`, `<s>`, `</s>`
    take ids 0, 1, 2 (bytes text never holds), the other bytes their own value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte-level alphabet: the printable character that stands for each byte.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    stand_in = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {stand_in[b]: b for b in range(3, 256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def batches(text: bytes, seq: int, size: int, seed: int):
    data = torch.tensor(list(text), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq, (size,), generator=generator)
        ids = torch.stack([data[s : s + seq] for s in starts])
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def compare_with_spread(cm: CheckpointedModel, batch: dict, repeats: int) -> list[Row]:
    """Each setting's median step time (alternated over `repeats`), activation bytes held, and `spread` of its times."""
    settings = {
        "no checkpointing": cm.disable,
        "every layer": partial(cm.enable, CheckpointConfig(every_n_layers=1)),
        "every second layer": partial(cm.enable, CheckpointConfig(every_n_layers=2)),
    }
    memory, times = {}, {name: [] for name in settings}
    for name, select in settings.items():  # the tracking mode slows forward down: these steps are not timed
        select()
        memory[name] = held_bytes_after(lambda: cm(**batch).loss, weight_storages(cm))[1]
    for _ in range(repeats):
        for name, select in settings.items():
            select()
            start = time.perf_counter()
            cm(**batch).loss.backward()
            times[name].append(time.perf_counter() - start)
            cm.zero_grad(set_to_none=True)
    settings["every second layer"]()
    return [(name, statistics.median(times[name]), memory[name], spread(times[name])) for name in settings]


def spread(values: list[float]) -> tuple[float, float]:
    """The quartiles of repeated timings (the lowest and highest when there are fewer than three)."""
    if len(values) < 3:
        return min(values), max(values)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def unranked(rows: list[Row]) -> list[str]:
    """Pairs of settings the machine was too busy to rank: their spreads overlap."""
    return [
        f"{a} and {b}: {abs(ta - tb) * 1e3:.0f} ms apart, within the spread ({la * 1e3:.0f}-{ha * 1e3:.0f} "
        f"and {lb * 1e3:.0f}-{hb * 1e3:.0f} ms)"
        for (a, ta, _, (la, ha)), (b, tb, _, (lb, hb)) in itertools.combinations(rows, 2)
        if la <= hb and lb <= ha
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--steps", 80), ("--seq", 128), ("--batch-size", 8), ("--seed", 0)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per setting in the comparison")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    quiet_third_party_noise()  # transformers' use_cache notice, too, would repeat what the map says
    from .model import CheckpointedModel

    config, text = load_assets()
    cm = CheckpointedModel(add_lora(build_model(config, args.seed)).train(), CheckpointConfig(every_n_layers=2))
    print("remat demo: LoRA fine-tune of a tiny Llama (from remat/assets) on CPU")
    print(
        f"{args.steps} training steps, then {3 * (args.repeats + 1)} measured ones: with the defaults about 1-2 "
        "minutes on an idle CPU (the second step's time gives the estimate for this machine)\n"
    )
    print(cm.checkpoint_map, "\n")
    optimizer = torch.optim.AdamW([p for p in cm.parameters() if p.requires_grad], lr=args.lr)
    data = batches(text, args.seq, args.batch_size, args.seed)
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        loss = cm(**next(data)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}")
        if step == 2:  # the first step pays for one-time set-up
            left = (time.perf_counter() - started) * (args.steps - 2 + 3 * (args.repeats + 1))
            print(f"          (a step takes {time.perf_counter() - started:.2f} s here: about {left:.0f} s to go)")
    with cm.for_inference():
        prompt = torch.tensor([list(b"The map is ")])
        out = cm.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
        sample = bytes(out[0].tolist()).decode("utf-8", errors="replace")
        print(f"\nsample: {sample!r}\n")
    rows = compare_with_spread(cm, next(data), args.repeats)
    what = "quartiles" if args.repeats >= 3 else "lowest-highest"
    print(f"Measured here: batch {args.batch_size} x {args.seq} tokens, median of {args.repeats} steps each ({what})")
    cells = [
        (n, f"{t * 1e3:.0f} ({lo * 1e3:.0f}-{hi * 1e3:.0f})", f"{t / rows[0][1]:.2f}x", mib(b))
        for n, t, b, (lo, hi) in rows
    ]
    print(render_table(("setting", "step ms", "vs none", "activation MiB held"), cells))
    if close := unranked(rows):
        print("Too busy to rank these here (the machine's noise is larger than their difference):", *close, sep="\n  ")


if __name__ == "__main__":
    main()
