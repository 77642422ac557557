"""remat against no checkpointing and transformers' native checkpointing, side by side.

    python benchmarks/run.py --preset small            # the CPU figures in RESULTS.md
    python benchmarks/run.py --preset 1b --device cuda --dtype bfloat16

One model and one batch; every configuration runs in the same process, alternated over the
repeats so that drift in the machine's speed hits all of them alike. Reported per configuration:
median step time (forward + backward of a LoRA fine-tune), its ratio to no checkpointing and to
native checkpointing of the same layers, the activation bytes held for backward after forward
(measured by `remat.measure`, the same way for every configuration), and peak memory during the
step (RSS above the pre-step level on CPU, peak allocated on CUDA). A sweep over depth and
sequence length shows how held bytes and time grow with the work. Writes JSON and a PNG plot.

Native checkpointing runs on a second copy of the model with the same weights, so enabling and
disabling it never touches the copy remat wraps. The native enable call also registers an
input-embedding hook on every call (a known transformers defect); the benchmark removes it after
each call so repeated toggling does not pile hooks onto the native runs.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

import remat
from remat import CheckpointConfig, CheckpointedModel
from remat.measure import held_bytes_after, weight_storages

PRESETS = {
    "tiny": dict(hidden=64, layers=4, intermediate=176, heads=4, kv_heads=2, vocab=512, batch=2, seq=64),
    "small": dict(hidden=256, layers=8, intermediate=688, heads=8, kv_heads=4, vocab=2048, batch=4, seq=256),
    "1b": dict(hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8, vocab=32000, batch=1, seq=4096),
}


def build(preset: dict, layers: int, dtype: torch.dtype, device: str, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(
        vocab_size=preset["vocab"],
        hidden_size=preset["hidden"],
        intermediate_size=preset["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=preset["heads"],
        num_key_value_heads=preset["kv_heads"],
        max_position_embeddings=max(preset["seq"], 8192),
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    model = get_peft_model(model, lora).to(device)
    model.train()
    return model


def make_batch(preset: dict, seq: int, device: str) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, preset["vocab"], (preset["batch"], seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


class PeakMemory:
    """Peak CUDA memory allocated during one step, above what was allocated before it."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.bytes = torch.cuda.max_memory_allocated() - self.start


class RssPeak:
    """Resident memory sampled every half millisecond during a step, above where it started."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.peak, _rss()) - self.start


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Setting:
    name: str
    family: str  # "none", "native" or "remat"
    same_layers_as: str | None  # the native setting that checkpoints the same layers
    apply: object = None
    error: str | None = None


def _native_routes(model) -> tuple[str, str]:
    """The enable/disable names of this transformers version (renamed in 5.23)."""
    base = model.get_base_model()
    if hasattr(type(base), "activation_checkpointing_enable"):
        return "activation_checkpointing_enable", "activation_checkpointing_disable"
    return "gradient_checkpointing_enable", "gradient_checkpointing_disable"


def native_supports(model, option: str) -> bool:
    enable, _ = _native_routes(model)
    return option in inspect.signature(getattr(type(model.get_base_model()), enable)).parameters


def native_setting(model, *, off: bool = False, **kwargs):
    """A setting's `apply` for native checkpointing on `model` (a PeftModel): off, or on with
    transformers' options (`every_n_layers=2`, `offload=True`)."""

    def apply():
        base = model.get_base_model()
        enable, disable = _native_routes(model)
        getattr(base, disable)()
        if not off:
            getattr(base, enable)({"use_reentrant": False}, **kwargs)
            if hasattr(base, "_require_grads_hook"):  # the hook each enable call adds (see the module doc)
                base.disable_input_require_grads()
        return model

    return apply


def remat_setting(cm: CheckpointedModel, config: CheckpointConfig):
    """A setting's `apply` for the wrapper with `config`."""

    def apply():
        cm.enable(config)
        return cm

    return apply


def settings_for(native_model, cm: CheckpointedModel | None) -> list[Setting]:
    """Every setting compared. `cm` (or `native_model`) may be None when only one side is built."""
    native = functools.partial(native_setting, native_model)
    native_off = native(off=True)
    with_remat = functools.partial(remat_setting, cm)
    probe = native_model if native_model is not None else cm.model
    out = [
        Setting("no checkpointing", "none", None, native_off),
        Setting("native every layer", "native", None, native()),
        Setting("remat every layer", "remat", "native every layer", with_remat(CheckpointConfig())),
    ]
    if native_supports(probe, "every_n_layers"):
        out.append(Setting("native every_n_layers=2", "native", None, native(every_n_layers=2)))
    out.append(
        Setting(
            "remat every_n_layers=2",
            "remat",
            "native every_n_layers=2",
            with_remat(CheckpointConfig(every_n_layers=2)),
        )
    )
    if native_supports(probe, "offload"):
        out.append(Setting("native offload", "native", None, native(offload=True)))
    out.append(
        Setting("remat offload", "remat", "native offload", with_remat(CheckpointConfig(checkpoint_policy="offload")))
    )
    return out


def peak_in_fresh_process(args, name: str) -> int | str:
    """CPU peak memory of one setting: a new process builds the model, runs two steps of that
    setting alone, and reports its peak RSS growth over the steps (the allocator of a process
    that ran other settings first would reuse their freed memory and hide the difference)."""
    command = [sys.executable, os.path.abspath(__file__), "--preset", args.preset, "--device", args.device]
    command += ["--dtype", args.dtype, "--peak-of", name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEAK ")]
    if done.returncode != 0 or not lines:
        return f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return int(lines[-1].split()[1])


def run_peak_of(args, preset, name: str) -> None:
    dtype = getattr(torch, args.dtype)
    family = "native" if name.startswith(("native", "no ")) else "remat"
    native_model = build(preset, preset["layers"], dtype, args.device) if family == "native" else None
    cm = CheckpointedModel(build(preset, preset["layers"], dtype, args.device)) if family == "remat" else None
    setting = {s.name: s for s in settings_for(native_model, cm)}[name]
    model = setting.apply()
    step(model, make_batch(preset, 8, args.device))  # lazy initialisations, with a tiny batch
    batch = make_batch(preset, preset["seq"], args.device)
    with RssPeak() as measured:
        step(model, batch)
    print(f"PEAK {measured.bytes}")


def step(model, batch) -> float:
    start = time.perf_counter()
    model(**batch).loss.backward()
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def compare(args, preset) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    native_model = build(preset, preset["layers"], dtype, args.device)
    cm = CheckpointedModel(build(preset, preset["layers"], dtype, args.device))
    batch = make_batch(preset, preset["seq"], args.device)
    settings = settings_for(native_model, cm)
    times = {s.name: [] for s in settings}
    held, peak = {}, {}
    for s in settings:  # one untimed step each: warm-up, memory counts, and crashes surface here
        try:
            model = s.apply()
            step(model, batch)
            exclude = weight_storages(model)
            loss, held[s.name] = held_bytes_after(lambda m=model: m(**batch).loss, exclude, args.device)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if args.device == "cuda":
                with PeakMemory(args.device) as measured:
                    step(model, batch)
                peak[s.name] = measured.bytes
            elif args.peak:
                runs = [peak_in_fresh_process(args, s.name) for _ in range(args.peak_repeats)]
                numbers = [r for r in runs if isinstance(r, int)]
                peak[s.name] = int(statistics.median(numbers)) if numbers else runs[0]
            else:
                peak[s.name] = None
        except Exception as err:  # recorded in the results: a crash is a finding, not a stop
            s.error = f"{type(err).__name__}: {err}".splitlines()[0][:200]
    live = [s for s in settings if s.error is None]
    for _ in tqdm(range(args.repeats), desc="alternating repeats", disable=args.quiet):
        for s in live:
            times[s.name].append(step(s.apply(), batch))
    medians = {s.name: statistics.median(times[s.name]) for s in live}
    spreads = {s.name: spread(times[s.name]) for s in live}
    base = medians.get("no checkpointing")
    rows = []
    for s in settings:
        row = {"setting": s.name, "family": s.family, "error": s.error}
        if s.error is None:
            t = medians[s.name]
            native_t = medians.get(s.same_layers_as) if s.same_layers_as else None
            row.update(
                median_step_s=t,
                quartiles_s=spreads[s.name],
                steps=len(times[s.name]),
                vs_none=t / base if base else None,
                vs_native=t / native_t if native_t else None,
                too_close_to_native=overlap(spreads[s.name], spreads[s.same_layers_as]) if native_t else None,
                activation_bytes=held[s.name],
                peak_bytes=peak[s.name],
            )
        rows.append(row)
    return rows


def spread(values: list[float]) -> tuple[float, float]:
    """The quartiles of repeated timings (lowest and highest with fewer than three): half the
    repeats lie between them."""
    if len(values) < 3:
        return min(values), max(values)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Two settings whose spreads overlap: the machine's noise is larger than their difference,
    and this run cannot rank them."""
    return a[0] <= b[1] and b[0] <= a[1]


def sweep(args, preset) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    configs = {
        "no checkpointing": None,
        "remat every layer": CheckpointConfig(),
        "remat every_n_layers=2": CheckpointConfig(every_n_layers=2),
    }
    points = [(d, s) for d in args.sweep_depths for s in args.sweep_seqs]
    out = []
    for depth, seq in tqdm(points, desc="sweep", disable=args.quiet):
        cm = CheckpointedModel(build(preset, depth, dtype, args.device))
        batch = make_batch(preset, seq, args.device)
        times = {name: [] for name in configs}
        held = {}
        for name, config in configs.items():
            cm.enable(config) if config else cm.disable()
            step(cm, batch)
            loss, held[name] = held_bytes_after(lambda m=cm, b=batch: m(**b).loss, weight_storages(cm))
            loss.backward()
            cm.zero_grad(set_to_none=True)
        for _ in range(args.sweep_repeats):
            for name, config in configs.items():
                cm.enable(config) if config else cm.disable()
                times[name].append(step(cm, batch))
        for name in configs:
            out.append(
                {
                    "depth": depth,
                    "seq": seq,
                    "setting": name,
                    "activation_bytes": held[name],
                    "median_step_s": statistics.median(times[name]),
                }
            )
    return out


def resident_weight_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        storage = p.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def swap_sweep(args, preset) -> list[dict]:
    """Step time and peak resident weight bytes against the number of swapped layers (every
    layer checkpointed, "spread" placement), alternated over the repeats."""
    dtype = getattr(torch, args.dtype)
    cm = CheckpointedModel(build(preset, preset["layers"], dtype, args.device))
    batch = make_batch(preset, preset["seq"], args.device)
    counts = sorted({0, *args.swap_counts})
    configs = {n: CheckpointConfig(swap_layers=n) for n in counts if n <= preset["layers"]}
    peaks, times = {}, {n: [] for n in configs}
    layers = cm.layers
    for n, config in configs.items():
        cm.enable(config)
        observed = []
        handles = [
            next(iter(layer.children())).register_forward_pre_hook(
                lambda m, a, seen=observed: seen.append(resident_weight_bytes(cm.model))
            )
            for layer in layers
        ]
        step(cm, batch)
        for handle in handles:
            handle.remove()
        peaks[n] = max(observed)
    for _ in tqdm(range(args.swap_repeats), desc="swap sweep", disable=args.quiet):
        for n, config in configs.items():
            cm.enable(config)
            times[n].append(step(cm, batch))
    base = statistics.median(times[0])
    return [
        {
            "swapped_layers": n,
            "median_step_s": statistics.median(times[n]),
            "vs_no_swap": statistics.median(times[n]) / base,
            "peak_resident_weight_bytes": peaks[n],
        }
        for n in configs
    ]


def policy_table(args, preset) -> list[dict]:
    """Each policy on every layer of the same model and batch: median step time over alternated
    repeats, and the bytes each layer holds for backward after forward (device / host), from
    `cm.memory_report`. Offload only where there is a device to offload from."""
    dtype = getattr(torch, args.dtype)
    cm = CheckpointedModel(build(preset, preset["layers"], dtype, args.device))
    batch = make_batch(preset, preset["seq"], args.device)
    names = ["none", "selective", "recompute"] + (["offload"] if args.device == "cuda" else [])
    configs = {
        name: CheckpointConfig(layer_policies=dict.fromkeys(range(preset["layers"]), name), offload_min_bytes=0)
        for name in names
    }
    reports = {}
    for name, config in configs.items():
        cm.enable(config)
        step(cm, batch)
        reports[name] = cm.memory_report(batch)
        cm.zero_grad(set_to_none=True)
    times = {name: [] for name in configs}
    for _ in tqdm(range(args.policy_repeats), desc="policies", disable=args.quiet):
        for name, config in configs.items():
            cm.enable(config)
            times[name].append(step(cm, batch))
    base = statistics.median(times["none"])
    rows = []
    for name, report in reports.items():
        layers = report.layers
        rows.append(
            {
                "policy": name,
                "median_step_s": statistics.median(times[name]),
                "vs_none": statistics.median(times[name]) / base,
                "layer_device_bytes": statistics.median(layer.device_bytes for layer in layers),
                "layer_host_bytes": statistics.median(layer.host_bytes for layer in layers),
                "layers_device_bytes": sum(layer.device_bytes for layer in layers),
                "runs": [layer.runs for layer in layers],
            }
        )
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rows = [r for r in results["compare"] if r.get("error") is None]
    names = [r["setting"] for r in rows]
    colors = ["#999999" if r["family"] == "none" else "#d08c40" if r["family"] == "native" else "#3a78b5" for r in rows]
    axes[0].barh(names, [r["median_step_s"] * 1e3 for r in rows], color=colors)
    axes[0].set_xlabel("median step time (ms)")
    axes[0].invert_yaxis()
    axes[0].set_title(f"{results['preset']} on {results['device']}")
    sweep_rows = results["sweep"]
    seq = max(r["seq"] for r in sweep_rows) if sweep_rows else None
    depth = max(r["depth"] for r in sweep_rows) if sweep_rows else None
    for name in sorted({r["setting"] for r in sweep_rows}):
        by_depth = sorted(
            (r["depth"], r["activation_bytes"] / 2**20) for r in sweep_rows if r["setting"] == name and r["seq"] == seq
        )
        by_seq = sorted(
            (r["seq"], r["median_step_s"] * 1e3) for r in sweep_rows if r["setting"] == name and r["depth"] == depth
        )
        axes[1].plot([d for d, _ in by_depth], [b for _, b in by_depth], marker="o", label=name)
        axes[2].plot([s for s, _ in by_seq], [t for _, t in by_seq], marker="o", label=name)
    axes[1].set(xlabel="layers", ylabel="activation MiB held", title=f"held for backward, seq {seq}")
    axes[2].set(xlabel="sequence length", ylabel="median step ms", title=f"step time, {depth} layers")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mib(value) -> str:
    return f"{value / 2**20:.1f}" if isinstance(value, int) else (value or "")


def markdown(results: dict) -> str:
    lines = []
    if results.get("compare"):
        lines += [
            "| setting | median step ms (quartiles) | vs none | vs native, same layers | activation MiB held "
            "| peak MiB of the step |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
    fmt = lambda v, spec: "" if v is None else format(v, spec)
    for r in results["compare"]:
        if r["error"]:
            lines.append(f"| {r['setting']} | failed: {r['error']} | | | | |")
            continue
        low, high = r.get("quartiles_s") or (r["median_step_s"], r["median_step_s"])
        versus = fmt(r["vs_native"], ".3f") + (" (too close to rank here)" if r.get("too_close_to_native") else "")
        lines.append(
            f"| {r['setting']} | {r['median_step_s'] * 1e3:.1f} ({low * 1e3:.0f}-{high * 1e3:.0f}) | "
            f"{fmt(r['vs_none'], '.3f')} | {versus} | {r['activation_bytes'] / 2**20:.2f} | {_mib(r['peak_bytes'])} |"
        )
    if results.get("policies"):
        lines += [
            "",
            "| policy (every layer) | median step ms | vs none | held per layer MiB (device / host) | all layers MiB |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in results["policies"]:
            lines.append(
                f"| {r['policy']} | {r['median_step_s'] * 1e3:.1f} | {r['vs_none']:.3f} | "
                f"{r['layer_device_bytes'] / 2**20:.2f} / {r['layer_host_bytes'] / 2**20:.2f} | "
                f"{r['layers_device_bytes'] / 2**20:.2f} |"
            )
    if results.get("swap"):
        lines += [
            "",
            "| swapped layers | median step ms | vs no swap | peak resident weights MiB |",
            "| --- | --- | --- | --- |",
        ]
        for r in results["swap"]:
            lines.append(
                f"| {r['swapped_layers']} | {r['median_step_s'] * 1e3:.1f} | {r['vs_no_swap']:.3f} | "
                f"{r['peak_resident_weight_bytes'] / 2**20:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sweep-depths", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--sweep-seqs", type=int, nargs="*", default=[128, 256, 512])
    parser.add_argument("--sweep-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--swap-counts", type=int, nargs="*", default=[2, 4, 8], help="swapped layers to compare")
    parser.add_argument("--swap-repeats", type=int, default=7)
    parser.add_argument("--peak-repeats", type=int, default=3, help="CPU: fresh processes per setting (median)")
    parser.add_argument("--policy-repeats", type=int, default=9, help="alternated repeats of the policy table")
    parser.add_argument(
        "--sections",
        nargs="*",
        default=["compare", "sweep", "swap", "policies"],
        choices=["compare", "sweep", "swap", "policies"],
        help="what to measure (default: everything)",
    )
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--no-peak", dest="peak", action="store_false", help="CPU: skip the per-setting peak runs")
    parser.add_argument("--peak-of", help=argparse.SUPPRESS)  # internal: one setting's peak, in this process
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    preset = PRESETS[args.preset]
    if args.peak_of:
        run_peak_of(args, preset, args.peak_of)
        return {}
    args.out.mkdir(parents=True, exist_ok=True)

    results = {
        "command": "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": args.preset,
        "model": preset,
        "device": args.device,
        "dtype": args.dtype,
        "versions": {
            "remat": remat.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads": torch.get_num_threads()},
        "compare": compare(args, preset) if "compare" in args.sections else [],
        "sweep": sweep(args, preset) if "sweep" in args.sections and args.sweep_depths and args.sweep_seqs else [],
        "swap": swap_sweep(args, preset) if "swap" in args.sections and args.swap_counts else [],
        "policies": policy_table(args, preset) if "policies" in args.sections else [],
    }
    if args.device == "cuda":
        results["machine"]["gpu"] = torch.cuda.get_device_name()
    (args.out / f"results-{args.preset}-{args.device}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / f"results-{args.preset}-{args.device}.png")
    if not args.quiet:
        print(markdown(results))
    return results


if __name__ == "__main__":
    main()
