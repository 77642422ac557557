"""remat: an authoritative per-layer activation checkpoint map for Hugging Face models."""

__version__ = "0.1.0"

from .config import CheckpointConfig  # noqa: E402
from .layers import NoCheckpointableLayersError  # noqa: E402
from .model import CheckpointedModel  # noqa: E402
from .plan import CheckpointMap, LayerPlan  # noqa: E402

__all__ = ["CheckpointConfig", "CheckpointMap", "CheckpointedModel", "LayerPlan", "NoCheckpointableLayersError", "__version__"]
