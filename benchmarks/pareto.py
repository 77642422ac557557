"""The planner against transformers' native choices: step time against memory, both scopes.

    python benchmarks/pareto.py --preset small      # the CPU tables in RESULTS.md

One model, one batch, an AdamW over the LoRA weights. Native checkpointing offers every layer,
every 2nd, 3rd, 4th, or none (`every_n_layers` through transformers' own enable, on a second copy
of the model with the same weights). remat profiles once (`cm.profile(batch, optimizer=...)`,
timed: its cost in training steps), then plans, without running the model again:

- scope "activations": for budgets from "everything checkpointed" to "nothing checkpointed"
  (each native option's held bytes, and the points halfway between);
- scope "step": for budgets at each native option's step peak and halfway between.

Every setting is then measured the same way: held activations after forward (a dispatch-mode
count written here, device bytes only), the peak of a whole training step (forward, backward,
optimizer step, after a first step made the optimizer's state: torch's `MemTracker` on a CPU,
`torch.cuda.max_memory_allocated` on a GPU), and step time, alternated over the repeats, medians.
Each planned map is compared with the fastest native option that fits its budget, and its
predicted step time with the measured one. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import statistics
import sys
import time
import warnings
import weakref
from pathlib import Path

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from tqdm.auto import tqdm

from remat import CheckpointedModel

HERE = Path(__file__).resolve().parent


def _run_module():
    """benchmarks/run.py: the presets, the model and batch builders, the timed step."""
    spec = importlib.util.spec_from_file_location("remat_benchmark_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    run = _run_module()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(run.PRESETS), default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=9, help="alternated timed steps per setting")
    parser.add_argument("--plan-repeats", type=int, default=3, help="timed steps per policy while profiling")
    parser.add_argument("--every-n", type=int, nargs="*", default=[1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument(
        "--scopes",
        nargs="*",
        default=["activations", "step"],
        choices=["activations", "step"],
        help="which budgets to plan (step peaks are measured with MemTracker: slow on a CPU at the small preset)",
    )
    parser.add_argument(
        "--cost-only",
        action="store_true",
        help="only the cost of profiling, in CPU seconds of this process (robust to other processes on the machine)",
    )
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    preset = run.PRESETS[args.preset]
    dtype = getattr(torch, args.dtype)
    batch = run.make_batch(preset, preset["seq"], args.device)
    if args.cost_only:
        return profiling_cost(run, preset, dtype, args, batch)

    native_model = run.build(preset, preset["layers"], dtype, args.device)
    cm = CheckpointedModel(run.build(preset, preset["layers"], dtype, args.device))
    optimizers = {id(m): _optimizer(m) for m in (native_model, cm)}

    def native(every_n: int | None):
        if every_n is None:
            return run.native_setting(native_model, off=True)
        given = {"every_n_layers": every_n} if every_n != 1 else {}  # before 5.16: every layer only
        return run.native_setting(native_model, **given)

    every_n = args.every_n if run.native_supports(native_model, "every_n_layers") else [1]
    settings = {f"native every_n_layers={n}": native(n) for n in every_n}
    settings["native none"] = native(None)
    held = {name: _held(apply(), batch) for name, apply in settings.items()}
    stepping = "step" in args.scopes
    peaks = {name: _peak(apply(), batch, optimizers[id(native_model)]) for name, apply in settings.items() if stepping}

    # the cost of profiling, in steps of the wrapper as it is before planning (every layer recomputed)
    before = [run.step(cm, batch) for _ in range(3)]
    started = time.perf_counter()
    profile = cm.profile(batch, optimizer=optimizers[id(cm)], repeats=args.plan_repeats, progress=not args.quiet)
    profiling_s = time.perf_counter() - started
    step_s = statistics.median([*before, *(run.step(cm, batch) for _ in range(2))])

    plans = {}
    for scope, levels in (("activations", held), ("step", peaks)):
        if scope not in args.scopes:
            continue
        marks = sorted(set(levels.values()))
        for budget in sorted({*marks, *((a + b) // 2 for a, b in itertools.pairwise(marks))}):
            try:
                config = profile.plan(budget, scope=scope)
            except ValueError as err:  # below every map: said in the table
                plans[f"{scope} {budget}"] = (scope, budget, None, str(err).split(":")[0])
                continue
            name = f"planned ({scope}) for {budget / 2**20:.2f} MiB"
            plans[name] = (scope, budget, config, None)
            settings[name] = run.remat_setting(cm, config)
            held[name] = _held(settings[name](), batch)
            if stepping:
                peaks[name] = _peak(settings[name](), batch, optimizers[id(cm)])

    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in tqdm(range(args.repeats), desc="alternating repeats", disable=args.quiet):
        for name, apply in settings.items():
            times[name].append(run.step(apply(), batch))
    medians = {name: statistics.median(values) for name, values in times.items()}
    spreads = {name: run.spread(values) for name, values in times.items()}

    rows, refusals = [], []
    for name, (scope, budget, config, refused) in plans.items():
        if config is None:
            refusals.append({"scope": scope, "budget_bytes": budget, "refused": refused})
            continue
        measure = held if scope == "activations" else peaks
        fitting = [n for n in settings if n.startswith("native") and measure[n] <= budget]
        best = min(fitting, key=lambda n: medians[n]) if fitting else None
        predicted = config.predicted_device_bytes if scope == "activations" else config.predicted_peak_bytes
        rows.append(
            {
                "scope": scope,
                "budget_bytes": budget,
                "planned": {
                    p: sum(1 for c in config.choices if c.policy == p)
                    for p in ("none", "selective", "recompute", "offload")
                },
                "planned_bytes": measure[name],
                "planned_held_bytes": held[name],
                "planned_peak_bytes": peaks.get(name),
                "planned_predicted_bytes": predicted,
                "planned_step_s": medians[name],
                "planned_predicted_step_s": config.predicted_seconds,
                "native_best": best,
                "native_bytes": measure[best] if best else None,
                "native_step_s": medians[best] if best else None,
                "ratio": medians[name] / medians[best] if best else None,
                "planned_quartiles_s": spreads[name],
                "planned_predicted_quartiles_s": config.predicted_seconds_range,
                "too_close_to_rank": run.overlap(spreads[name], spreads[best]) if best else None,
            }
        )
    results = {
        "command": "python benchmarks/pareto.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": args.preset,
        "device": args.device,
        "repeats": args.repeats,
        "profiling": {
            "seconds": profiling_s,
            "step_s": step_s,
            "steps_worth": profiling_s / step_s,
            "plan_repeats": args.plan_repeats,
        },
        "native": [
            {"setting": n, "held_bytes": held[n], "peak_bytes": peaks.get(n), "step_s": medians[n]}
            for n in settings
            if n.startswith("native")
        ],
        "native_every_n": every_n,
        "budgets": rows,
        "refused": refusals,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"pareto-{args.preset}-{args.device}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / f"{stem}.png")
    profile.plot(scope="step" if stepping else "activations").savefig(
        args.out / f"frontier-{args.preset}-{args.device}.png", dpi=110
    )
    if not args.quiet:
        print(markdown(results))
    return results


def profiling_cost(run, preset, dtype, args, batch) -> dict:
    """What `cm.profile` costs, in training steps (forward, backward, optimizer step) of the
    wrapper as it is before planning (every layer recomputed): CPU seconds of this process (other
    processes on a shared machine do not count) and wall seconds (they do: what a user waits);
    medians of 5 steps; without and with an optimizer (the step's peak measured too)."""
    cm = CheckpointedModel(run.build(preset, preset["layers"], dtype, args.device))
    optimizer = _optimizer(cm)

    def timed(work) -> tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        work()
        return time.process_time() - cpu, time.perf_counter() - wall

    def step() -> None:
        cm(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timed(step)  # warm-up: the optimizer's state is made
    steps = [timed(step) for _ in range(5)]
    step_cpu, step_wall = (statistics.median(s[k] for s in steps) for k in (0, 1))
    without = timed(lambda: cm.profile(batch, repeats=args.plan_repeats, progress=False))
    with_optimizer = timed(lambda: cm.profile(batch, optimizer=optimizer, repeats=args.plan_repeats, progress=False))
    with open("/proc/loadavg") as handle:
        load = float(handle.read().split()[0])
    results = {
        "command": "python benchmarks/pareto.py " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "threads": torch.get_num_threads(),
        "load_average_1min_after": load,
        "step_cpu_s": step_cpu,
        "step_wall_s": step_wall,
        "profile_cpu_s": without[0],
        "profile_wall_s": without[1],
        "profile_with_optimizer_cpu_s": with_optimizer[0],
        "profile_with_optimizer_wall_s": with_optimizer[1],
        "steps_worth": without[0] / step_cpu,
        "steps_worth_wall": without[1] / step_wall,
        "steps_worth_with_optimizer": with_optimizer[0] / step_cpu,
        "steps_worth_with_optimizer_wall": with_optimizer[1] / step_wall,
        "plan_repeats": args.plan_repeats,
    }
    if not args.quiet:
        print(json.dumps(results, indent=2))
    return results


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


class _Outputs(TorchDispatchMode):
    """Weak references to every tensor an op returns (written here: no remat code measures remat)."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def _held(model, batch) -> int:
    """Activation bytes alive after forward, on the model's device (an offloaded input waits on the host)."""
    device = next(model.parameters()).device
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    mode = _Outputs()
    # the collection frees the cycles forward left; older objects are frozen out of its sight (they made no
    # output recorded here), so it takes milliseconds, not the 0.2-0.3 s of walking every object
    frozen_here = not gc.get_freeze_count()
    if frozen_here:
        gc.freeze()
    try:
        with mode:
            loss = model(**batch).loss
        gc.collect()
    finally:
        if frozen_here:
            gc.unfreeze()
    seen = {}
    for ref in mode.refs:
        t = ref()
        if t is None or t.device != device:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and storage.data_ptr() != 0:
            seen[storage.data_ptr()] = storage.nbytes()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


class _NoHook:
    def remove(self):
        pass


def _peak(model, batch, optimizer) -> int:
    """The peak of a whole training step after a first one made the optimizer's state (MemTracker
    on a CPU, the allocator's peak on a GPU). Parameters and optimizer state are put back."""
    saved = {p: p.detach().clone() for g in optimizer.param_groups for p in g["params"]}

    def step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer, *[v for v in batch.values() if isinstance(v, torch.Tensor)])
        with tracker:
            for p in model.parameters():  # torch 2.13's MemTracker hooks every parameter; frozen ones refuse
                if not p.requires_grad:
                    tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            step()
        peak = int(sum(counts["Total"] for counts in tracker.get_tracker_snapshot("peak").values()))
    with torch.no_grad():
        for p, value in saved.items():
            p.copy_(value)
    optimizer.state.clear()  # as it was: made fresh, never stepped
    return peak


def markdown(results: dict) -> str:
    mib = lambda b: f"{b / 2**20:.2f}"
    ms = lambda s: f"{s * 1e3:.1f}"
    cost = results["profiling"]
    lines = [
        f"profiling: {cost['seconds']:.1f} s = {cost['steps_worth']:.1f} steps of {ms(cost['step_s'])} ms "
        f"(every layer recomputed; repeats={cost['plan_repeats']})",
        "",
        "| native option | held MiB | step peak MiB | step ms |",
        "| --- | --- | --- | --- |",
        *(
            f"| {r['setting']} | {mib(r['held_bytes'])} | {mib(r['peak_bytes']) if r['peak_bytes'] else ''} "
            f"| {ms(r['step_s'])} |"
            for r in results["native"]
        ),
    ]
    for scope, what in (("activations", "held MiB"), ("step", "step peak MiB")):
        if not any(r["scope"] == scope for r in results["budgets"]):
            continue
        lines += [
            "",
            f'scope="{scope}":',
            "",
            f"| budget MiB | planner's map (none / selective / recompute / offload) | {what} (predicted) "
            "| step ms (predicted) | fastest native that fits | its MiB | its step ms | planner / native |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in results["refused"]:
            if r["scope"] == scope:
                lines.append(f"| {mib(r['budget_bytes'])} | refused: {r['refused']} | | | | | | |")
        for r in results["budgets"]:
            if r["scope"] != scope:
                continue
            counts = " / ".join(str(r["planned"][p]) for p in ("none", "selective", "recompute", "offload"))
            native = r["native_best"] or "nothing fits"
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
            ratio += " (too close to rank here)" if r.get("too_close_to_rank") else ""
            native_bytes = mib(r["native_bytes"]) if r["native_bytes"] is not None else ""
            native_ms = ms(r["native_step_s"]) if r["native_step_s"] is not None else ""
            lines.append(
                f"| {mib(r['budget_bytes'])} | {counts} | {mib(r['planned_bytes'])} "
                f"({mib(r['planned_predicted_bytes'])}) | {ms(r['planned_step_s'])} "
                f"({ms(r['planned_predicted_step_s'])}) | {native} | {native_bytes} | {native_ms} | {ratio} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Measured step time against measured bytes, per scope, for native's options and the
    planner's maps; each drawn with its frontier: the fastest step available at each budget (a
    staircase, since a budget between two options gets the one below)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, (scope, key, label) in zip(
        axes,
        (("activations", "held_bytes", "activation MiB held for backward"), ("step", "peak_bytes", "step peak MiB")),
        strict=True,
    ):
        native = sorted((r[key] / 2**20, r["step_s"] * 1e3, r["setting"]) for r in results["native"] if r[key])
        planned = sorted(
            (r["planned_bytes"] / 2**20, r["planned_step_s"] * 1e3) for r in results["budgets"] if r["scope"] == scope
        )
        if not native:
            ax.set_visible(False)
            continue
        right = max(x for x, *_ in native + planned) * 1.03
        for points, color, marker, name in (
            (native, "#d08c40", "s", "native: every_n_layers 1..4, none"),
            (planned, "#3a78b5", "o", f'remat profile.plan(scope="{scope}")'),
        ):
            if not points:
                continue
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            frontier = [min(ys[: i + 1]) for i in range(len(ys))]
            ax.step([*xs, right], [*frontier, frontier[-1]], where="post", color=color, alpha=0.5, linewidth=1)
            ax.scatter(xs, ys, color=color, marker=marker, label=name, zorder=3)
        for x, y, name in native:
            ax.annotate(name.replace("native ", ""), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel=f"{label} (measured)", ylabel="median step ms", title=f'scope="{scope}"')
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['preset']} on {results['device']}: the fastest step at each budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
