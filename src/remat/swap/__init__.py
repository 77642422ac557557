"""Block swap: the frozen weights of chosen layers live in host memory between uses.

A swapped layer's parameters keep their identity; at rest they hold placeholders, and before
the layer runs (forward, or its recompute in backward) its weights are copied from a host copy
into a device slot. Swapped layers are always checkpointed (`remat.plan`), so forward never
keeps their weights. Trainable parameters (adapters) and weights shared with modules outside
the layer stay resident.

One job per file:

| file | job |
| --- | --- |
| `checks.py` | which layers and weights may be swapped (sharding and adapters recognised by type) |
| `slots.py` | the slot pool: placeholders, slots by layout, resident bytes |
| `schedule.py` | when weights are fetched and given back over forward and backward; recovery from faults |
| `guards.py` | what else touches a swapped layer: state_dict, load, `.to()`, copies, merges, compile |
| `swapper.py` | `WeightSwapper`: the swapped set, moving layers out and home |

Copies go through the device's transport (`remat.transport`), shared with offload.
"""

from ..transport import WeightMover
from .checks import check_swappable, weights_in_use
from .slots import LayerSwapStats
from .swapper import WeightSwapper

__all__ = ["LayerSwapStats", "WeightMover", "WeightSwapper", "check_swappable", "weights_in_use"]
