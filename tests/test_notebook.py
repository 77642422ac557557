"""The notebook runs from a clean kernel on CPU, and is committed without outputs. It uses only
the API the README documents, and prints only what a reader wants to read."""

import ast
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "finetune_lora.ipynb"


def test_notebook_is_committed_without_outputs_and_runs_from_a_clean_kernel(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.get("outputs") and cell.get("execution_count") is None for cell in code)
    assert not any("remat.integrations" in cell.source for cell in code), "an undocumented helper"
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    printed = "".join(
        output.get("text", "") for cell in code for output in cell.outputs if output.get("output_type") == "stream"
    )
    assert "swapped layers are always checkpointed" in printed
    assert "INFO:remat" not in printed
    comparison = next(cell for cell in code if "compare_policies(" in cell.source)
    shown = "".join(output.get("text", "") for output in comparison.outputs if output.get("output_type") == "stream")
    assert len(shown.splitlines()) == 3, shown  # one line per setting, nothing else
    assert "every second layer" in printed and "True True" in printed
    losses = ast.literal_eval(next(line for line in printed.splitlines() if line.startswith("[")))
    assert losses[-1] < losses[0]
    assert (tmp_path / "notebook_output" / "adapters" / "checkpoint_config.json").exists()
    checkpoint = {p.name for p in (tmp_path / "notebook_output" / "checkpoint-20").iterdir()}
    assert {"adapter_model.safetensors", "checkpoint_config.json"} <= checkpoint
    assert "model.safetensors" not in checkpoint
