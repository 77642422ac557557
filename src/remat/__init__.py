"""remat: an authoritative per-layer activation checkpoint map for Hugging Face models."""

from typing import TYPE_CHECKING

from .config import CheckpointConfig
from .errors import (
    BlockSwapError,
    ConfigError,
    ConfigTypeError,
    FolderAccessError,
    FolderChangedError,
    FrozenConfigError,
    LockFileError,
    NoCheckpointableLayersError,
    NotSavedError,
    PolicyError,
    RematError,
    ReplacedWrapperError,
    SavedFileError,
    StaleProfileError,
    StateError,
)
from .plan import CheckpointMap, HeadPlan, LayerPlan
from .version import __version__

if TYPE_CHECKING:  # what `__getattr__` loads on first use, named for type checkers (py.typed)
    from .memory_errors import BudgetExceededError, OutOfMemoryError
    from .model import CheckpointedModel
    from .trainer import RematTrainer, remat_trainer_class

__all__ = [
    "BlockSwapError",
    "BudgetExceededError",
    "CheckpointConfig",
    "CheckpointMap",
    "CheckpointedModel",
    "ConfigError",
    "ConfigTypeError",
    "FolderAccessError",
    "FolderChangedError",
    "FrozenConfigError",
    "HeadPlan",
    "LayerPlan",
    "LockFileError",
    "NoCheckpointableLayersError",
    "NotSavedError",
    "OutOfMemoryError",
    "PolicyError",
    "RematError",
    "RematTrainer",
    "ReplacedWrapperError",
    "SavedFileError",
    "StaleProfileError",
    "StateError",
    "__version__",
    "remat_trainer_class",
]


if not TYPE_CHECKING:  # a checker reads the imports above: a misspelt `from remat import ...` is its error

    def __getattr__(name: str) -> object:
        """The wrapper, Trainer support and the out-of-memory errors load on first use: `import remat` stays
        torch-free."""
        if name == "CheckpointedModel":
            from . import model as home
        elif name in ("OutOfMemoryError", "BudgetExceededError"):  # torch's OutOfMemoryError too
            from . import memory_errors as home
        elif name in ("RematTrainer", "remat_trainer_class"):
            from . import trainer as home
        elif name == "RematTrainerMixin":
            raise AttributeError(
                "remat.RematTrainerMixin is gone: remat.RematTrainer for transformers' Trainer, "
                "remat.remat_trainer_class(YourTrainer) for any other Trainer class (TRL's, your own)"
            )
        else:
            raise AttributeError(f"module 'remat' has no attribute {name!r}")
        return getattr(home, name)

    def __dir__() -> list[str]:
        """`dir(remat)` and `help(remat)` list the names loaded on first use too."""
        return sorted({*globals(), *__all__})
