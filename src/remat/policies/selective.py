""" "selective": op-level selective checkpointing inside the layer.

The layer runs under torch's selective checkpoint contexts: the outputs of its matrix
multiplications and attention are kept, everything else (norms, activations, rotary embeddings,
dropout, elementwise ops) is recomputed in backward. The expensive ops run once; the cheap ones
twice. It holds more than "recompute" and far less than "none" (Korthikanti et al. 2022 report
most of recompute's slowdown gone at a fraction of "none"'s memory). The layer input waits on
the device, or in host memory with `offload=True`.

Which ops are kept is decided at the dispatcher: the aten ops below, whatever module or kernel
calls them. Dropout masks are recomputed from the replayed RNG state, so gradients are exact.
torch supports this only in non-reentrant checkpointing.
"""

from __future__ import annotations

import functools
from typing import Any

from .base import Policy

# Matrix multiplications (what nn.Linear and the eager attention's matmuls dispatch to) and
# the fused attention kernels; overloads are matched by their packet.
KEPT_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
    "_efficient_attention_forward",
    "_flash_attention_forward",
)


class SelectivePolicy(Policy):
    def checkpoint_options(self) -> dict[str, Any]:
        # torch calls context_fn once per checkpointed call, for a fresh pair of contexts
        return {"context_fn": functools.partial(_contexts(), _keep_matmuls_and_attention)}


@functools.cache
def _kept_packets() -> frozenset:
    import torch

    return frozenset(getattr(torch.ops.aten, name) for name in KEPT_OPS if hasattr(torch.ops.aten, name))


def _keep_matmuls_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    kept = getattr(op, "overloadpacket", op) in _kept_packets()
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts


SELECTIVE = SelectivePolicy(
    name="selective",
    checkpointed=True,
    input_on_host=None,
    needs_non_reentrant=True,
    summary="matmul and attention outputs kept, the rest recomputed in backward",
)
