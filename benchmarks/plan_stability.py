"""Plans that hold on a busy machine: one model and batch profiled several times, the same plan?

    python benchmarks/plan_stability.py --preset small --busy 2       # the RESULTS.md run
    python benchmarks/plan_stability.py --preset small --busy 0 --profiles 1 --rounds 3 --repeats 5

1. Busy: `--busy N` processes `python -c "while True: pass"` (nice 0) run while the model is
   profiled `--profiles` times (the same wrapper, the same batch); they are killed afterwards.
   Compared: each profile's frontier (every undominated map), and its plan at `--budgets`
   budgets spread evenly from the smallest map to the largest (the plan at any budget is the
   last frontier map that fits it, so equal frontiers give equal plans at every budget).
2. Quieter: with the busy processes gone, `--rounds` rounds of one more profile and then each
   distinct plan of the grid (the first quiet profile's) enabled and its step (forward and
   backward, as the profile times it) measured, alternated over `--repeats`. A plan's prediction
   is the median of the rounds' profiles' predictions for its map, its measurement the median of
   every round's steps: profiles and steps sample the same minutes, so a machine that drifts
   (this VM: up to a fifth in two minutes) moves both alike. Each round's own ratio (its profile
   against its steps, the protocol of `--rounds 1`) is kept beside it.

The load average (1 minute, from /proc/loadavg) is recorded before, during and after: other
processes may be running too. Profiling's cost is recorded in wall and process-CPU seconds and
in steps of the wrapper as it was before planning (every layer recomputed). Writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

from remat import CheckpointedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pareto import _run_module

HERE = Path(__file__).resolve().parent


def load() -> float:
    with open("/proc/loadavg") as handle:
        return float(handle.read().split()[0])


def busy_loops(count: int) -> list[subprocess.Popen]:
    """`count` processes spinning at nice 0 (where allowed), whatever this one's niceness."""

    def nice_zero() -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=nice_zero) for _ in range(count)]


def profiled(cm, batch, repeats: int) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    profile = cm.profile(batch, repeats=repeats, progress=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    t = profile.measurements.time
    return {
        "profile": profile,
        "wall_s": wall,
        "cpu_s": cpu,
        "load": load(),
        "ms_per_gflop": t.seconds_per_flop * 1e12,
        "ms_per_gflop_quartiles": [r * 1e12 for r in t.rate_range],
        "selective_share": t.selective_share,
        "recompute_ms_per_layer": [round(p.seconds["recompute"] * 1e3, 2) for p in profile.measurements.layers],
        "base_ms": profile.measurements.base_seconds * 1e3,
        "notes": list(profile.notes),
    }


def maps(profile) -> list[str]:
    return ["".join(c.policy[0] for c in p.choices) for p in profile.frontier()]


def plans(profile, budgets: list[int]) -> list[str | None]:
    out = []
    for budget in budgets:
        try:
            out.append("".join(c.policy[0] for c in profile.plan(budget).choices))
        except ValueError:
            out.append(None)
    return out


def main(argv: list[str] | None = None) -> dict:
    run = _run_module()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(run.PRESETS), default="small")
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes while profiling")
    parser.add_argument("--profiles", type=int, default=3)
    parser.add_argument("--plan-repeats", type=int, default=3, help="repeats of each profile's timed steps")
    parser.add_argument("--budgets", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5, help="alternated timed steps per plan (quieter part)")
    parser.add_argument("--rounds", type=int, default=1, help="quiet profiles, each followed by the timed steps")
    parser.add_argument("--skip-measure", action="store_true", help="only the busy profiles")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    preset = run.PRESETS[args.preset]
    cm = CheckpointedModel(run.build(preset, preset["layers"], torch.float32, "cpu"))
    batch = run.make_batch(preset, preset["seq"], "cpu")
    step_cpu = []
    for _ in range(3):
        started = time.process_time()
        run.step(cm, batch)
        step_cpu.append(time.process_time() - started)

    before = load()
    loops = busy_loops(args.busy)
    try:
        busy = [profiled(cm, batch, args.plan_repeats) for _ in range(args.profiles)]
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    smallest = min(p["profile"].frontier()[0].predicted_device_bytes for p in busy)
    largest = max(p["profile"].frontier()[-1].predicted_device_bytes for p in busy)
    budgets = [smallest + (largest - smallest) * k // (args.budgets - 1) for k in range(args.budgets)]
    frontiers = [maps(p["profile"]) for p in busy]
    grids = [plans(p["profile"], budgets) for p in busy]
    results = {
        "command": "python benchmarks/plan_stability.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": args.preset,
        "threads": torch.get_num_threads(),
        "busy_loops": args.busy,
        "load_before": before,
        "step_cpu_s_every_layer_recomputed": statistics.median(step_cpu),
        "busy_profiles": [{k: v for k, v in p.items() if k != "profile"} for p in busy],
        "frontiers": frontiers,
        "same_frontier": all(f == frontiers[0] for f in frontiers),
        "budgets_bytes": budgets,
        "same_plan_at_every_budget": all(g == grids[0] for g in grids),
        "plans_at_budgets": grids[0],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"plan-stability-{args.preset}-cpu.json"
    path.write_text(json.dumps(results, indent=2) + "\n")  # the busy part, should the rest be stopped
    print(markdown(results), flush=True)
    if not args.skip_measure:
        results["quieter"] = measure_plans(run, cm, batch, budgets, args.plan_repeats, args.repeats, args.rounds)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(markdown(results).split("\nquieter:")[1].join(["\nquieter:", ""]))
    return results


def measure_plans(run, cm, batch, budgets: list[int], plan_repeats: int, repeats: int, rounds: int) -> dict:
    """Rounds of a profile on the quieter machine and then each distinct plan of the budgets timed; each
    map's prediction (the rounds' median) against its measurement (every round's steps, median)."""
    from remat import CheckpointConfig
    from remat.planner.chooser import predicted

    loads, profiles, chosen = [load()], [], {}
    times: dict[str, list[list[float]]] = {}
    for _ in range(rounds):
        cm.enable(CheckpointConfig())
        quiet = profiled(cm, batch, plan_repeats)
        profiles.append(quiet)
        for budget in budgets if not chosen else ():
            try:
                planned = quiet["profile"].plan(budget)
            except ValueError:
                continue
            chosen.setdefault("".join(c.policy[0] for c in planned.choices), planned)
        steps: dict[str, list[float]] = {name: [] for name in chosen}
        for _ in range(repeats):
            for name, planned in chosen.items():
                cm.enable(planned)
                steps[name].append(run.step(cm, batch))
        for name in chosen:
            times.setdefault(name, []).append(steps[name])
        loads.append(load())
    cm.enable(CheckpointConfig())
    rows = []
    for name, planned in chosen.items():
        policies = [c.policy for c in planned.choices]
        each = [predicted(p["profile"].measurements, policies) for p in profiles]
        every = [t for round_times in times[name] for t in round_times]
        predicted_s, measured = statistics.median(e.seconds for e in each), statistics.median(every)
        ranges = [e.seconds_range for e in each if e.seconds_range is not None]
        low, high = (statistics.median(r[k] for r in ranges) for k in (0, 1)) if ranges else (predicted_s, predicted_s)
        rows.append(
            {
                "map": name,
                "predicted_ms": predicted_s * 1e3,
                "predicted_quartiles_ms": [low * 1e3, high * 1e3],  # medians over the rounds
                "predicted_by_round_ms": [e.seconds * 1e3 for e in each],
                "measured_ms": measured * 1e3,
                "measured_by_round_ms": [statistics.median(t) * 1e3 for t in times[name]],
                "measured_quartiles_ms": [q * 1e3 for q in statistics.quantiles(every, n=4)],
                "predicted_over_measured": predicted_s / measured,
                "by_round": [e.seconds / statistics.median(t) for e, t in zip(each, times[name], strict=True)],
            }
        )
    return {
        "profile": {k: v for k, v in profiles[0].items() if k != "profile"},
        "profiles": [{k: v for k, v in p.items() if k != "profile"} for p in profiles],
        "loads": loads,
        "plans": rows,
    }


def markdown(results: dict) -> str:
    lines = [
        f"busy loops: {results['busy_loops']}; load average before {results['load_before']:.2f}",
        "",
        "| profile | wall s | CPU s | load | ms per GFLOP (quartiles) | selective share | recompute ms a layer "
        "| frontier maps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, (p, f) in enumerate(zip(results["busy_profiles"], results["frontiers"], strict=True), 1):
        q1, q3 = p["ms_per_gflop_quartiles"]
        share = "-" if p["selective_share"] is None else f"{p['selective_share']:.2f}"
        lines.append(
            f"| {k} | {p['wall_s']:.1f} | {p['cpu_s']:.1f} | {p['load']:.2f} | {p['ms_per_gflop']:.1f} "
            f"({q1:.1f}-{q3:.1f}) | {share} | {p['recompute_ms_per_layer'][0]:.1f} | {len(f)} |"
        )
    lines += [
        "",
        f"same frontier: {results['same_frontier']}; same plan at all {len(results['budgets_bytes'])} budgets: "
        f"{results['same_plan_at_every_budget']}",
        "",
        "frontier (n = none, s = selective, r = recompute, per layer): " + ", ".join(results["frontiers"][0]),
    ]
    quiet = results.get("quieter")
    if quiet:
        p = quiet["profile"]
        lines += [
            "",
            f"quieter: load average {quiet['loads'][0]:.2f} before, {quiet['loads'][-1]:.2f} after; "
            f"{len(quiet['profiles'])} round(s), profile {p['wall_s']:.1f} s wall, {p['cpu_s']:.1f} s CPU",
            "",
            "| map | predicted ms (quartiles) | measured ms (quartiles) | predicted / measured | each round's |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in quiet["plans"]:
            lo, hi = row["predicted_quartiles_ms"]
            mlo, _, mhi = row["measured_quartiles_ms"]
            rounds = ", ".join(f"{r:.3f}" for r in row["by_round"])
            lines.append(
                f"| {row['map']} | {row['predicted_ms']:.1f} ({lo:.0f}-{hi:.0f}) | {row['measured_ms']:.1f} "
                f"({mlo:.0f}-{mhi:.0f}) | {row['predicted_over_measured']:.3f} | {rounds} |"
            )
        ratios = [row["predicted_over_measured"] for row in quiet["plans"]]
        within = sum(abs(r - 1) <= 0.1 for r in ratios)
        lines += ["", f"within 10%: {within} of {len(ratios)} ({min(ratios):.3f}-{max(ratios):.3f})"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
