"""remat: an authoritative per-layer activation checkpoint map for Hugging Face models."""

from .version import __version__

from .config import CheckpointConfig
from .layers import NoCheckpointableLayersError
from .model import CheckpointedModel
from .plan import CheckpointMap, LayerPlan

__all__ = [
    "CheckpointConfig",
    "CheckpointMap",
    "CheckpointedModel",
    "LayerPlan",
    "NoCheckpointableLayersError",
    "RematTrainer",
    "RematTrainerMixin",
    "__version__",
    "remat_trainer_class",
]

_TRAINER_NAMES = ("RematTrainer", "RematTrainerMixin", "remat_trainer_class")


def __getattr__(name: str):
    """Trainer support is imported on first use: `import remat` stays free of Trainer's imports."""
    if name in _TRAINER_NAMES:
        from .integrations import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
