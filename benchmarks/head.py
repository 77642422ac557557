"""The head: a LoRA step whose logits dominate, its peak and its time, plain against chunked and TRL's fused head.

    python benchmarks/head.py --repeats 7

(`benchmarks/gpu_check.sh` runs it on a GPU: bf16, a 128k vocabulary, 2 x 4096 tokens.)

A Llama of 2 layers (hidden 256) with a 32k vocabulary, 2 x 512 tokens, LoRA on the attention and the MLP:
the logits (1024 x 32768 in fp32, 128 MiB) outweigh everything the layers hold. Per setting: the peak of one
training step with AdamW's step as torch's `MemTracker` counts it (`remat.testing.measure_step_peak`), and its
time (alternated steps, medians and quartiles). Settings: the model's own head ("plain"); remat's
`head="chunked"` at several chunk sizes, and as the planner chooses it for a third of plain's step peak
(`--budget-share`; the smallest plan where that is less); TRL's fused LM head at its defaults
(`trl.trainer.utils.add_fused_lm_head`, called as TRL's trainers call it: `model(**batch, fused_lm_head=True)`,
the loss its negative log-probabilities over the counted tokens).
"""

import argparse
import statistics
import time

import torch
import transformers
from peft import LoraConfig, get_peft_model

from remat import CheckpointConfig, CheckpointedModel
from remat.testing import measure_step_peak

PRESET = dict(hidden=256, layers=2, intermediate=688, heads=8, kv_heads=4, vocab=32768, batch=2, seq=512)


def build(p: dict, device: str, dtype: torch.dtype, seed: int = 0):
    config = transformers.LlamaConfig(
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        max_position_embeddings=p["seq"],
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = get_peft_model(
        model.to(device=device, dtype=dtype),
        LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    )
    model.train()
    return model


def make_batch(p: dict, device: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, p["vocab"], (p["batch"], p["seq"]), generator=g)
    labels = ids.clone()
    labels[:, : p["seq"] // 4] = -100  # a prompt: the first quarter is not counted
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def trl_loss(outputs, batch):
    counted = (batch["labels"][:, 1:] != -100).sum()
    return -outputs.log_probs.sum() / counted


def settings(chunks):
    out = {"plain": (CheckpointConfig(), None, {})}
    for chunk in chunks:
        out[f"chunked({chunk})"] = (CheckpointConfig(head="chunked", head_chunk_tokens=chunk), None, {})
    out["TRL fused head"] = (CheckpointConfig(), trl_loss, {"fused_lm_head": True})
    return out


def loss_op_seconds(cm, batch, chunk: int | None, repeats: int, device: str) -> list[float]:
    """The loss op alone, forward and backward, from the model's last hidden states (fixed, requiring grad):
    transformers' own (the head on every position, upcast, its causal-LM loss) or remat's chunks."""
    from remat.head import causal_lm, chunked_loss

    base = causal_lm(cm.model)
    with torch.no_grad():
        hidden = base.model(input_ids=batch["input_ids"]).last_hidden_state
    hidden.requires_grad_(True)
    head, labels, vocab = base.get_output_embeddings(), batch["labels"], base.config.vocab_size
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        if chunk is None:
            loss = base.loss_function(logits=head(hidden), labels=labels, vocab_size=vocab)
        else:
            loss = chunked_loss(head, hidden, labels, chunk)
        loss.backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
        hidden.grad = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="alternated timed steps per setting")
    parser.add_argument("--chunks", type=int, nargs="*", default=[1024, 512, 256, 128])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--budget-share", type=float, default=1 / 3, help="the planned setting's budget, of plain's peak"
    )
    for key in ("hidden", "vocab", "batch", "seq"):
        parser.add_argument(f"--{key}", type=int, default=PRESET[key])
    args = parser.parse_args()
    from trl.trainer.utils import add_fused_lm_head

    p = {**PRESET, **{key: getattr(args, key) for key in ("hidden", "vocab", "batch", "seq")}}
    batch = make_batch(p, args.device)
    runs = {}
    for name, (config, loss_fn, extra) in settings(args.chunks).items():
        model = build(p, args.device, getattr(torch, args.dtype))
        if extra:
            add_fused_lm_head(model.get_base_model(), outputs=("log_probs",))
        cm = CheckpointedModel(model, config)
        runs[name] = (cm, loss_fn, {**batch, **extra})
    losses, peaks, optimizers = {}, {}, {}

    def measured(name: str) -> None:
        cm, loss_fn, data = runs[name]
        optimizer = optimizers.setdefault(name, torch.optim.AdamW([q for q in cm.parameters() if q.requires_grad]))
        peaks[name] = measure_step_peak(cm, data, optimizer, loss_fn=loss_fn)
        out = cm(**data)
        losses[name] = float((loss_fn(out, data) if loss_fn else out.loss).detach())
        cm.zero_grad(set_to_none=True)

    for name in list(runs):
        measured(name)
    # the planner's choice: profiled with head="chunked" (no chunk), planned for a share of plain's step peak
    cm = CheckpointedModel(build(p, args.device, getattr(torch, args.dtype)), CheckpointConfig(head="chunked"))
    optimizer = torch.optim.AdamW([q for q in cm.parameters() if q.requires_grad])
    profile = cm.profile(batch, optimizer=optimizer, progress=False)
    budget = max(int(peaks["plain"] * args.budget_share), profile.frontier(scope="step")[0].predicted_peak_bytes)
    planned = profile.plan(budget, scope="step")
    cm.enable(planned)
    head = f"chunked({planned.head_chunk_tokens})" if planned.head == "chunked" else "plain"
    recomputed = sum(c.policy != "none" for c in planned.choices)
    name = f"planned for {args.budget_share:.2f} of plain's peak: {head}, {recomputed} layers recomputed"
    runs[name], optimizers[name] = (cm, None, batch), optimizer
    measured(name)
    print(
        f"planner: budget {budget / 2**20:.1f} MiB, profile {profile.profiling_seconds:.1f} s, predicted peak "
        f"{planned.predicted_peak_bytes / 2**20:.1f} MiB, measured {peaks[name] / 2**20:.1f} MiB"
    )
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (cm, loss_fn, data) in runs.items():
            start = time.perf_counter()
            out = cm(**data)
            (loss_fn(out, data) if loss_fn else out.loss).backward()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            cm.zero_grad(set_to_none=True)
    plain_peak, plain_time = peaks["plain"], statistics.median(times["plain"])
    print(f"tokens {p['batch'] * p['seq']}, vocabulary {p['vocab']}, hidden {p['hidden']}, {args.device} {args.dtype}")
    print("| setting | loss | step peak MiB | peak / plain | step ms (quartiles) | time / plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in runs:
        q1, median, q3 = (
            statistics.quantiles(times[name], n=4, method="inclusive") if len(times[name]) > 1 else [times[name][0]] * 3
        )
        print(
            f"| {name} | {losses[name]:.6f} | {peaks[name] / 2**20:.1f} | {peaks[name] / plain_peak:.2f} | "
            f"{median * 1e3:.0f} ({q1 * 1e3:.0f}-{q3 * 1e3:.0f}) | {median / plain_time:.2f} |"
        )
    # the loss op alone (head, upcast, loss; forward and backward): plain, each chunk, the planner's, alternated
    chunks = sorted({*args.chunks, *([planned.head_chunk_tokens] if planned.head == "chunked" else [])})
    ops: dict[int | None, list[float]] = {chunk: [] for chunk in (None, *chunks)}
    for _ in range(args.repeats):
        for chunk, seconds in ops.items():
            seconds += loss_op_seconds(cm, batch, chunk, 1, args.device)
    plain_op = statistics.median(ops[None])
    print(f"loss op alone, {args.repeats} alternated: plain {plain_op * 1e3:.1f} ms; chunked / plain:", end="")
    print("".join(f" {chunk}: {statistics.median(ops[chunk]) / plain_op:.2f}" for chunk in chunks))


if __name__ == "__main__":
    main()
