"""remat: an authoritative per-layer activation checkpoint map for Hugging Face models."""

from .config import CheckpointConfig
from .plan import CheckpointMap, LayerPlan
from .version import __version__

__all__ = [
    "CheckpointConfig",
    "CheckpointMap",
    "CheckpointedModel",
    "LayerPlan",
    "NoCheckpointableLayersError",
    "RematTrainer",
    "__version__",
    "remat_trainer_class",
]


def __getattr__(name: str):
    """The wrapper and Trainer support are imported on first use: `import remat.config` and
    `remat.plan` stay free of torch, `import remat` of Trainer's imports."""
    if name == "CheckpointedModel":
        from .model import CheckpointedModel

        return CheckpointedModel
    if name == "NoCheckpointableLayersError":
        from .layers import NoCheckpointableLayersError

        return NoCheckpointableLayersError
    if name in ("RematTrainer", "remat_trainer_class"):
        from .integrations import trainer

        return getattr(trainer, name)
    if name == "RematTrainerMixin":
        raise AttributeError(
            "remat.RematTrainerMixin is gone: remat.RematTrainer for transformers' Trainer, "
            "remat.remat_trainer_class(YourTrainer) for any other Trainer class (TRL's, your own)"
        )
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
