""" "selective": op-level selective checkpointing inside the layer.

The layer runs under torch's selective checkpoint contexts: the outputs of its linear
projections (the matrix multiplications with weights, which nn.Linear and LoRA dispatch to) and
of fused attention kernels are kept; everything else is recomputed in backward: norms, rotary
embeddings, activations, dropout, elementwise ops, and an eager attention's core (the score and
weighted-value matmuls and the softmax between them, whose outputs grow with the square of the
sequence length), and low-rank expansions such as LoRA's B product. This is Korthikanti et
al.'s (2022) selective recompute: the expensive GEMMs run once, and what is recomputed is cheap
to run and costly to keep. It holds more than
"recompute" and far less than "none". The layer input waits on the device.

Which ops are kept is decided at the dispatcher: the aten ops below, whatever module or kernel
calls them. Dropout masks are recomputed from the replayed RNG state, so gradients are exact.
torch supports this only in non-reentrant checkpointing.
"""

from __future__ import annotations

import functools
from typing import Any

from ..errors import PolicyError
from .base import Policy


class SelectivePolicy(Policy):
    def checkpoint_options(self, index: int) -> dict[str, Any]:
        # torch calls context_fn once per checkpointed call, for a fresh pair of contexts
        from ._selective_ops import fresh_contexts

        return {"context_fn": functools.partial(fresh_contexts, index)}

    def explain_recompute_error(self, error: RuntimeError, index: int) -> RuntimeError | None:
        from ..compat.transformers_compat import TORCH_SAC_MUTATED

        if TORCH_SAC_MUTATED not in str(error):
            return None
        return PolicyError(
            f"layer {index} changes, in place, the output of an op that the 'selective' policy keeps "
            f"(torch: {error}). The kept value is no longer the one backward needs; give this layer "
            f"another policy (layer_policies={{{index}: 'recompute'}})"
        )


SELECTIVE = SelectivePolicy(
    name="selective",
    checkpointed=True,
    input_on_host=False,
    needs_non_reentrant=True,
)


def __getattr__(name: str) -> Any:
    """The op-level rules (`KEPT_OPS`, `LOW_RANK`, ...) live in `_selective_ops`, with torch."""
    if name.startswith("__"):  # the import system's own questions
        raise AttributeError(name)
    from . import _selective_ops

    try:
        return getattr(_selective_ops, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
