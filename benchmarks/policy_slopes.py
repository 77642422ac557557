"""What one layer under each policy adds to a step, measured whole, beside what a profile prices it at.

    python benchmarks/policy_slopes.py --preset tiny --repeats 21

Profiles the preset's model once, then times steps with every layer "none", every layer "recompute"
and every layer "selective", alternated, medians. Prints, per layer, the profile's price and the
measured difference of whole steps (divided by the layers), and the profile's base against the
measured all-"none" step: the checkpoint's own cost around a layer call, which no timed call sees,
shows as the gap between the two (RESULTS.md, "Predicted against measured, idle, third round").
"""

import argparse
import statistics

import run
import torch

from remat import CheckpointConfig, CheckpointedModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(run.PRESETS))
    parser.add_argument("--repeats", type=int, default=21, help="alternated steps per map")
    args = parser.parse_args()
    preset = run.PRESETS[args.preset]
    n = preset["layers"]
    cm = CheckpointedModel(run.build(preset, n, torch.float32, "cpu"))
    batch = run.make_batch(preset, preset["seq"], "cpu")
    measured = cm.profile(batch, progress=False).measurements
    maps = {name: dict.fromkeys(range(n), name) for name in ("none", "recompute", "selective")}
    times: dict[str, list[float]] = {name: [] for name in maps}
    for _ in range(args.repeats):
        for name, policies in maps.items():
            cm.enable(CheckpointConfig(layer_policies=policies))
            times[name].append(run.step(cm, batch))
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    base = measured.base_seconds * 1e3
    print(f"{args.preset}: base predicted {base:.2f} ms, all-none measured {median['none']:.2f} ms")
    for name in ("recompute", "selective"):
        priced = statistics.mean(layer.seconds[name] for layer in measured.layers) * 1e3
        print(f"{name:>9} a layer: priced {priced:.2f} ms, measured {(median[name] - median['none']) / n:.2f} ms")


if __name__ == "__main__":
    main()
