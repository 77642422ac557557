"""DeepSpeed ZeRO-3 under remat's recompute. torch's non-reentrant checkpoint keeps a parameter that does not
require grad (LoRA's frozen base, a quantized weight) as the live tensor, not a detached copy; ZeRO-3's hook after
each submodule's forward frees a parameter in place (`param.data = torch.empty(0)`), also during a recompute, so
the recomputed tensor shrinks to [0] before torch compares it with the forward's: `CheckpointError: saved [1024]
vs recomputed [0]` (transformers #47254; fixed inside DeepSpeed after 0.19.2). remat holds the recomputed layer's
frozen ZeRO-3 parameters gathered through its recompute, the way ZeRO-3 holds a parameter a submodule still uses
(an entry in the parameter's `ds_active_sub_modules`); the layer's backward hooks free them after, as usual.
Only the wrapped layer's own parameters are touched, and only while its recompute runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

_RECOMPUTING = -1  # in `ds_active_sub_modules`: not a submodule id ZeRO-3 gives out (they count up from 0)


@contextlib.contextmanager
def frozen_zero3_parameters_held(layer: nn.Module | None) -> Iterator[None]:
    """Keep ZeRO-3 from freeing `layer`'s frozen parameters while its recompute runs (no-op without ZeRO-3)."""
    held = [] if layer is None else [p for p in layer.parameters() if not p.requires_grad and _zero3(p)]
    for param in held:
        param.ds_active_sub_modules.add(_RECOMPUTING)
    try:
        yield
    finally:
        for param in held:
            param.ds_active_sub_modules.discard(_RECOMPUTING)


def _zero3(param: nn.Parameter) -> bool:
    return isinstance(getattr(param, "ds_active_sub_modules", None), set)
