"""A budget in the config against one static plan sized for the longest step, on a GRPO-shaped run.

    python benchmarks/budget.py --steps 200

A tiny Llama with LoRA (the "tiny" preset of run.py, wider), SGD (no optimizer state: the step's peak is
weights, gradients and activations), one sequence a step whose length is drawn from a long tail between
16 and 512 tokens (log-normal, most short, a few long: completion lengths of an RL run). Both runs train
the same steps in the same order on the same budget:

- "budget": `CheckpointConfig(budget=..., budget_scope="step")`: profiled on the first step, re-planned per
  token bucket (the first step's profiling counted in its time);
- "static": one plan for the longest step (`cm.profile(longest batch).plan(budget, tokens=512)`), made
  before the run (its profiling not counted).

The budget is `--margin` times the least step peak predicted for the longest step: the longest recompute
most layers, shorter steps less or none. Afterwards every distinct length of the budget run is
stepped once more under torch's `MemTracker` (`remat.testing.measure_step_peak`, not timed), and the
steps over the budget are counted. For steps whose bucket was planned before, the choice (its plan looked
up, the profile checked against the model) and the whole pre-step call (the map applied when the bucket
changed) are timed around the budget's own calls.
"""

import argparse
import random
import statistics
import time

import run
import torch

from remat import CheckpointConfig, CheckpointedModel
from remat.budget import BudgetState
from remat.planner.measuring import batch_length, batch_tokens
from remat.testing import measure_step_peak

PRESET = dict(hidden=128, layers=6, intermediate=352, heads=4, kv_heads=2, vocab=2048, batch=1, seq=512)


def lengths(steps: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(16, min(512, int(rng.lognormvariate(4.2, 0.8)))) for _ in range(steps)]


def batch_of(seq: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, PRESET["vocab"], (1, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def train(cm, seqs, optimizer) -> float:
    per_step = []
    for step, seq in enumerate(seqs):
        data = batch_of(seq, step)
        started = time.perf_counter()
        cm(**data).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_step.append(time.perf_counter() - started)
    return sum(per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3, help="runs of each, alternated")
    parser.add_argument("--margin", type=float, default=1.1, help="the budget over the longest step's least peak")
    args = parser.parse_args()
    seqs = lengths(args.steps, args.seed)
    longest = max(seqs)

    probe = CheckpointedModel(run.build(PRESET, PRESET["layers"], torch.float32, "cpu"))
    sgd = torch.optim.SGD([p for p in probe.parameters() if p.requires_grad], lr=1e-3)
    profile = probe.profile(batch_of(longest, 0), optimizer=sgd, progress=False)
    least = profile.frontier(scope="step", tokens=longest)[0].predicted_peak_bytes
    budget = int(least * args.margin)
    static_plan = profile.plan(budget, scope="step", tokens=longest)
    probe.disable()

    choose_times: list[float] = []  # the plan of a bucket planned before: looked up, its profile checked
    step_times: list[float] = []  # the whole pre-step call on such a bucket, the map applied when it changes
    inner_choice, inner_step = BudgetState._plan_for, BudgetState.before_step

    def planned_before(self, tokens, length):
        return self.profile is not None and self._bucket(tokens, length) in self.plans

    def choice(self, controller, batch, tokens, length, targets):
        cached = planned_before(self, tokens, length)
        begun = time.perf_counter()
        planned = inner_choice(self, controller, batch, tokens, length, targets)
        if cached:
            choose_times.append(time.perf_counter() - begun)
        return planned

    def pre_step(self, controller, batch):
        cached = planned_before(self, batch_tokens(batch), batch_length(batch))
        begun = time.perf_counter()
        inner_step(self, controller, batch)
        if cached:
            step_times.append(time.perf_counter() - begun)

    # the benchmark's own timers around the two calls (nothing else changes)
    BudgetState._plan_for, BudgetState.before_step = choice, pre_step
    results: dict[str, list[float]] = {}
    for name in ("budget", "static") * args.runs:  # alternated
        model = run.build(PRESET, PRESET["layers"], torch.float32, "cpu")
        cm = CheckpointedModel(model, CheckpointConfig(budget=budget) if name == "budget" else static_plan)
        optimizer = torch.optim.SGD([p for p in cm.parameters() if p.requires_grad], lr=1e-3)
        results.setdefault(name, []).append(train(cm, seqs, optimizer))
        if name == "budget":
            budget_cm, budget_opt = cm, optimizer
            first = max(r.planning_seconds for r in cm.budget_receipts)  # the first step's profile and plan
            results.setdefault("budget's first-step profiling", []).append(first)
    BudgetState._plan_for, BudgetState.before_step = inner_choice, inner_step

    over, peaks = 0, {}
    for seq in sorted(set(seqs)):
        peaks[seq] = measure_step_peak(budget_cm, batch_of(seq, 0), budget_opt)
        over += seqs.count(seq) * (peaks[seq] > budget)
    worst = max(peaks, key=lambda s: peaks[s] / budget)
    print(
        f"steps {args.steps}, lengths {min(seqs)}-{longest} (median {statistics.median(seqs)}), budget "
        f"{budget / 2**20:.2f} MiB (step peak, {args.margin}x the longest step's least)"
    )
    recomputed = sum(c.policy != "none" for c in static_plan.choices)
    print(f"static plan for {longest} tokens: {recomputed} of {len(static_plan.choices)} layers recomputed")
    for name, totals in results.items():
        print(f"{name}: {', '.join(f'{t:.2f}' for t in totals)} s (median {statistics.median(totals):.2f})")
    ratio = statistics.median(results["budget"]) / statistics.median(results["static"])
    print(f"budget / static, medians (the budget's profiling counted): {ratio:.3f} ({(1 - ratio) * 100:.1f}% less)")
    print(
        f"steps over the budget (MemTracker, every distinct length): {over} of {len(seqs)}; worst {worst} tokens "
        f"{peaks[worst] / 2**20:.2f} MiB = {peaks[worst] / budget:.3f} of the budget"
    )
    for what, times in (("choosing a planned bucket's plan", choose_times), ("the whole pre-step call", step_times)):
        print(
            f"{what}: median {statistics.median(times) * 1e3:.3f} ms, 90th percentile "
            f"{statistics.quantiles(times, n=10)[-1] * 1e3:.3f} ms over {len(times)} steps"
        )
    print("| bucket (tokens) | steps | layers recomputed | predicted step peak MiB |")
    print("| --- | --- | --- | --- |")
    for r in sorted(budget_cm.budget_receipts, key=lambda r: r.bucket_tokens):
        recomputed = sum(p != "none" for p in r.policies)
        print(f"| {r.bucket_tokens} | {r.steps} | {recomputed} | {r.predicted_bytes / 2**20:.2f} |")


if __name__ == "__main__":
    main()
