"""Every Python example in README.md runs, each with the names the README says are given.

The examples are read from the README itself, so an example that is changed there is the one
tested. The DDP and FSDP2 examples run in a process group of one gloo process (what several
processes do together is tested in test_distributed.py).
"""

import re
from pathlib import Path

import datasets
import pytest
import torch
import torch.distributed as dist
from conftest import add_lora, batch, free_port, tiny_model
from transformers import TrainingArguments

from remat import CheckpointConfig, CheckpointedModel, RematTrainer, remat_trainer_class
from remat.demo import byte_tokenizer

README = Path(__file__).parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
LAYERS = 6  # the API example names layer 5
VOCAB = 256  # the byte tokenizer's


def _given(tmp_path):
    base = tiny_model(num_hidden_layers=LAYERS, vocab_size=VOCAB)
    base.save_pretrained(tmp_path / "base")
    prompt_ids = batch(seed=3)["input_ids"][:, :4]
    return {
        "model": add_lora(tiny_model(num_hidden_layers=LAYERS, vocab_size=VOCAB)),
        "cm": CheckpointedModel(
            add_lora(tiny_model(num_hidden_layers=LAYERS, vocab_size=VOCAB)), CheckpointConfig(every_n_layers=2)
        ),
        "config": CheckpointConfig(every_n_layers=2),
        "batch": batch(),
        "prompt": {
            "input_ids": prompt_ids,
            "attention_mask": torch.ones_like(prompt_ids),
            "max_new_tokens": 3,
            "do_sample": False,
            "pad_token_id": 0,
        },
        "args": TrainingArguments(
            output_dir=str(tmp_path / "trainer"),
            max_steps=2,
            per_device_train_batch_size=2,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
        ),
        "data": [{k: v[0] for k, v in batch(seed=i, size=1).items()} for i in range(4)],
        "BASE": str(tmp_path / "base"),
        "prompts": datasets.Dataset.from_dict({"prompt": ["The cat", "A dog", "Hello", "Once"] * 2}),
        "tokenizer": byte_tokenizer(),
        # what the first example imports
        "CheckpointConfig": CheckpointConfig,
        "CheckpointedModel": CheckpointedModel,
        "RematTrainer": RematTrainer,
        "remat_trainer_class": remat_trainer_class,
    }


@pytest.mark.parametrize("index", range(len(EXAMPLES)), ids=[f"example-{i + 1}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(index, tmp_path, monkeypatch):
    assert len(EXAMPLES) >= 5, "the README's examples were not found"
    code = EXAMPLES[index]
    monkeypatch.chdir(tmp_path)
    distributed = "DistributedDataParallel" in code or "fully_shard" in code
    if distributed:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        exec(compile(code, f"README.md example {index + 1}", "exec"), _given(tmp_path))
    finally:
        if distributed:
            dist.destroy_process_group()


def test_the_where_things_live_table_names_every_module_and_only_files_that_exist():
    """A contributor looks a file up there: modules added since were missing from it, and a path without its
    folder named no file."""
    source = README.parent / "src" / "remat"
    section = README.read_text().split("## Where things live", 1)[1].split("\n## ", 1)[0]
    table = section[section.index("| to find |") :]
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", table))
    for name in named:  # a bare name in a row of a folder (`planner/` (`measuring.py`, ...)) is in that folder
        assert (source / name).exists() or ("/" not in name and any(source.rglob(name))), f"no file {name}"
    folders = {name for name in named if name.endswith("/")}
    modules = {str(p.relative_to(source)) for p in source.rglob("*.py")} - {"__init__.py"}
    packages = {name.rsplit("/", 1)[0] for name in named if "/" in name}  # a package's __init__ goes with its files
    modules -= {f"{package}/__init__.py" for package in packages}
    unnamed = [m for m in modules if m not in named and not any(m.startswith(folder) for folder in folders)]
    assert not unnamed, f"no row names {sorted(unnamed)}"
