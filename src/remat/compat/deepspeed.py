"""DeepSpeed ZeRO-3 under remat's recompute. torch's non-reentrant checkpoint keeps a parameter that does not
require grad (LoRA's frozen base, a quantized weight) as the live tensor, not a detached copy; ZeRO-3's hook after
each submodule's forward frees a parameter in place (`param.data = torch.empty(0)`), also during a recompute, so
the recomputed tensor shrinks to [0] before torch compares it with the forward's: `CheckpointError: saved [1024]
vs recomputed [0]` (transformers #47254; fixed inside DeepSpeed after 0.19.2). remat holds the recomputed layer's
frozen ZeRO-3 parameters gathered through its recompute, the way ZeRO-3 holds a parameter a submodule still uses
(an entry in the parameter's `ds_active_sub_modules`). A submodule's backward hook frees them after; one whose
output needs no gradient (the first layer's, fed by frozen embeddings) has no such hook, so what is still gathered
when the backward ends is freed then, as DeepSpeed's own fix does. Only the wrapped layer's own parameters are
touched, and only while its backward runs."""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator

import torch
from torch import nn

# Entries in `ds_active_sub_modules`: negative, so never a submodule id ZeRO-3 gives out (they count up from 0), and
# one per hold, so two holds of a shared parameter do not end each other's.
_holds = itertools.count(-1, -1)


@contextlib.contextmanager
def frozen_zero3_parameters_held(layer: nn.Module | None) -> Iterator[None]:
    """Keep ZeRO-3 from freeing `layer`'s frozen parameters while its recompute runs (no-op without ZeRO-3: without
    DeepSpeed imported no parameter can be partitioned, and the layer's parameters are not even listed)."""
    if layer is None or "deepspeed" not in sys.modules:
        yield
        return
    held = [p for p in layer.parameters() if not p.requires_grad and _zero3(p)]
    if not held:
        yield
        return
    hold = next(_holds)
    for param in held:
        param.ds_active_sub_modules.add(hold)
    try:
        yield
    finally:
        for param in held:
            param.ds_active_sub_modules.discard(hold)
        if torch._C._current_graph_task_id() != -1:  # a recompute inside backward: free leftovers when it ends
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _free_unused(held))


def _free_unused(params: list[nn.Parameter]) -> None:
    """Partition again what no submodule uses any more (ZeRO-3's own rule for releasing a parameter)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for param in params:
        unused = param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_active_sub_modules
        if unused and not getattr(param, "ds_persist", False):
            param.partition()


def _zero3(param: nn.Parameter) -> bool:
    return isinstance(getattr(param, "ds_active_sub_modules", None), set)
