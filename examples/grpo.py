"""GRPO with TRL on a wrapped model: generation between every optimizer step turns checkpointing
off and on, and the map (every second layer here) holds through all of it.

    python examples/grpo.py            # a tiny Llama on the CPU, about 20 seconds
    python examples/grpo.py --steps 3  # shorter

It prints the map, then for each optimizer step the reward and which layers were recomputed in
backward (the layers that ran again while autograd's backward was running): 0, 2 and 4, every
step. To fine-tune a real model on a GPU, change the two lines marked "REAL MODEL" below (the
model and its tokenizer); everything else stays.
"""

from __future__ import annotations

import argparse

import torch

from remat.demo import quiet_third_party_noise

quiet_third_party_noise()  # first: importing Trainer's callbacks imports bitsandbytes, which speaks at import

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402


class RecomputedLayers(TrainerCallback):
    """Prints, per optimizer step, the layers that started again inside backward."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.seen: set[int] = set()
        for index, layer in enumerate(layers):
            next(iter(layer.children())).register_forward_pre_hook(self._hook(index))

    def _hook(self, index: int):
        def hook(module, args):
            if torch._C._current_graph_task_id() != -1:  # autograd's engine is running a backward
                self.seen.add(index)

        return hook

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            print(f"step {state.global_step:2d}  reward {logs['reward']:.2f}  recomputed layers {sorted(self.seen)}")
        self.seen = set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output-dir", default="grpo_output")
    args = parser.parse_args()

    quiet_third_party_noise()
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from remat import CheckpointConfig, CheckpointedModel, remat_trainer_class
    from remat.demo import add_lora, build_model, byte_tokenizer, load_assets

    torch.manual_seed(0)
    model_config, _ = load_assets()
    model = add_lora(build_model(model_config))  # REAL MODEL: add_lora(AutoModelForCausalLM.from_pretrained(name))
    tokenizer = byte_tokenizer()  # REAL MODEL: AutoTokenizer.from_pretrained(name)

    cm = CheckpointedModel(model, CheckpointConfig(every_n_layers=2))
    print(cm.checkpoint_map, "\n")

    def reward_vowels(completions, **kwargs):  # a toy reward: completions rich in vowels
        return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]

    prompts = ["The cat", "A story about", "Once upon a time", "Hello", "The map is", "Memory is"]
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=True,  # TRL toggles it around every generation; the map survives
        disable_tqdm=True,
    )
    trainer = remat_trainer_class(GRPOTrainer)(
        model=cm,
        reward_funcs=reward_vowels,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts * 8}),
        processing_class=tokenizer,
        callbacks=[RecomputedLayers(cm.layers)],
    )
    trainer.remove_callback(PrinterCallback)  # the per-step lines above say what matters here
    trainer.train()
    print(f"\nthe map after training: layers {cm.checkpoint_map.checkpointed} checkpointed")


if __name__ == "__main__":
    main()
