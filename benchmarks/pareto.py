"""The planner against transformers' native choices: step time against held bytes.

    python benchmarks/pareto.py --preset small      # the CPU figure in RESULTS.md

One model, one batch. Native checkpointing offers every layer, every 2nd, 3rd, 4th, or none
(`every_n_layers` through transformers' own enable, on a second copy of the model with the
same weights). For budgets from "everything checkpointed" to "nothing checkpointed" (each
native option's held bytes, and the points halfway between them), `cm.plan_for_budget` makes a
map on the remat copy. Every setting is then measured the same way: activation bytes held for
backward after forward (`remat.measure`) and step time, alternated over the repeats, medians.

For each budget the table compares the planner's map with the fastest native option that fits
it; the check is that the planner is never slower (ratio <= 1.02) and faster where native's
coarse steps leave budget unused. Writes JSON and a PNG (time against held bytes: native's
options and the planner's maps).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import sys
import warnings
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from remat import CheckpointedModel
from remat.measure import held_bytes_after, weight_storages

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
    parser.add_argument("--plan-repeats", type=int, default=3, help="timed steps per policy while planning")
    parser.add_argument("--every-n", type=int, nargs="*", default=[1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    preset = run.PRESETS[args.preset]
    dtype = getattr(torch, args.dtype)
    batch = run.make_batch(preset, preset["seq"], args.device)

    native_model = run.build(preset, preset["layers"], dtype, args.device)
    cm = CheckpointedModel(run.build(preset, preset["layers"], dtype, args.device))

    def native(every_n: int | None):
        if every_n is None:
            return run.native_setting(native_model, off=True)
        given = {"every_n_layers": every_n} if every_n != 1 else {}  # before 5.16: every layer only
        return run.native_setting(native_model, **given)

    every_n = args.every_n if run.native_supports(native_model, "every_n_layers") else [1]
    settings = {f"native every_n_layers={n}": native(n) for n in every_n}
    settings["native none"] = native(None)
    held = {name: _held(apply(), batch) for name, apply in settings.items()}

    levels = sorted(set(held.values()))
    budgets = sorted({*levels, *((a + b) // 2 for a, b in itertools.pairwise(levels))})
    plans = {}
    for budget in tqdm(budgets, desc="planning", disable=args.quiet):
        config = cm.plan_for_budget(batch, budget, repeats=args.plan_repeats)
        name = f"planned for {budget / 2**20:.2f} MiB"
        plans[name] = (budget, config)
        settings[name] = run.remat_setting(cm, config)
        held[name] = _held(settings[name](), batch)

    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in tqdm(range(args.repeats), desc="alternating repeats", disable=args.quiet):
        for name, apply in settings.items():
            times[name].append(run.step(apply(), batch))
    medians = {name: statistics.median(values) for name, values in times.items()}

    rows = []
    for name, (budget, config) in plans.items():
        fitting = [n for n in settings if n.startswith("native") and held[n] <= budget]
        best = min(fitting, key=lambda n: medians[n]) if fitting else None
        rows.append(
            {
                "budget_bytes": budget,
                "planned": {
                    p: sum(1 for c in config.choices if c.policy == p)
                    for p in ("none", "selective", "recompute", "offload")
                },
                "planned_held_bytes": held[name],
                "planned_predicted_bytes": config.predicted_device_bytes,
                "planned_step_s": medians[name],
                "native_best": best,
                "native_held_bytes": held[best] if best else None,
                "native_step_s": medians[best] if best else None,
                "ratio": medians[name] / medians[best] if best else None,
            }
        )
    results = {
        "command": "python benchmarks/pareto.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": args.preset,
        "device": args.device,
        "repeats": args.repeats,
        "native": [
            {"setting": n, "held_bytes": held[n], "step_s": medians[n]} for n in settings if n.startswith("native")
        ],
        "native_every_n": every_n,
        "budgets": rows,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"pareto-{args.preset}-{args.device}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / f"{stem}.png")
    if not args.quiet:
        print(markdown(results))
    return results


def _held(model, batch) -> int:
    device = next(model.parameters()).device  # device bytes: an offloaded input waits on the host
    loss, held = held_bytes_after(lambda: model(**batch).loss, weight_storages(model), device)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


def markdown(results: dict) -> str:
    mib = lambda b: f"{b / 2**20:.2f}"
    lines = [
        "| native option | held MiB | step ms |",
        "| --- | --- | --- |",
        *(f"| {r['setting']} | {mib(r['held_bytes'])} | {r['step_s'] * 1e3:.1f} |" for r in results["native"]),
        "",
        "| budget MiB | planner's map (none / selective / recompute / offload) | held MiB (predicted) | step ms "
        "| fastest native that fits | its held MiB | its step ms | planner / native |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["budgets"]:
        counts = " / ".join(str(r["planned"][p]) for p in ("none", "selective", "recompute", "offload"))
        native = r["native_best"] or "nothing fits"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
        native_held = mib(r["native_held_bytes"]) if r["native_held_bytes"] is not None else ""
        native_ms = f"{r['native_step_s'] * 1e3:.1f}" if r["native_step_s"] is not None else ""
        lines.append(
            f"| {mib(r['budget_bytes'])} | {counts} | {mib(r['planned_held_bytes'])} "
            f"({mib(r['planned_predicted_bytes'])}) | {r['planned_step_s'] * 1e3:.1f} | {native} | {native_held} "
            f"| {native_ms} | {ratio} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Measured step time against measured held bytes, for native's options and the planner's
    maps; each drawn with its frontier: the fastest step available at each budget (a staircase,
    since a budget between two options gets the one below)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    native = sorted((r["held_bytes"] / 2**20, r["step_s"] * 1e3, r["setting"]) for r in results["native"])
    planned = sorted((r["planned_held_bytes"] / 2**20, r["planned_step_s"] * 1e3) for r in results["budgets"])
    right = max(x for x, *_ in native + planned) * 1.03
    for points, color, marker, label in (
        (native, "#d08c40", "s", "native: every_n_layers 1..4, none"),
        (planned, "#3a78b5", "o", "remat plan_for_budget"),
    ):
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        frontier = [min(ys[: i + 1]) for i in range(len(ys))]
        ax.step([*xs, right], [*frontier, frontier[-1]], where="post", color=color, alpha=0.5, linewidth=1)
        ax.scatter(xs, ys, color=color, marker=marker, label=label, zorder=3)
    for x, y, name in native:
        ax.annotate(name.replace("native ", ""), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(
        xlabel="activation MiB held for backward (measured)",
        ylabel="median step ms",
        title=f"{results['preset']} on {results['device']}: the fastest step at each budget",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
