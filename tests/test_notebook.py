"""The notebook runs from a clean kernel on CPU, is committed without outputs, and teaches the
headline: everything it uses is built in its cells or documented API (no `remat.demo`),
`every_n_layers` first, then profile -> plan -> plot -> enable -> measure, a TRL cell, offload and
swap only where a device can use them; every code cell is followed by markdown about its output;
the run time it states is what it takes."""

import re
import time
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "finetune_lora.ipynb"


def _printed(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def _index(code, needle):
    return next(i for i, cell in enumerate(code) if needle in cell.source)


def test_the_notebook_teaches_the_headline_and_runs_in_the_time_it_states(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    cells = notebook.cells
    code = [cell for cell in cells if cell.cell_type == "code"]
    assert code and all(not cell.get("outputs") and cell.get("execution_count") is None for cell in code)
    assert not any("remat.demo" in cell.source or "remat.trainer" in cell.source for cell in code)
    # Each code cell is introduced by markdown that says what its output is.
    assert all(cells[i - 1].cell_type == "markdown" for i, cell in enumerate(cells) if cell.cell_type == "code" and i)
    order = [
        _index(code, "every_n_layers=2"),
        _index(code, "cm.profile("),
        _index(code, "profile.plan("),
        _index(code, "profile.plot("),
        _index(code, "cm.enable(planned)"),
        _index(code, "measure_held_activations("),
    ]
    assert order == sorted(order), order
    assert "remat_trainer_class(SFTTrainer)" in code[_index(code, "SFTTrainer")].source

    started = time.perf_counter()
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    took = time.perf_counter() - started
    stated = int(re.search(r"runs on a CPU in about (\d+) seconds", cells[0].source).group(1))
    assert took < 2.5 * stated, f"the notebook says about {stated} s; it took {took:.0f} s"

    printed = "".join(_printed(cell) for cell in code)
    # DeepSpeed, where installed, says at import (through TRL) that it found no GPU: its line, not remat's
    printed = "\n".join(line for line in printed.splitlines() if "[real_accelerator.py:" not in line)
    assert "INFO:remat" not in printed and "WARNING" not in printed, printed
    assert "every_n_layers=2 skips it" in _printed(code[order[0]])
    frontier = _printed(code[order[1]]).splitlines()[1:]
    assert len(frontier) >= 2 and frontier[0].endswith("recompute recompute recompute recompute")
    measured, predicted = re.search(
        r"held for backward: ([\d.]+) MiB measured, ([\d.]+) MiB predicted", printed
    ).groups()
    assert measured == predicted
    plot = code[order[3]].outputs
    assert any("image/png" in output.get("data", {}) for output in plot)
    trained = _printed(code[_index(code, "SFTTrainer")])
    assert "'loss'" in trained and "checkpoint_config.json" in trained and "adapter_model.safetensors" in trained
    assert "'model.safetensors'" not in trained
    offload = code[_index(code, "swap_layers=2")]
    assert "if torch.cuda.is_available():" in offload.source
    assert "no GPU here" in _printed(offload)  # this suite runs on a CPU: said plainly
    assert "True True" in printed
    assert (tmp_path / "notebook_output" / "adapters" / "checkpoint_config.json").exists()
