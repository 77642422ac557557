"""Block swap: the frozen weights of chosen layers live in host memory between uses, and are copied into a device
slot (through `remat.transport`) before the layer runs, in forward or in its recompute (swapped layers are always
checkpointed, `remat.plan`). `checks`: which layers and weights may be swapped; `slots`: placeholders, the slot pool
and when it fetches; `swapper`: moving layers out and home, and guards on everything else that touches them."""

from ..transport import WeightMover
from .checks import check_swappable, weights_in_use
from .slots import LayerSwapStats
from .swapper import WeightSwapper

__all__ = ["LayerSwapStats", "WeightMover", "WeightSwapper", "check_swappable", "weights_in_use"]
