"""The Trainer family with `model=cm`. No class is patched: the mixin builds the trainer with `cm.model`, so
isinstance checks see what they would without remat, and adds what the model cannot (TRL's `peft_config=`
PeftModel adopted, the map in the logs and every save, a warning when the training arguments replace it)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
import weakref
from typing import Any, TypeVar, cast

import torch
from accelerate.utils import is_compiled_module
from transformers import Trainer, TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from .compat.transformers_compat import trainer_asks_for_checkpointing, trainer_checkpointing_kwargs
from .controller import controller_of_wrapper, owners_of
from .errors import ConfigError, ConfigTypeError
from .persistence import apply_saved_config, resume_undone_on_failure
from .persistence.pair_format import ADAPTER_WEIGHTS, is_peft_model, save_model_pair
from .persistence.peft_loading import tensor_shapes
from .plan import plan_layers
from .policies import CHECKPOINTED
from .policies import NAMES as POLICY_NAMES
from .routes import config_from_route, describe_changes
from .saving.folder import CONFIG_NAME, recover

logger = logging.getLogger("remat")

__all__ = ["RematTrainer", "remat_trainer_class"]


class _RematTrainerMixin:
    """What `RematTrainer` and `remat_trainer_class(cls)` put in front of a Trainer class; a model
    that is not a wrapper goes through the base class untouched."""

    model: Any
    args: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        model = kwargs["model"] if "model" in kwargs else (args[0] if args else None)
        _refuse_compiled_wrapper(model)
        controller = controller_of_wrapper(model)
        self.checkpointed_model = cm = model if controller is not None else None
        if cm is None:
            # (a name or None, TRL's and model_init's: no wrapper to expect; cm.model: its wrapper's map runs)
            if isinstance(model, torch.nn.Module) and not owners_of(model):
                logger.warning(
                    "%s was given a %s that no CheckpointedModel wraps: it trains as %s does, with no checkpoint map "
                    "and no checkpoint_config.json in its saves; to checkpoint with remat, pass "
                    "CheckpointedModel(model, ...)",
                    type(self).__name__,
                    type(model).__name__,
                    (mro := type(self).__mro__)[mro.index(_RematTrainerMixin) + 1].__name__,
                )
            super().__init__(*args, **kwargs)
            if self.checkpointed_model is not None:  # model_init returned a wrapper (`call_model_init`)
                self.add_callback(_MapInLogs(self))
            return
        own_config, own_map = controller.config, controller.checkpoint_map
        # options the route would refuse at train(), refused before a trainer's peft_config= changes the model
        if (arguments := _training_arguments(super().__init__, args, kwargs)) is not None:
            _arguments_config(own_config, arguments)
        if "model" in kwargs:
            kwargs["model"] = model.model
        else:
            args = (model.model, *args[1:])
        super().__init__(*args, **kwargs)
        if self.model is not cm.model:  # a TRL trainer given peft_config= built a PeftModel around cm.model
            controller.adopt(self.model, f"{type(self).__name__}(peft_config=...)")
        _warn_if_arguments_change_the_map(controller, own_config, own_map, self.args)
        self.add_callback(_MapInLogs(self))
        if cm.is_enabled and not trainer_asks_for_checkpointing(self.args) and cm.checkpoint_map.checkpointed:
            budget = cm.checkpoint_config.budget  # the map shown until then is pending: every layer recomputed
            logger.info(
                "the training arguments do not ask for checkpointing, so Trainer leaves it alone: the wrapper's map "
                "applies (%s); cm.disable() trains without checkpointing",
                f"budget {budget}: planned per step length from the first training step"
                if budget is not None
                else f"layers {cm.checkpoint_map.checkpointed} checkpointed",
            )

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's optimizer (also one given as `optimizers=`: Trainer returns it here), made known to a budget."""
        optimizer = super().create_optimizer(*args, **kwargs)  # type: ignore[misc]
        if self.checkpointed_model is not None and isinstance(optimizer, torch.optim.Optimizer):
            controller_of_wrapper(self.checkpointed_model).budget.set_optimizer(optimizer)
        return optimizer

    def log(self, logs: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """With a budget, beside the loss, the receipt of the largest bucket trained since the last log (under
        gradient accumulation the step's largest micro-batch, which sets its peak): its tokens, its plan's recomputed
        layers, predicted (and on an accelerator measured) bytes. Other lines (evaluation, a callback's) carry none."""
        cm = self.checkpointed_model
        budget = controller_of_wrapper(cm).budget if cm is not None else None
        if budget is not None and budget.unlogged and "loss" in logs:  # a training line (Trainer's, TRL's)
            ran = [r for key in budget.unlogged if (r := budget.receipts.get(key)) is not None]
            budget.unlogged.clear()
            if ran:  # the plan predicting the most bytes sets the step's peak (a larger bucket may recompute more)
                receipt = max(ran, key=lambda r: (r.predicted_bytes or 0, r.bucket_tokens, r.bucket_length or 0))
                logs = {**logs, **receipt.log_values()}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def call_model_init(self, trial: Any = None) -> Any:
        """`model_init` may return a wrapper too (also on every hyperparameter-search trial)."""
        model = super().call_model_init(trial)  # type: ignore[misc]
        _refuse_compiled_wrapper(model)
        if (controller := controller_of_wrapper(model)) is not None:
            _arguments_config(controller.config, self.args)  # refused now, as for model=cm, not at train()
            if not self.__dict__.get("_said_arguments_change_the_map"):  # Trainer calls it in __init__ and train()
                self._said_arguments_change_the_map = True
                _warn_if_arguments_change_the_map(controller, controller.config, controller.checkpoint_map, self.args)
            self.checkpointed_model = model
            return model.model
        return model

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's save and `checkpoint_config.json` committed as one, also while disabled; a process that
        does not save runs Trainer's `_save` as is (it may take part in gathering a sharded model)."""
        cm, base_save = self.checkpointed_model, super()._save  # type: ignore[misc]
        if cm is None or not getattr(self.args, "should_save", True):
            return base_save(output_dir, state_dict=state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if state_dict is not None and not state_dict and getattr(self, "is_deepspeed_enabled", False):
            logger.warning(
                "%s: DeepSpeed ZeRO-3 kept the weights partitioned, so Trainer saves none here (the adapter file is "
                "empty) and the trained ones only in DeepSpeed's files (global_step*/, zero_to_fp32.py); set "
                '"stage3_gather_16bit_weights_on_model_save": true in the DeepSpeed config to save them here',
                output_dir,
            )
        controller = controller_of_wrapper(cm)
        controller.check_not_replaced("RematTrainer's save")  # its config no longer runs on the model
        save_model_pair(controller, output_dir, lambda to: base_save(to, state_dict=state_dict))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """`resume_from_checkpoint=True` resumes from the newest checkpoint that Trainer finished writing: a save
        killed midway leaves a newer one without `trainer_state.json` (Trainer's last file), which Trainer would pick
        and fail on (or worse, start again from step 0 on its weights); a WARNING names both."""
        if resume_from_checkpoint is True and self.checkpointed_model is not None:
            resume_from_checkpoint = _last_complete_checkpoint(self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        cm, folder = self.checkpointed_model, resume_from_checkpoint
        recover(folder)  # a save killed mid-commit: finished, or its staging removed, before Trainer looks inside
        if cm is None:
            return super()._load_from_checkpoint(folder, model)  # type: ignore[misc]
        if model is None and _saved_whole(cm, folder):
            logger.info("%s holds the whole wrapper (a plain Trainer(model=cm) wrote it): loading it as is", folder)
            model = cm
        if hasattr(loader := cm.model.__dict__.get("load_adapter"), "main_loaded_from"):
            loader.main_loaded_from.clear()  # what this resume loads, not an earlier one (a second resume, a notebook)
        with resume_undone_on_failure(controller_of_wrapper(cm)):  # one adapter refused: none loaded, no map applied
            super()._load_from_checkpoint(folder, model)  # type: ignore[misc]
            if model is None:
                _resume_main_adapter(cm, folder)
            _apply_saved_config(cm, folder, "resuming")
            _arguments_over_the_resumed_map(cm, self.args)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Every resume calls this once the model is loaded. Under DeepSpeed the engine loads the model from its
        own files and Trainer never calls `_load_from_checkpoint`: the saved map is applied here instead."""
        super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        cm = self.checkpointed_model
        if cm is not None and checkpoint is not None and getattr(self, "is_deepspeed_enabled", False):
            _apply_saved_config(cm, checkpoint, "resuming")
            _arguments_over_the_resumed_map(cm, self.args)

    def _load_best_model(self) -> None:
        cm, best = self.checkpointed_model, self.state.best_model_checkpoint  # type: ignore[attr-defined]
        if cm is None or best is None:
            return super()._load_best_model()  # type: ignore[misc]
        engine = getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False)
        if not engine and _adapters_in_subfolders(cm, best):
            # Trainer's best-model load reads the top of the folder only, into the active adapter: a named adapter's
            # weights were not loaded (or another's were), and the best checkpoint's map went onto them
            logger.info("%s: adapters in subfolders, which Trainer's best-model load skips: loading them all", best)
            self._load_from_checkpoint(best)
            return
        if _saved_whole(cm, best):
            self.model = cm  # Trainer loads into self.model; the folder holds the wrapper's names
            try:
                super()._load_best_model()  # type: ignore[misc]
            finally:
                self.model = cm.model
        else:
            super()._load_best_model()  # type: ignore[misc]
        _apply_saved_config(cm, best, "loading the best model")


def _training_arguments(init: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The `args` a trainer's `__init__` is given, where it takes them (third in TRL's DPO, KTO, GRPO); None if not
    given, or if the call does not fit (the base's own error follows). A subclass's `(*args, **kwargs)`: by keyword."""
    signature = inspect.signature(init)
    if (named := signature.parameters.get("args")) is None or named.kind is not named.POSITIONAL_OR_KEYWORD:
        return kwargs.get("args")
    try:
        return signature.bind(*args, **kwargs).arguments.get("args")
    except TypeError:
        return None


def _refuse_compiled_wrapper(model: Any) -> None:
    """`torch.compile(cm)` hides the wrapper: Trainer would save an unknown module, TRL miss the PeftModel."""
    if is_compiled_module(model) and controller_of_wrapper(getattr(model, "_orig_mod", None)) is not None:
        raise ConfigTypeError(
            "RematTrainer was given torch.compile(cm): pass the CheckpointedModel itself and let the trainer compile "
            "what it trains: RematTrainer(model=cm, args=TrainingArguments(..., torch_compile=True)) (options: "
            "torch_compile_backend=, torch_compile_mode=), or call cm.compile(...) before building the trainer"
        )


def _warn_if_arguments_change_the_map(controller: Any, own_config: Any, own_map: Any, args: Any) -> None:
    """A WARNING when the training arguments' checkpointing options replace the wrapper's (the route logs INFO)."""
    asked, runs = _arguments_config(own_config, args)
    if asked is None or not runs:
        return
    kwargs = trainer_checkpointing_kwargs(args)
    becomes = (
        f"the budget ({asked.budget}) plans each step's map with them"
        if asked.budget is not None
        else f"the map {own_map!r} becomes "
        f"{dataclasses.replace(plan_layers(asked, controller.discovery.names), head=own_map.head)!r} when training "
        "starts"
    )
    logger.warning(
        "the training arguments' checkpointing options %r replace the CheckpointedModel's own config (%s): %s. To "
        "keep the wrapper's, leave those options out of the training arguments (gradient_checkpointing=True alone "
        "keeps it)",
        kwargs,
        describe_changes(own_config, asked),
        becomes,
    )


class _MapInLogs(TrainerCallback):
    """At train begin, the map that will run in the trainer's logs (and so every reporting
    integration), under `remat/` keys, numbers only (TensorBoard and MLflow drop anything else)."""

    def __init__(self, trainer: Any):
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None and trainer.checkpointed_model is not None:
            controller = controller_of_wrapper(trainer.checkpointed_model)
            controller.budget.unlogged.clear()  # forwards before training (a check) are no step's
            # The base class's log: TRL's trainers average their own metrics in theirs.
            Trainer.log(trainer, map_summary(controller))


def map_summary(controller: Any) -> dict[str, int | float]:
    """The map that runs as numbers: layers per policy, swapped, and a planned config's prediction. Under a budget
    the map is planned per step (each step's is logged with its loss, `Receipt.log_values`): the budget instead."""
    plans = list(controller.checkpoint_map)
    # (a wrapper left in inference mode runs its map from the first training forward: the trainer's is one)
    policies = [plan.policy if controller.is_enabled else "none" for plan in plans]
    summary: dict[str, int | float] = {"remat/enabled": int(controller.is_enabled), "remat/layers": len(plans)}
    if (budget := controller.config.budget_bytes) is not None:
        summary["remat/budget_bytes"] = budget
    else:
        summary["remat/checkpointed_layers"] = sum(policy in CHECKPOINTED for policy in policies)
        summary.update({f"remat/layers_{name}": policies.count(name) for name in POLICY_NAMES})
    summary["remat/swapped_layers"] = sum(plan.swapped for plan in plans) if controller.is_enabled else 0
    for key, field in (
        ("remat/planned_activation_bytes", "predicted_device_bytes"),
        ("remat/planned_host_bytes", "predicted_host_bytes"),
        ("remat/planned_step_peak_bytes", "predicted_peak_bytes"),
        ("remat/planned_budget_bytes", "planned_budget"),
    ):
        value = getattr(controller.config, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            summary[key] = value
    return summary


def _last_complete_checkpoint(output_dir: str) -> str:
    """The newest `checkpoint-N` in `output_dir` holding `trainer_state.json`, each newer one's own save of the model
    recovered first (`remat.saving.folder.recover`) and said in a WARNING; Trainer's error when there is none."""
    numbered = [
        (int(m.group(1)), n)
        for n in os.listdir(output_dir)
        if (m := _CHECKPOINT.fullmatch(n)) and os.path.isdir(os.path.join(output_dir, n))
    ]
    skipped = []
    for _, name in sorted(numbered, reverse=True):
        folder = os.path.join(output_dir, name)
        recover(folder)
        if os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME)):
            if skipped:
                logger.warning(
                    "resume_from_checkpoint=True: %s %s no %s (a save was interrupted): resuming from %s",
                    ", ".join(skipped),
                    "holds" if len(skipped) == 1 else "hold",
                    TRAINER_STATE_NAME,
                    folder,
                )
            return folder
        skipped.append(folder)
    raise ConfigError(
        f"resume_from_checkpoint=True: no checkpoint in {output_dir} holds {TRAINER_STATE_NAME}"
        + (f" ({', '.join(skipped)}: saves that were interrupted)" if skipped else "")
        + ": train without resuming, or name a checkpoint folder"
    )


_CHECKPOINT = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")


def _saved_whole(cm: Any, folder: str) -> bool:
    """Whether the folder's weights are `cm.state_dict()`, as `Trainer(model=cm)` writes them: loaded
    into `cm.model` they would match no name and silently keep untrained weights."""
    for weights in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):  # single-file weights
        if os.path.isfile(file := os.path.join(folder, weights)):
            names, wrapped = set(tensor_shapes(file)), set(cm.model.state_dict())
            return not names <= wrapped and names <= {"model." + name for name in wrapped}
    return False


def _resume_main_adapter(cm: Any, folder: str) -> None:
    """transformers 5.17 and older resume a checkpoint of several adapters from their subfolders only: the main one,
    which PEFT saves at the top ("default"), was left as it was (untrained), silently. Loaded here as 5.24 does."""
    model, loader = cm.model, cm.model.__dict__.get("load_adapter")
    top = any(os.path.isfile(os.path.join(folder, name)) for name in ADAPTER_WEIGHTS)
    if not (top and is_peft_model(model) and "default" in model.peft_config and hasattr(loader, "main_loaded_from")):
        return
    if os.path.abspath(folder) in loader.main_loaded_from:
        return  # Trainer loaded it
    active = model.active_adapters[0]
    logger.info("%s: Trainer resumed only the adapters in subfolders; loading the main adapter 'default' too", folder)
    model.load_adapter(folder, "default", is_trainable=active == "default")
    model.set_adapter(active)


def _arguments_config(config: Any, args: Any) -> tuple[Any, set[str]]:
    """`config` with the training arguments' checkpointing options (None where they ask for none), and the fields
    changed that change what runs (under a budget, which plans every layer, `every_n_layers` and the policy do not);
    options the route refuses are refused naming the arguments."""
    if not trainer_asks_for_checkpointing(args):
        return None, set()
    asked = config_from_route(config, "TrainingArguments' checkpointing kwargs", trainer_checkpointing_kwargs(args), {})
    runs = set(config.changed_fields(asked))
    return asked, runs - {"every_n_layers", "checkpoint_policy"} if asked.budget is not None else runs


def _arguments_over_the_resumed_map(cm: Any, args: Any) -> None:
    """The training arguments' checkpointing options apply over a resumed checkpoint's map, as over the wrapper's
    own: transformers 5 turns checkpointing on (the route) before it loads the checkpoint, 4.57 after, so they lost
    to the saved map on one release and won on the other."""
    controller = controller_of_wrapper(cm)
    asked, runs = _arguments_config(controller.config, args)
    if asked is not None and controller.is_enabled and asked != controller.config:
        before, changes = controller.shown_map(), describe_changes(controller.config, asked)
        controller.enable(asked, cause="the training arguments")
        if not runs:
            return
        logger.warning(
            "the training arguments' checkpointing options apply over the resumed checkpoint's map (%s): the map "
            "was %s, it is now %s",
            changes,
            before,
            controller.shown_map(),
        )


def _adapters_in_subfolders(cm: Any, folder: str) -> bool:
    """A PeftModel's save with adapters of names of their own (PEFT writes each in a subfolder)."""
    return is_peft_model(cm.model) and any(
        os.path.isfile(os.path.join(folder, sub, name)) for sub in os.listdir(folder) for name in ADAPTER_WEIGHTS
    )


def _apply_saved_config(cm: Any, folder: str, cause: str) -> None:
    """Apply the folder's checkpoint config, checked, unless remat's `load_adapter` applied it
    already (read again, a save committed in between would pair its config with older adapters)."""
    recover(folder)  # a save that crashed mid-commit may not have its config in place yet
    if not os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        logger.warning("%s from %s: no %s there, the current checkpoint map stays", cause, folder, CONFIG_NAME)
        return
    loader = cm.model.__dict__.get("load_adapter")
    if getattr(loader, "loaded_from", None) == os.path.abspath(folder):
        loader.loaded_from = None
        return
    apply_saved_config(controller_of_wrapper(cm), folder, cause)


class RematTrainer(_RematTrainerMixin, Trainer):
    """`transformers.Trainer` given `model=cm`: trains, saves and resumes `cm.model` as for a
    PeftModel, with `checkpoint_config.json` in every checkpoint and the saved map applied on resume."""


_T = TypeVar("_T", bound=Trainer)


def remat_trainer_class(base: type[_T]) -> type[_T]:
    """`base` made remat-aware as `RematTrainer` is `Trainer`: `remat_trainer_class(trl.GRPOTrainer)`, typed as
    `base` (its own keywords type-check), the same class at each call."""
    if not (isinstance(base, type) and issubclass(base, Trainer)):
        raise ConfigTypeError(f"remat_trainer_class needs a transformers.Trainer subclass, got {base!r}")
    return cast("type[_T]", _made_aware(base))


@functools.cache
def _made_aware(base: type[Trainer]) -> type[Trainer]:
    if base is Trainer:
        return RematTrainer
    if issubclass(base, _RematTrainerMixin):
        return base
    return type(f"Remat{base.__name__}", (_RematTrainerMixin, base), {"__module__": __name__})
