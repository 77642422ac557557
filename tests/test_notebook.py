"""The notebook runs from a clean kernel on CPU, and is committed without outputs."""

import ast
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "finetune_lora.ipynb"


def test_notebook_is_committed_without_outputs_and_runs_from_a_clean_kernel(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.get("outputs") and cell.get("execution_count") is None for cell in code)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    printed = "".join(
        output.get("text", "") for cell in code for output in cell.outputs if output.get("output_type") == "stream"
    )
    assert "swapped layers are always checkpointed" in printed
    assert "every second layer" in printed and "True True" in printed
    losses = ast.literal_eval(next(line for line in printed.splitlines() if line.startswith("[")))
    assert losses[-1] < losses[0]
    assert (tmp_path / "notebook_output" / "adapters" / "checkpoint_config.json").exists()
    checkpoint = {p.name for p in (tmp_path / "notebook_output" / "checkpoint-20").iterdir()}
    assert {"adapter_model.safetensors", "checkpoint_config.json"} <= checkpoint
    assert "model.safetensors" not in checkpoint
