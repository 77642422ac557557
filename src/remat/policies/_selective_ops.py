"""The torch side of the "selective" policy: which ops a layer keeps, decided at the dispatcher
(whatever module or kernel calls them); imported when a layer is first checkpointed selectively."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..errors import PolicyError

# The GEMMs of linear projections (nn.Linear and LoRA: mm / addmm; MoE experts: a grouped mm) and
# fused attention kernels, matched by packet (the flash-attn package's custom ops by name). bmm and
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


def fresh_contexts(index: int) -> Any:
    return create_selective_checkpoint_contexts(_KeptOutputs(index))


class _KeptOutputs:
    """What torch asks, op by op, for one checkpointed call: which ops to keep, and a guard torch
    lacks. torch catches a kept output changed in place only through a view of it; through a tensor
    merely sharing its storage (a linear on a 3-d input returns one) backward silently gets the
    changed value. So any in-place op on a kept output's storage is refused here, naming the layer."""

    def __init__(self, index: int):
        self.index = index
        self.kept: set[int] = set()

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        # compiled, the graph is functional (no op changes a kept output) and its tensors have no storage
        forward = not getattr(ctx, "is_recompute", False) and not torch.compiler.is_compiling()
        if forward:
            self._refuse_changes_to_kept(op, args, kwargs)
        decision = _keep_projections_and_attention(ctx, op, *args, **kwargs)
        if forward and decision is CheckpointPolicy.MUST_SAVE and not hasattr(ctx, "op_output"):
            raise PolicyError(  # (torch before 2.12 gives no outputs: the guard above would never fire)
                f"the 'selective' policy needs torch >= 2.12 (remat: 2.13), which tells it what each kept op "
                f"returned; torch {torch.__version__} does not, so an in-place change of a kept output could go unseen "
                f"and give wrong gradients: upgrade torch, or give layer {self.index} another policy ('recompute')",
                layer=self.index,
            )
        output = getattr(ctx, "op_output", None)
        if forward and output is not None and decision is CheckpointPolicy.MUST_SAVE:
            self.kept.update(_storages(output))
        return decision

    def _refuse_changes_to_kept(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        schema = getattr(op, "_schema", None)
        if not self.kept or schema is None or not schema.is_mutable:
            return
        values = [*args, *kwargs.values()]
        writes = [getattr(arg.alias_info, "is_write", False) for arg in schema.arguments]
        written = [value for value, write in zip(values, writes, strict=False) if write]
        if any(self.kept & _storages(value) for value in written):
            raise PolicyError(
                f"layer {self.index} changes in place ({op}) the output of an op that the 'selective' policy keeps "
                "for backward; backward would get the changed value. Give this layer another policy "
                f"(layer_policies={{{self.index}: 'recompute'}})",
                layer=self.index,
                op=str(op),
            )


def _storages(value: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)}


_KEPT_PACKETS = frozenset(getattr(torch.ops.aten, name) for name in KEPT_OPS if hasattr(torch.ops.aten, name))
_GEMMS = (torch.ops.aten.mm, torch.ops.aten.addmm)  # where a low-rank expansion can show
LOW_RANK = 256


@functools.cache
def _kept_packet(packet: Any) -> bool:
    """Whether this op's outputs are kept (cached: asked for every op of every selective layer)."""
    return packet in _KEPT_PACKETS or "flash_attn" in str(packet)


def _keep_projections_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    packet = getattr(op, "overloadpacket", op)
    kept = _kept_packet(packet) and not (packet in _GEMMS and _low_rank_expansion(args))
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def _low_rank_expansion(args: tuple[Any, ...]) -> bool:
    """A GEMM from a small rank r (at most `LOW_RANK`) up to a width of at least 8r, like LoRA's B: as
    big to keep as the projection it is added to, cheap to rerun (2r flops per output element). A
    model's own wide low-rank projections (DeepSeek's MLA, rank 512 and up) stay kept."""
    matrices = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2]
    if len(matrices) < 2:
        return False
    rank, width = matrices[-2].shape[-1], matrices[-1].shape[-1]
    return rank <= LOW_RANK and 8 * rank <= width
