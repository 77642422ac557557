"""The benchmark's smallest configuration, run as a smoke test: it completes and writes its
JSON and plot with every setting measured. No timing is asserted."""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("remat_benchmark_run", RUN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_smallest_benchmark_runs_and_writes_json_and_plot(bench, tmp_path):
    args = ["--preset", "tiny", "--repeats", "1", "--sweep-depths", "1", "2", "--sweep-seqs", "16"]
    args += ["--swap-counts", "2", "4", "--swap-repeats", "1", "--policy-repeats", "1"]
    results = bench.main([*args, "--sweep-repeats", "1", "--out", str(tmp_path), "--quiet", "--no-peak"])
    written = json.loads((tmp_path / "results-tiny-cpu.json").read_text())
    assert written["compare"] == json.loads(json.dumps(results["compare"]))
    assert (tmp_path / "results-tiny-cpu.png").stat().st_size > 10_000
    rows = {r["setting"]: r for r in results["compare"]}
    for name in (
        "no checkpointing",
        "native every layer",
        "remat every layer",
        "remat every_n_layers=2",
        "remat offload",
    ):
        assert rows[name]["error"] is None and rows[name]["steps"] == 1
    assert rows["remat every layer"]["vs_native"] is not None
    # Same layers checkpointed, same activation bytes held, whichever implementation runs them.
    assert rows["remat every layer"]["activation_bytes"] == rows["native every layer"]["activation_bytes"]
    assert rows["remat every layer"]["activation_bytes"] < rows["no checkpointing"]["activation_bytes"]
    depths = sorted({r["depth"] for r in results["sweep"]})
    assert depths == [1, 2] and len(results["sweep"]) == 2 * 3
    assert "| remat every layer |" in bench.markdown(results)
    policies = {r["policy"]: r for r in results["policies"]}
    assert list(policies) == ["none", "selective", "recompute"]  # no offload row without a device
    held = [policies[name]["layer_device_bytes"] for name in ("none", "selective", "recompute")]
    assert held[0] > held[1] > held[2] > 0
    assert policies["none"]["runs"] == [1] * 4 and policies["selective"]["runs"] == [2] * 4
    assert "| selective |" in bench.markdown(results)
    swap = {r["swapped_layers"]: r for r in results["swap"]}
    assert sorted(swap) == [0, 2, 4]
    assert (
        swap[4]["peak_resident_weight_bytes"]
        < swap[2]["peak_resident_weight_bytes"]
        < swap[0]["peak_resident_weight_bytes"]
    )


def test_the_rss_peak_sees_a_known_allocation_freed_before_the_end(bench):
    size = 64 * 2**20
    with bench.RssPeak() as measured:
        block = torch.ones(size // 4)  # every page written, so it is resident
        time.sleep(0.05)  # a few samples while it lives
        del block
    assert 0.9 * size <= measured.bytes <= 1.5 * size


def test_cpu_peak_of_one_setting_is_measured_in_a_fresh_process(bench):
    args = bench.argparse.Namespace(preset="tiny", device="cpu", dtype="float32")
    peak = bench.peak_in_fresh_process(args, "remat every layer")
    assert isinstance(peak, int), f"the fresh process did not report its peak: {peak}"


def test_the_gpu_check_script_runs_its_cpu_fallback_and_writes_the_tables(tmp_path):
    """benchmarks/gpu_check.sh, as a session with a device would run it; here, its CPU fallback."""
    import os
    import subprocess

    script = RUN.parent / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CPU fallback" in done.stdout and "gpu_check: done (cpu, preset tiny)" in done.stdout
    policies = (tmp_path / "gpu-check-run.log").read_text()
    assert "| selective |" in policies and "| recompute |" in policies
    assert "| planner / native |" in (tmp_path / "gpu-check-pareto.log").read_text()
    head = (tmp_path / "gpu-check-head.log").read_text()
    assert "| chunked(32) |" in head and "| TRL fused head |" in head
    pareto = json.loads((tmp_path / "pareto-tiny-cpu.json").read_text())
    assert [r["setting"] for r in pareto["native"]] == ["native every_n_layers=1", "native none"]
    assert all(r["planned_held_bytes"] <= r["budget_bytes"] for r in pareto["budgets"])
    assert (tmp_path / "pareto-tiny-cpu.png").stat().st_size > 10_000


def test_plan_stability_interleaves_profiles_with_the_timed_steps_and_takes_medians(tmp_path, monkeypatch):
    """benchmarks/plan_stability.py with two quiet rounds: each plan has one prediction and one measurement
    per round, and the reported figures are their medians (the rounds sample the same minutes)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ first
    for name in ("pareto", "remat_benchmark_run"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location("remat_plan_stability", RUN.parent / "plan_stability.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = ["--preset", "tiny", "--busy", "0", "--profiles", "1", "--plan-repeats", "1", "--budgets", "3"]
    results = module.main([*args, "--rounds", "2", "--repeats", "1", "--out", str(tmp_path)])
    for name in ("pareto", "remat_benchmark_run"):
        sys.modules.pop(name, None)
    quiet = results["quieter"]
    assert len(quiet["profiles"]) == 2 and len(quiet["loads"]) == 3 and quiet["plans"]
    for row in quiet["plans"]:
        assert len(row["predicted_by_round_ms"]) == len(row["measured_by_round_ms"]) == len(row["by_round"]) == 2
        assert row["predicted_ms"] == pytest.approx(sum(row["predicted_by_round_ms"]) / 2)
        assert row["predicted_over_measured"] == pytest.approx(row["predicted_ms"] / row["measured_ms"])
    written = json.loads((tmp_path / "plan-stability-tiny-cpu.json").read_text())
    assert [r["map"] for r in written["quieter"]["plans"]] == [r["map"] for r in quiet["plans"]]


def test_the_budget_benchmark_runs_its_timers_around_the_budgets_own_calls():
    """benchmarks/budget.py wraps the budget's planning calls with its timers: a change of their arguments broke it
    without a test saying so. Eight steps: it completes, every distinct length within the budget, both timers ran."""
    import subprocess

    script = RUN.parent / "budget.py"
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "8", "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "steps over the budget (MemTracker, every distinct length): 0 of 8" in done.stdout, done.stdout
    assert (
        "choosing a planned bucket's plan: median" in done.stdout and "the whole pre-step call: median" in done.stdout
    )


def test_the_gemma3_head_benchmark_runs_both_heads_to_the_same_loss():
    """benchmarks/head_gemma3.py at 32 tokens: both heads run, the chunked one on Gemma 3 (a family it computes), to
    the same loss (its printed figures are what RESULTS.md quotes)."""
    import re
    import subprocess

    done = subprocess.run(
        [sys.executable, str(RUN.parent / "head_gemma3.py"), "--repeats", "1", "--tokens", "32", "--chunk", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    losses = re.findall(r"^(plain\(\)|chunked\(8\)) loss (\S+)", done.stdout, re.MULTILINE)
    assert [head for head, _ in losses] == ["plain()", "chunked(8)"], done.stdout
    assert float(losses[0][1]) == pytest.approx(float(losses[1][1]), rel=1e-5)
