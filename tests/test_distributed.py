"""remat under DDP and FSDP2: two gloo processes on the CPU, compared with one process on the
full batch.

Both ranks run every case in one process group (starting processes is the slow part); each test
bounds the run in time and kills what is left.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import add_lora, assert_same_grads, batch, free_port, step_grads, tiny_model

WORKER = Path(__file__).parent / "distributed" / "ddp_worker.py"
CASES = {
    "every-layer": "1,0,0,wrapper",
    "every-2nd": "2,0,0,model",
    "offload": "2,1,0,wrapper",
    "swap-wrapper": "2,0,2,wrapper",
    "swap-model": "1,0,2,model",
    "reentrant": "1,0,0,wrapper,reentrant",
    "reentrant-find-unused": "2,0,0,model,reentrant,find_unused",
    "fsdp2-every-layer": "1,0,0,fsdp",
    "fsdp2-every-2nd": "2,0,0,fsdp",
    "fsdp2-offload": "2,1,0,fsdp",
}
REFUSED = {"fsdp2-swap": "1,0,2,fsdp"}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    port, world = str(free_port()), 2
    command = [sys.executable, str(WORKER)]
    procs = [
        subprocess.Popen(
            [*command, str(r), str(world), port, str(out), *CASES.values(), *REFUSED.values()],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]
    cases = {**CASES, **REFUSED}
    return {name: [torch.load(out / f"{case}-rank{r}.pt") for r in range(world)] for name, case in cases.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_ddp_gradients_equal_one_process_on_the_full_batch(ddp_results, name):
    every_n, _, swap, *_ = CASES[name].split(",")
    ranks = ddp_results[name]
    torch.manual_seed(0)
    model = add_lora(tiny_model(attention_dropout=0.0), dropout=0.0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    _, expected = step_grads(model, named, batch(size=4))
    for rank in ranks:
        assert_same_grads(expected, rank["grads"], rtol=1e-5, atol=1e-6)
    assert ranks[0]["counts"] == ranks[1]["counts"], "the map runs identically on every rank"
    checkpointed = {i for i in range(4) if i % int(every_n) == 0} | ({1, 3} if int(swap) else set())
    assert ranks[0]["counts"] == [2 if i in checkpointed else 1 for i in range(4)]


@pytest.mark.parametrize("name", [name for name in CASES if name.startswith("fsdp2")])
def test_fsdp2_gathers_each_layer_exactly_twice_a_step_checkpointed_or_not(ddp_results, name):
    """`fully_shard` per layer (reshard after forward): a layer is gathered for its forward and again
    for its backward; a checkpointed layer's recompute runs inside that backward on the same gather,
    never a third (pytorch #175406: nested units inside a checkpointed unit gathered twice more)."""
    for rank in ddp_results[name]:
        layer_gathers = [n for n in rank["gathers"] if n == rank["layer_numel"]]
        assert len(layer_gathers) == 2 * 4, rank["gathers"]
        assert len(rank["gathers"]) - len(layer_gathers) == 1, "the root unit: gathered once, kept through backward"


def test_block_swap_on_fsdp2_sharded_layers_is_refused_before_anything_moves(ddp_results):
    for rank in ddp_results["fsdp2-swap"]:
        assert rank["refused"] and "FSDP" in rank["refused"]
        assert rank["unchanged"]


def test_reentrant_under_ddp_is_replaced_by_non_reentrant_and_said_once(ddp_results):
    """Once per process: each rank says it in the first case that asks for reentrant (two steps,
    one line), and not again in the next one."""
    for first, later in zip(ddp_results["reentrant"], ddp_results["reentrant-find-unused"], strict=True):
        assert [m for m in first["logs"] if "use_reentrant=True is ignored" in m] != []
        assert len([m for m in first["logs"] if "use_reentrant=True is ignored" in m]) == 1
        assert not [m for m in later["logs"] if "use_reentrant=True is ignored" in m]


def _readme_launch_lines() -> list[str]:
    """The launch lines of the README's "Beyond one GPU" section, as written there."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Beyond one GPU", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


LAUNCH_LINES = _readme_launch_lines()
ENGINES = {"--fsdp2": "FSDP2", "deepspeed": "DeepSpeedEngine"}  # else DDP


def _launch_id(line: str) -> str:
    engine = next((name for flag, name in ENGINES.items() if flag in line), "DDP")
    return f"{engine}-{line.split()[0]}"


@pytest.mark.parametrize("line", LAUNCH_LINES, ids=[_launch_id(line) for line in LAUNCH_LINES])
def test_each_launch_line_of_the_readme_runs_two_ranks_with_the_map(line):
    """Run as written, on two CPU processes (ACCELERATE_USE_CPU, DS_ACCELERATOR as the README says), with a free
    port and two steps added; each rank reports the engine the line asks for and the map's runs per layer."""
    if "deepspeed" in line:
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (a test extra; make test installs it)")
    root = Path(__file__).resolve().parents[1]
    launcher, *rest = line.split()
    port = str(free_port())
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--master-port", port, *rest]
    else:
        assert [launcher, rest[0]] == ["accelerate", "launch"], line
        command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--main_process_port", port, *rest[1:]]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([*command, "--steps", "2"], capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    # other output of the two processes may share a line with ours: find the lines anywhere
    lines = sorted(re.findall(r"rank \d/2: [^\n]*", done.stdout))
    assert [line.split(":")[0] for line in lines] == ["rank 0/2", "rank 1/2"], done.stdout[-2000:]
    engine = next((name for flag, name in ENGINES.items() if flag in line), "DistributedDataParallel")
    expected = f"{engine}, checkpointed [0, 2, 4], runs per layer in the last step [2, 1, 2, 1, 2, 1]"
    assert all(expected in each for each in lines), lines


def test_the_readme_gives_a_launch_line_for_each_engine_and_launcher():
    assert len(LAUNCH_LINES) == 6
    assert {("--fsdp2" in line, "deepspeed" in line, line.split()[0]) for line in LAUNCH_LINES} == {
        (False, False, "torchrun"),
        (False, False, "accelerate"),
        (True, False, "torchrun"),
        (True, False, "accelerate"),
        (False, True, "torchrun"),
        (False, True, "accelerate"),
    }


def _remat_trainer_run(tmp_path, processes, *flags):
    worker = Path(__file__).parent / "distributed" / "trainer_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    command += ["--master_port", str(free_port()), str(worker), str(tmp_path), str(Path(__file__).parent), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^\n]*\})", done.stdout)), key=lambda r: r["rank"])
    assert [(r["rank"], r["world"]) for r in results] == [(rank, processes) for rank in range(processes)]
    assert all(r["restored"] for r in results)
    files = set(results[0]["files"])
    assert {"adapter_model.safetensors", "checkpoint_config.json"} <= files and "model.safetensors" not in files
    return results


def test_remat_trainer_under_ddp_saves_adapters_with_the_config_and_every_rank_resumes_the_map(tmp_path):
    results = _remat_trainer_run(tmp_path, 2)
    assert {r["engine"] for r in results} == {"DistributedDataParallel"}


# accelerate 1.15 on a CPU (checked 2026-12-02): Trainer's fsdp= without use_cpu fails ("Using fsdp only works in
# distributed training"), with use_cpu=True accelerate runs DDP instead; FSDP2 itself on CPUs is tested above
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="accelerate runs FSDP on GPUs only (DDP on CPUs)")
def test_cuda_remat_trainer_under_accelerates_fsdp2_saves_adapters_with_the_config_and_resumes_the_map(tmp_path):
    processes = min(torch.cuda.device_count(), 2)
    results = _remat_trainer_run(tmp_path, processes, "fsdp")
    # FSDP2 turns the model's class into FSDP<class> in place
    assert all(r["engine"].startswith("FSDP") for r in results), results
