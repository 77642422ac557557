""" "selective": op-level selective checkpointing inside the layer.

The layer runs under torch's selective checkpoint contexts: the outputs of its linear
projections (the matrix multiplications with weights, which nn.Linear and LoRA dispatch to) and
of fused attention kernels are kept; everything else is recomputed in backward: norms, rotary
embeddings, activations, dropout, elementwise ops, and an eager attention's core (the score and
weighted-value matmuls and the softmax between them, whose outputs grow with the square of the
sequence length), and low-rank expansions such as LoRA's B product. This is Korthikanti et
al.'s (2022) selective recompute: the expensive GEMMs run once, and what is recomputed is cheap
to run and costly to keep. It holds more than
"recompute" and far less than "none". The layer input waits on the device, or in host memory
with `offload=True`.

Which ops are kept is decided at the dispatcher: the aten ops below, whatever module or kernel
calls them. Dropout masks are recomputed from the replayed RNG state, so gradients are exact.
torch supports this only in non-reentrant checkpointing.
"""

from __future__ import annotations

import functools
from typing import Any

from .base import Policy

# The GEMMs of linear projections (nn.Linear and LoRA dispatch to mm / addmm; MoE experts to a
# grouped mm) and the fused attention kernels; overloads are matched by their packet. bmm and
# baddbmm are left out on purpose: in a decoder layer they are an eager attention's core.
KEPT_OPS = (
    "mm",
    "addmm",
    "_grouped_mm",
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
        return {"context_fn": functools.partial(_contexts(), _keep_projections_and_attention)}


@functools.cache
def _kept_packets() -> frozenset:
    import torch

    return frozenset(getattr(torch.ops.aten, name) for name in KEPT_OPS if hasattr(torch.ops.aten, name))


def _keep_projections_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    packet = getattr(op, "overloadpacket", op)
    kept = packet in _kept_packets() and not _low_rank_expansion(packet, args)
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def _low_rank_expansion(packet: Any, args: tuple[Any, ...]) -> bool:
    """A GEMM whose inner dimension is at most an eighth of its output width, like LoRA's B
    (rank r up to the projection's width): as big to keep as the projection it is added to,
    and cheap to run again (2r flops per output element)."""
    import torch

    matrices = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2]
    if packet not in (torch.ops.aten.mm, torch.ops.aten.addmm) or len(matrices) < 2:
        return False
    left, right = matrices[-2], matrices[-1]
    return 8 * left.shape[-1] <= right.shape[-1]


def _contexts() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts


SELECTIVE = SelectivePolicy(
    name="selective",
    checkpointed=True,
    input_on_host=None,
    needs_non_reentrant=True,
    summary="linear projection and fused attention outputs kept, the rest recomputed in backward",
)
