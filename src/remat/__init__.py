"""remat: an authoritative per-layer activation checkpoint map for Hugging Face models."""

__version__ = "0.1.0"

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
    "__version__",
]
